"""Copy streamed HF-named tensors into a live ``torch.nn.Module`` in place (no disk round trip).

The actor's conversion layer yields ``Iterable[list[tuple[str, Tensor]]]`` -- size-bounded buckets of
(HF parameter name, tensor). :func:`load_named_tensor_buckets` checks each bucket fully (every name
known, every shape equal) before copying any of it, so a bad bucket never half-applies, and by default
insists that every parameter was covered once the stream ends. Tied parameters (one tensor reachable
under two names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) count as covered when
either name arrives.

The buckets themselves are the sync protocol between the trainer and every engine: :func:`group_buckets`
cuts an HF-ordered stream into buckets of whole :func:`sync_group` groups (a decoder layer, or one tensor
apart from the layers), which the trainer's source (``conversion.live.iter_hf_weight_buckets``) yields
and the vLLM engine checks (``rollout.vllm_weights.check_bucket``).

>>> m = torch.nn.Linear(2, 1)
>>> load_named_tensor_buckets(m, [[("weight", torch.ones(1, 2))], [("bias", torch.zeros(1))]])
2
>>> m.weight.tolist()
[[1.0, 1.0]]
>>> load_named_tensor_buckets(m, [[("weigth", torch.ones(1, 2))]])
Traceback (most recent call last):
...
ValueError: weight sync: unknown parameter 'weigth' (not in the rollout model; it has e.g. ['bias', 'weight'])
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

import torch

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def sync_group(hf_name: str) -> str:
    """The weight-sync group of an HF tensor: its whole decoder layer, or the tensor alone (embeddings,
    final norm, head). A bucket never splits a group, because vLLM fuses q/k/v and gate/up per layer and
    its CPU backend's ``reload_weights`` rebuilds a layer wrongly from part of a fused group. In a
    mixture-of-experts layer the fused group is every routed expert of the layer: vLLM's ``FusedMoE``
    holds them all in two tensors (``w13_weight`` [E, 2I, H]: each expert's gate and up; ``w2_weight``
    [E, H, I]), one module, which ``reload_weights`` processes once it has received all of its elements
    (vLLM 0.32 ``model_loader/reload/layerwise.py``).

    >>> sync_group("model.layers.3.self_attn.q_proj.weight"), sync_group("lm_head.weight")
    ('model.layers.3', 'lm_head.weight')
    """
    m = _HF_LAYER.match(hf_name)
    return f"model.layers.{m.group(1)}" if m else hf_name


def group_buckets(named: Iterable[tuple[str, torch.Tensor]], *,
                  bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``(hf_name, tensor)`` pairs, in HF order, as buckets of whole sync groups (:func:`sync_group`) of at
    most ``bucket_bytes`` (a larger group is a bucket of its own): the buckets of every weight sync, the
    trainer's (:func:`iter_hf_weight_buckets`) and the tests' and GPU check's alike. Consumes ``named``
    lazily. ``bucket_bytes=1``: one group per bucket.

    >>> pairs = [(n, torch.zeros(2)) for n in ("model.embed_tokens.weight", "model.layers.0.q.weight",
    ...                                         "model.layers.0.k.weight", "model.layers.1.q.weight")]
    >>> [[n for n, _ in b] for b in group_buckets(pairs, bucket_bytes=1)]
    [['model.embed_tokens.weight'], ['model.layers.0.q.weight', 'model.layers.0.k.weight'], ['model.layers.1.q.weight']]
    >>> [len(b) for b in group_buckets(pairs, bucket_bytes=24)]
    [3, 1]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size, group = 0, None  # bytes in ``bucket``; the sync group of its last tensor
    for hf_name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes and sync_group(hf_name) != group:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name, t))
        size, group = size + nbytes, sync_group(hf_name)
    if bucket:
        yield bucket


def load_named_tensor_buckets(
    module: torch.nn.Module, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, strict: bool = True
) -> int:
    """Copy every (name, tensor) of every bucket into ``module``'s state in place; return the count.

    Tensors are cast to the destination's dtype and device by ``copy_``. Raises ValueError naming the
    tensor for an unknown name or a shape mismatch, and (``strict``) listing the parameters that no
    bucket covered. Buckets before a failing one stay applied.
    """
    targets = module.state_dict(keep_vars=True)
    by_identity: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        by_identity.setdefault(id(tensor), []).append(name)
    owner = {name: id(t) for name, t in targets.items()}
    for name, (view, base) in _expert_views(targets).items():
        targets[name], owner[name] = view, id(base)
    covered: set[int] = set()
    count = 0
    for bucket in buckets:
        for name, tensor in bucket:
            _check(name, tensor, targets)
        with torch.no_grad():
            for name, tensor in bucket:
                targets[name].copy_(tensor)
                covered.add(owner[name])
                count += 1
    if strict:
        missing = [names[0] for key, names in by_identity.items() if key not in covered]
        if missing:
            raise ValueError(
                f"weight sync: {len(missing)} parameter(s) of the rollout model received no tensor, "
                f"e.g. {sorted(missing)[:8]}"
            )
    return count


def stacked_expert_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, slice]]:
    """The per-expert checkpoint names of a routed-expert tensor that transformers 5 holds stacked, each
    with its expert and its rows of ``stacked[expert]``: ``[(hf_name, expert, rows), ...]``; ``[]`` for
    any other tensor. The weight stream (the trainer's, and checkpoints) names experts one by one.

    ``mlp.experts.gate_up_proj`` [E, 2I, H] is per expert ``[gate; up]`` (transformers 5 concatenates them
    on load), ``mlp.experts.down_proj`` [E, H, I] per expert ``down_proj``.

    >>> parts = stacked_expert_parts("model.layers.0.mlp.experts.gate_up_proj", (1, 4, 3))
    >>> [(n.split("experts.")[1], e, r) for n, e, r in parts]
    [('0.gate_proj.weight', 0, slice(0, 2, None)), ('0.up_proj.weight', 0, slice(2, 4, None))]
    >>> stacked_expert_parts("model.layers.0.mlp.gate.weight", (4, 3))
    []
    """
    if len(shape) != 3:
        return []
    experts, rows = shape[0], shape[1]
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix, half = name[:-len("gate_up_proj")], rows // 2
        return [(f"{prefix}{e}.{part}_proj.weight", e, s) for e in range(experts)
                for part, s in (("gate", slice(0, half)), ("up", slice(half, rows)))]
    if name.endswith("mlp.experts.down_proj"):
        prefix = name[:-len("down_proj")]
        return [(f"{prefix}{e}.down_proj.weight", e, slice(0, rows)) for e in range(experts)]
    return []


def checkpoint_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes a weight stream uses for the state-dict tensor ``name``: each
    expert's own tensor for one that transformers 5 stacks (:func:`stacked_expert_parts`), else the
    tensor itself.

    >>> checkpoint_shapes("model.layers.0.mlp.experts.down_proj", (2, 3, 5))
    {'model.layers.0.mlp.experts.0.down_proj.weight': (3, 5), 'model.layers.0.mlp.experts.1.down_proj.weight': (3, 5)}
    """
    parts = stacked_expert_parts(name, shape)
    if not parts:
        return {name: tuple(shape)}
    return {n: (rows.stop - rows.start, *shape[2:]) for n, _, rows in parts}


def _expert_views(targets: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint name -> (view, stacked tensor) of each routed expert that transformers 5 holds stacked
    (:func:`stacked_expert_parts`)."""
    return {hf_name: (t[e, rows], t) for name, t in targets.items()
            for hf_name, e, rows in stacked_expert_parts(name, tuple(t.shape))}


def _check(name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
    if name not in targets:
        raise ValueError(
            f"weight sync: unknown parameter {name!r} (not in the rollout model; it has e.g. "
            f"{sorted(targets)[:8]})"
        )
    want = tuple(targets[name].shape)
    if tuple(tensor.shape) != want:
        raise ValueError(f"weight sync: shape mismatch for {name!r}: got {tuple(tensor.shape)}, model has {want}")


class PeerBuckets:
    """The ranks of one engine's GPUs sending it every bucket from their own GPU (CUDA IPC from the
    colocated rank): each worker of a tensor-parallel engine then maps the memory of the trainer rank on
    its own GPU, never another GPU's (which would open a CUDA context there, ~0.5 GiB each).

    Every rank of the group stages each bucket on its own device with ``stage(bucket, device) ->
    (tensors, handle)``; the engine's leader calls :meth:`gather` with its handle and gets every rank's
    (its own first), sends them, then calls :meth:`done`; the other ranks run :meth:`follow` over the
    same stream, keeping each bucket's tensors alive until the leader is done with it. ``group``: the
    engine's ranks; ``leader``: its first (a global rank).
    """

    def __init__(self, group: Any, leader: int, stage: Callable[[list, torch.device], tuple[Any, Any]]):
        self.group, self.leader, self.stage = group, leader, stage

    def gather(self, handle: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.gather_object(handle, out, dst=self.leader, group=self.group)
        return out

    def done(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def follow(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], device: torch.device) -> None:
        """A non-leader rank's side of a sync: stage, hand over, wait, free; bucket by bucket."""
        import torch.distributed as dist

        for bucket in buckets:
            tensors, handle = self.stage(list(bucket), device)
            dist.gather_object(handle, None, dst=self.leader, group=self.group)
            self.done()  # the engine's workers have read this rank's memory
            del tensors, handle
