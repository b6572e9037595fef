"""The ``moe`` recipe section: the training choices of a mixture-of-experts actor (its router's auxiliary
losses, routing replay, grouped GEMM). A dense model ignores it; the facts of the checkpoint (experts,
top-k, routing) come from the model's family (``families/``), not from here.

>>> MoeConfig().transformer_config_kwargs()
{'moe_token_dispatcher_type': 'alltoall', 'moe_router_load_balancing_type': 'aux_loss', 'moe_aux_loss_coeff': 0.001, 'moe_z_loss_coeff': None}
>>> MoeConfig(load_balancing_type="none").transformer_config_kwargs()["moe_aux_loss_coeff"]
0.0
>>> MoeConfig(grouped_gemm=False).transformer_config_kwargs()["moe_grouped_gemm"]
False
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_credit.typed_build import NonNegativeFloat

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""megatron's ``moe_router_load_balancing_type`` values a top-k softmax router takes."""
ROUTING_REPLAY = ("rollout", "none")


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """The router's auxiliary losses (megatron's), added to the actor's loss in its backward."""

    load_balancing_type: str = "aux_loss"
    """megatron's load-balancing loss: ``aux_loss`` (Switch-style, over each micro-batch's tokens, as
    Qwen3-MoE trains), ``seq_aux_loss`` (per sequence), ``global_aux_loss`` (over the global batch) or
    ``none``."""
    aux_loss_coeff: NonNegativeFloat = 1e-3
    """Weight of the load-balancing loss (Qwen3-MoE's ``router_aux_loss_coef``: 1e-3)."""
    z_loss_coeff: NonNegativeFloat = 0.0
    """Weight of the router z-loss (ST-MoE; 0: off, as Qwen3-MoE)."""
    routing_replay: str = "rollout"
    """``rollout``: the actor's routers send each token to the experts the rollout engine sent it to, in the
    behaviour pass and the update (rollout routing replay, R3; the gate weights stay the trainer's); ``none``:
    the routers choose. Either way ``moe/routing_agreement`` reports how often they agree
    (``trainer/moe.py``). Tokens the engine reported no routing for keep the router's choice."""
    grouped_gemm: bool = True
    """With Transformer Engine (GPU), run a layer's local experts as one grouped GEMM per linear (megatron's
    ``TEGroupedMLP``); false: one GEMM per expert (``SequentialMLP``, what the local spec on CPU always
    builds). The weights and checkpoints are the same either way."""

    def __post_init__(self) -> None:
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe.load_balancing_type={self.load_balancing_type!r} is not one of "
                             f"{list(LOAD_BALANCING_TYPES)}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"moe.routing_replay={self.routing_replay!r} is not one of {list(ROUTING_REPLAY)}")

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of an MoE actor (``models.actor_transformer_config``). Grouped GEMM
        is the spec's choice (``models/hf_config.transformer_config_from_hf``); only turning it off is here."""
        off = self.load_balancing_type == "none"
        # alltoall: each rank sends its own token count (packed micro-batches differ in length across
        # ranks; megatron's default allgather dispatcher needs equal counts)
        return {"moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type": self.load_balancing_type,
                "moe_aux_loss_coeff": 0.0 if off else self.aux_loss_coeff,
                "moe_z_loss_coeff": self.z_loss_coeff or None,
                **({} if self.grouped_gemm else {"moe_grouped_gemm": False})}
