"""The mixture-of-experts terms of the memory plan: routed experts over expert parallelism, the router,
the token dispatcher's buffers and the expert optimizer shard (``planning/plan.py`` adds them).

megatron-core's MoE layer (``transformer/moe/moe_layer.py``) holds, on each rank:

* the **router** (``router.py``, ``TopKRouter.weight`` ``[E, h]``), replicated over TP and EP;
* ``E / EP`` **local experts** (``num_local_experts = num_moe_experts // ep_size``), each a SwiGLU MLP
  of width ``I_e`` whose ``linear_fc1`` (``2 I_e x h``) and ``linear_fc2`` (``h x I_e``) are split over
  the expert-TP group (ETP; megatron's default is the attention's TP), no biases;
* no shared expert (Qwen3-MoE has none).

Its optimizer states are sharded by megatron's distributed optimizer over the **expert data-parallel**
group (``parallel_state``: ``expert_data_parallel_size = world / (ETP x EP x PP)``; CP folds into it),
not over DP x CP as the dense parameters are.

The experts are one of two megatron modules (``transformer/moe/experts.py``), the same weights either way:
``TEGroupedMLP`` (the trainer's on GPU: Transformer Engine's spec with ``moe_grouped_gemm``; its
``linear_fc1`` / ``linear_fc2`` are TE ``GroupedLinear``s, one grouped GEMM per linear for all local experts)
or ``SequentialMLP`` (``moe.grouped_gemm: false``, or the local spec: a loop over the local experts, each an
``MLP`` of its own, one GEMM per expert and linear). :func:`expert_module` says which a recipe gets.

Activations of one MoE layer, per token of the layer's input (``T / TP`` tokens with sequence
parallelism, else ``T``), assuming balanced routing (each EP rank receives as many token copies as it
sends). The all-to-all dispatcher (``token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher``) permutes the
``T x top-k`` token copies by expert (``moe_utils.permute``: ``[T k, h]``), exchanges them over EP
(``all_to_all``: ``[T k, h]`` received) and, with ETP > 1, all-gathers them over ETP (``[T k ETP, h]``).
The experts keep for backward that input (``fc1``'s saved input: TE's ``GroupedLinear`` keeps its per-expert
splits, views of it, as a ``SequentialMLP`` expert's linear keeps its split), ``fc1``'s output
(``2 I_e / ETP`` per copy: the fused weighted SwiGLU's saved input, ``weighted_bias_swiglu_impl``, which
both modules call under the TE spec, whose ``bias_activation_fusion`` is on, ``models/fused_kernels.py``)
and the SwiGLU output times the routing probability (``I_e / ETP``: ``fc2``'s saved input; the probabilities
are applied inside the experts, so the combine's ``moe_utils.unpermute`` keeps only indices). In elements
per input token, for either module::

    moe = k (ETP h + 3 I_e)              (with the dtype of the activations)
    router = 2 E                         (fp32 logits and probabilities: moe_router_dtype fp32)

against a dense MLP's ``3 I / TP`` (also its fused SwiGLU's). The all-to-all's send buffer (the permuted
copies before the exchange) is freed once sent and is not counted; nor are the unfused SwiGLU's two more
``I_e`` (the SiLU output and the product before the probabilities) of the local spec, whose dense MLP is
counted fused as well. The modules differ in time, not memory: ``planning/timing.py`` counts
``SequentialMLP``'s GEMM calls (:func:`expert_gemm_calls`).

>>> a = MoeShape(hidden_size=2048, num_experts=128, top_k=8, expert_ffn=768)
>>> expert_layer_params(a, ep=8, etp=1)  # 16 local experts x 3 x 2048 x 768
75497472
>>> router_params(a)
262144
>>> moe_activation_elements(a, etp=1)  # 8 x (2048 + 3 x 768)
34816
>>> expert_gemm_calls(a, ep=8, grouped=False), expert_gemm_calls(a, ep=8, grouped=True)  # one layer, a forward
(32, 2)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """The routed-expert numbers of one MoE layer."""

    hidden_size: int
    """h."""
    num_experts: int
    """Routed experts E."""
    top_k: int
    """Experts per token k."""
    expert_ffn: int
    """One expert's SwiGLU width I_e."""


def router_params(a: MoeShape) -> int:
    """The router's ``[E, h]`` weight, replicated on every rank."""
    return a.num_experts * a.hidden_size


def expert_layer_params(a: MoeShape, *, ep: int, etp: int) -> int:
    """Parameters of one layer's local experts on one rank: ``E / EP`` experts of ``3 h I_e / ETP``."""
    return a.num_experts // ep * 3 * a.hidden_size * a.expert_ffn // etp


def moe_activation_elements(a: MoeShape, *, etp: int) -> int:
    """Activation elements one input token keeps in one MoE layer: the dispatched copies (gathered over
    ETP), the experts' fc1 output and their probability-weighted SwiGLU output (module docstring)."""
    return a.top_k * (etp * a.hidden_size + 3 * a.expert_ffn)


def expert_module(*, grouped_gemm: bool, transformer_impl: str) -> str:
    """megatron's experts module the trainer builds on a GPU: ``TEGroupedMLP`` with the Transformer Engine spec
    (``model.transformer_impl`` other than ``local``) and ``moe.grouped_gemm``, else ``SequentialMLP``."""
    return "TEGroupedMLP" if grouped_gemm and transformer_impl != "local" else "SequentialMLP"


def expert_gemm_calls(a: MoeShape, *, ep: int, grouped: bool) -> int:
    """GEMM calls one layer's local experts make in one forward: fc1 and fc2, once for all the experts
    (``TEGroupedMLP``'s grouped GEMMs) or once per expert (``SequentialMLP``'s ``E / EP`` MLPs). A backward
    makes twice as many (the input and the weight gradient of each)."""
    return 2 if grouped else 2 * (a.num_experts // ep)


def router_activation_bytes(a: MoeShape) -> int:
    """Bytes one input token keeps in the router: fp32 logits and probabilities over the E experts."""
    return 2 * 4 * a.num_experts


def expert_data_parallel_size(*, world: int, ep: int, etp: int, pp: int) -> int:
    """Ranks that hold the same experts and share their optimizer states: ``world / (ETP x EP x PP)``."""
    return max(world // (etp * ep * pp), 1)


def expert_layout_problems(*, num_experts: int, world: int, tp: int, pp: int, ep: int, etp: int,
                           sequence_parallel: bool) -> list[str]:
    """What megatron refuses in an expert layout, one line each naming the field."""
    ep_field, etp_field = "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size"
    if not num_experts:
        return [f"{ep_field}={ep} needs routed experts: the model has none"] if ep > 1 else []
    problems = []
    if num_experts % ep:
        problems.append(f"{ep_field}={ep} does not divide the model's {num_experts} routed experts")
    if world % (etp * ep * pp):
        problems.append(f"{etp_field} x {ep_field} x pipeline_model_parallel_size = {etp} x {ep} x {pp} = "
                        f"{etp * ep * pp} does not divide the world of {world} GPUs")
    if tp > 1 and ep > 1 and not sequence_parallel:  # megatron's TransformerConfig refuses it
        problems.append(f"parallel.sequence_parallel must be true with tensor_model_parallel_size={tp} and "
                        f"{ep_field}={ep} (megatron's MoE layer needs it)")
    return problems
