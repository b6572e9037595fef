"""The model's numbers the planner needs and what they imply per GPU: parameters per pipeline stage and
rank (dense and MoE layers), activation bytes per token, KV-cache bytes per token (``planning/plan.py``
adds them up; ``planning/experts.py`` has the MoE terms)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_credit.planning.experts import (MoeShape, expert_layer_params, moe_activation_elements,
                                              router_activation_bytes, router_params)


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The numbers of a dense decoder the planner needs."""

    model_type: str
    """HF model type (``families/<family>.py``: what it adds to a layer's parameters)."""
    hidden_size: int
    """h."""
    num_layers: int
    """L."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key / value heads (query groups)."""
    head_dim: int
    """d."""
    intermediate_size: int
    """SwiGLU width I."""
    vocab_size: int
    """V."""
    tied_embeddings: bool
    """Output layer shares the embedding."""
    max_position_embeddings: int
    """Context length."""
    num_experts: int = 0
    """Routed experts per layer (0: a dense MLP; ``planning/experts.py``)."""
    top_k: int = 0
    """Experts per token."""
    expert_ffn: int = 0
    """One expert's SwiGLU width."""

    @property
    def moe(self) -> Optional[MoeShape]:
        """The MoE layer's numbers, None for a dense model."""
        if not self.num_experts:
            return None
        return MoeShape(hidden_size=self.hidden_size, num_experts=self.num_experts, top_k=self.top_k,
                        expert_ffn=self.expert_ffn)

    @classmethod
    def from_hf(cls, c) -> "Architecture":
        from megatron_credit.families import family_of
        from megatron_credit.models.hf_config import head_dim

        family = family_of(c.model_type)
        experts = family.num_experts(c)
        top_k = family.transformer_config_kwargs(c).get("moe_router_topk", 0) if experts else 0
        heads = c.num_attention_heads
        return cls(model_type=c.model_type, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                   num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=head_dim(c), intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                   tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                   max_position_embeddings=int(c.max_position_embeddings), num_experts=experts, top_k=int(top_k),
                   expert_ffn=family.expert_ffn_hidden_size(c))


def layer_param_count(a: Architecture, *, tp: int = 1, ep: int = 1, etp: Optional[int] = None) -> int:
    """Parameters of one decoder layer on one rank (megatron shards every matrix and the QKV bias over TP
    and replicates the norms; an MoE layer holds the router and ``E / EP`` experts over expert TP ``etp``,
    by default ``tp`` as in megatron)."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    qkv_rows = (q + 2 * kv) // tp  # a column-parallel linear, also when TP > KV heads (row blocks)
    from megatron_credit.families import family_of
    extra = family_of(a.model_type).extra_layer_params(qkv_rows=qkv_rows, head_dim=a.head_dim)  # bias, q/k norms
    attn = a.hidden_size * qkv_rows + (q // tp) * a.hidden_size
    moe = a.moe
    if moe is None:
        mlp = 3 * a.hidden_size * a.intermediate_size // tp
    else:
        mlp = router_params(moe) + expert_layer_params(moe, ep=ep, etp=etp or tp)
    return attn + mlp + 2 * a.hidden_size + extra


def lora_layer_param_count(a: Architecture, *, rank: int, targets, tp: int = 1) -> int:
    """LoRA adapter parameters of one decoder layer on one rank (``models/lora.py``): a column-parallel
    linear's ``A [r, in]`` whole and ``B [out / tp, r]`` split, a row-parallel one's ``A [r, in / tp]`` split and
    ``B [out, r]`` whole. An MoE layer's routed experts get none (their MLP targets count nothing).

    >>> arch = Architecture(model_type="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                     head_dim=16, intermediate_size=96, vocab_size=128, tied_embeddings=False,
    ...                     max_position_embeddings=64)
    >>> lora_layer_param_count(arch, rank=4, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    2944
    """
    h, q, kv, ffn = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    dense = a.moe is None
    shapes = {"linear_qkv": (h, (q + 2 * kv) // tp, "column"), "linear_proj": (q // tp, h, "row"),
              "linear_fc1": (h, 2 * ffn // tp, "column") if dense else None,
              "linear_fc2": (ffn // tp, h, "row") if dense else None}
    total = 0
    for t in targets:
        if shapes.get(t) is None:
            continue
        n_in, n_out, _ = shapes[t]
        total += rank * (n_in + n_out)
    return total


def stage_param_counts(a: Architecture, *, tp: int = 1, pp: int = 1, ep: int = 1,
                       etp: Optional[int] = None) -> list[int]:
    """Parameters per pipeline stage on one rank (TP, and EP / expert TP for the experts), first stage first.

    >>> arch = Architecture(model_type="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                     head_dim=16, intermediate_size=128, vocab_size=128, tied_embeddings=True,
    ...                     max_position_embeddings=256)
    >>> stage_param_counts(arch, pp=2)  # a tied output is a second copy on the last stage
    [45312, 45376]
    """
    per_stage = a.num_layers // pp * layer_param_count(a, tp=tp, ep=ep, etp=etp)
    emb = a.vocab_size * a.hidden_size // tp
    counts = [per_stage] * pp
    counts[0] += emb
    counts[-1] += a.hidden_size  # final norm
    if not a.tied_embeddings or pp > 1:
        counts[-1] += emb
    return counts


def stage_expert_param_count(a: Architecture, *, pp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters of one pipeline stage on one rank (0 for a dense model): the part of
    :func:`stage_param_counts` whose optimizer states shard over the expert data-parallel group."""
    return 0 if a.moe is None else a.num_layers // pp * expert_layer_params(a.moe, ep=ep, etp=etp)


def total_param_count(a: Architecture) -> int:
    """Parameters of the whole model (a tied output counted once; every expert)."""
    return a.num_layers * layer_param_count(a) + a.vocab_size * a.hidden_size * (1 if a.tied_embeddings else 2) \
        + a.hidden_size


def activation_bytes_per_token_layer(a: Architecture, *, tp: int, sequence_parallel: bool,
                                     dtype_bytes: int, etp: Optional[int] = None) -> int:
    """Bytes one token keeps for backward in one layer without recompute, flash attention (no score matrix).

    Stored: the attention norm's input and output (``h`` each), Q, K, V (``(heads + 2 kv) d``), the
    attention output (``heads d``), the MLP norm's input and output (``h`` each), fc1's output (``2 I``)
    and the SwiGLU output (``I``). The four ``h`` tensors are replicated over TP unless sequence parallel.
    An MoE layer keeps its router's and experts' activations instead of the dense MLP's
    (``planning/experts.py``: ``k (ETP h + 3 I_e)`` elements and ``8 E`` fp32 bytes per token of the
    layer's input, which is ``1 / TP`` of the tokens with sequence parallelism).
    """
    split = tp if sequence_parallel else 1
    norms = 4 * a.hidden_size // split
    kv = max(a.num_kv_heads // tp, 1) * a.head_dim
    attn = (2 * a.num_heads * a.head_dim) // tp + 2 * kv
    moe = a.moe
    if moe is None:
        return dtype_bytes * (norms + attn + 3 * a.intermediate_size // tp)
    experts = dtype_bytes * moe_activation_elements(moe, etp=etp or tp) + router_activation_bytes(moe)
    return dtype_bytes * (norms + attn) + experts // split


def activation_bytes(a: Architecture, *, tokens: int, tp: int, sequence_parallel: bool, recompute: Optional[str],
                     dtype_bytes: int, score_matrix: bool = False, etp: Optional[int] = None) -> int:
    """Activation bytes of one GPU for a micro-batch of ``tokens`` tokens (after the CP split), L layers
    (1F1B keeps PP micro-batches of L/PP layers on the first stage).

    ``recompute``: None / ``selective`` keep every layer's activations (selective recomputes only the
    core attention, which flash attention does not store anyway); ``full`` keeps each layer's input
    (``h`` per token) and one layer's activations while it is recomputed. ``score_matrix``: the local
    (non-flash) attention also keeps fp32 scores and probabilities, ``8 heads/TP tokens`` bytes a token.
    """
    per = activation_bytes_per_token_layer(a, tp=tp, sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes,
                                           etp=etp)
    if score_matrix:
        per += 8 * a.num_heads // tp * tokens
    if recompute == "full":
        inputs = dtype_bytes * a.hidden_size // (tp if sequence_parallel else 1)
        return tokens * (a.num_layers * inputs + per)
    return tokens * a.num_layers * per


def kv_bytes_per_token(a: Architecture, *, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one engine GPU (K and V of every layer, KV heads over TP)."""
    return 2 * a.num_layers * max(a.num_kv_heads // tp, 1) * a.head_dim * dtype_bytes


def active_param_count(a: Architecture) -> int:
    """Parameters one token's forward multiplies with: :func:`total_param_count` less, in an MoE model,
    the ``E - k`` experts per layer it is not routed to.

    >>> a = Architecture(model_type="qwen3_moe", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
    ...                  head_dim=128, intermediate_size=6144, vocab_size=151936, tied_embeddings=False,
    ...                  max_position_embeddings=40960, num_experts=128, top_k=8, expert_ffn=768)
    >>> round(total_param_count(a) / 1e9, 2), round(active_param_count(a) / 1e9, 2)  # 30B-A3B
    (30.53, 3.35)
    """
    if a.moe is None:
        return total_param_count(a)
    idle = a.num_layers * (a.num_experts - a.top_k) * expert_layer_params(a.moe, ep=1, etp=1) // a.num_experts
    return total_param_count(a) - idle
