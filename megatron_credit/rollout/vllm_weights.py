"""What a weight sync may send the vLLM engine, checked before it is sent: the engine model's table of HF
parameter names and shapes (:func:`hf_param_table`) and the check of each bucket against it
(:func:`check_bucket`). Pure functions over a ``transformers`` config (meta device) and tensors; no vLLM.

The names are the checkpoint's, the trainer's (``conversion.live.iter_hf_weight_buckets``) and what vLLM's
``load_weights`` takes, however transformers or vLLM store the weights: vLLM fuses q/k/v and
gate/up, and a mixture of experts' ``FusedMoE`` stacks a layer's experts (``w13_weight`` [E, 2I, H],
``w2_weight`` [E, H, I]) and maps per-expert names into them (its ``load_weights`` expert mapping);
transformers 5 stacks them too (``mlp.experts.gate_up_proj``), and the table names them one by one.
"""
from __future__ import annotations

from typing import Any, Mapping


def hf_param_table(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(table, required)`` of the model ``config`` (a ``transformers`` config) describes: HF parameter
    name -> shape (what a weight sync may send), and the names a full sync must send -- all of them but a
    tied ``lm_head.weight`` (the embedding carries it; vLLM's loaders skip it). Built on the meta device.

    Names are the checkpoint's, which the trainer sends and vLLM's loaders take: routed experts one by one
    (``mlp.experts.{e}.gate_proj.weight``; vLLM's ``FusedMoE`` maps them into its stacked ``w13_weight`` /
    ``w2_weight``), also where transformers 5 holds them stacked
    (:func:`~megatron_credit.rollout.weight_sync.checkpoint_shapes`).

    >>> from transformers import Qwen2Config
    >>> t, req = hf_param_table(Qwen2Config(vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
    ...                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    >>> t["model.layers.0.self_attn.k_proj.weight"], len(t), sorted(set(t) - req)
    ((2, 4), 15, ['lm_head.weight'])
    """
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_credit.rollout.weight_sync import checkpoint_shapes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    table = {hf: shape for name, t in model.state_dict().items()
             for hf, shape in checkpoint_shapes(name, tuple(t.shape)).items()}
    required = set(table) - ({"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set())
    return table, required


def check_bucket(bucket: Any, table: Mapping[str, tuple[int, ...]], *, group_of) -> list[str]:
    """Check one weight bucket against the engine's parameters BEFORE it is sent; return its names.

    Every name must be one of ``table`` (:func:`hf_param_table`), once, with that shape and a floating
    dtype (vLLM's loaders cast it to the engine's dtype); the bucket must hold every tensor of each sync
    group it touches (``group_of``: :func:`megatron_credit.rollout.weight_sync.sync_group`, a whole decoder
    layer): vLLM's CPU ``reload_weights`` rebuilds a layer wrongly from part of a fused group. Raises
    ValueError naming the tensor. A bad bucket sent would leave the engine wrong or, in a multiprocess
    engine, dead.

    >>> import torch
    >>> table = {"model.layers.0.q.weight": (2, 2), "model.layers.0.k.weight": (2, 2), "lm_head.weight": (3, 2)}
    >>> group = lambda n: n.rsplit(".", 2)[0] if n.startswith("model.layers.") else n
    >>> check_bucket([("lm_head.weight", torch.zeros(3, 2))], table, group_of=group)
    ['lm_head.weight']
    >>> check_bucket([("model.layers.0.q.weight", torch.zeros(2, 2))], table, group_of=group)
    Traceback (most recent call last):
    ...
    ValueError: weight sync: the bucket holds part of model.layers.0 (missing ['model.layers.0.k.weight']); a bucket must hold whole decoder layers
    """
    import torch

    names = []
    for item in bucket:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weight sync: a bucket holds (name, tensor) pairs; got {type(item).__name__}")
        name, t = item
        if name not in table:
            raise ValueError(f"weight sync: unknown parameter {name!r} (not in the rollout model; it has e.g. "
                             f"{_nearest_names(name, table)})")
        if name in names:
            raise ValueError(f"weight sync: {name!r} appears twice in one bucket")
        if tuple(t.shape) != table[name]:
            raise ValueError(f"weight sync: shape mismatch for {name!r}: got {tuple(t.shape)}, the engine's "
                             f"model has {table[name]}")
        if not t.is_floating_point():
            raise ValueError(f"weight sync: {name!r} has dtype {t.dtype}; weights must be floating point")
        names.append(name)
    have = set(names)
    for group in dict.fromkeys(group_of(n) for n in names):
        missing = sorted(n for n in table if group_of(n) == group and n not in have)
        if missing:
            raise ValueError(f"weight sync: the bucket holds part of {group} (missing {missing[:4]}"
                             f"{'...' if len(missing) > 4 else ''}); a bucket must hold whole decoder layers")
    return names


def _nearest_names(name: str, table: Mapping[str, Any], k: int = 4) -> list[str]:
    """Up to ``k`` names of ``table`` under the longest dotted prefix of ``name`` that any of them shares
    (the same layer's experts for a wrong expert name), for an error message.

    >>> table = {f"model.layers.0.mlp.experts.{e}.up_proj.weight": () for e in range(2)} | {"lm_head.weight": ()}
    >>> _nearest_names("model.layers.0.mlp.experts.gate_up_proj", table)
    ['model.layers.0.mlp.experts.0.up_proj.weight', 'model.layers.0.mlp.experts.1.up_proj.weight']
    """
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut]) + "."
        near = sorted(n for n in table if n.startswith(prefix))
        if near:
            return near[:k]
    return sorted(table)[:k]
