"""Mistral (7B v0.2 / v0.3, Nemo-style explicit ``head_dim``): the Llama architecture without any bias.

HF Mistral hard-codes ``bias=False`` on every projection and reads ``head_dim`` when the config sets it
(Mistral Nemo: 128 with hidden 5120 and 32 heads); megatron's ``kv_channels`` takes it, so the tiny config
decouples it (hidden 64, 4 heads of 32). ``sliding_window`` must be off (:meth:`Mistral.refuse`).
"""
from __future__ import annotations

from typing import Any, Optional

from megatron_credit.families.base import Family, register_family
from megatron_credit.families.dense_rules import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                                  PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT)


class Mistral(Family):
    def refuse(self, cfg: Any) -> Optional[str]:
        """Mistral's ``sliding_window`` lets query ``q`` see key ``k`` when ``q - k < sliding_window``. The
        model is never run past ``max_position_embeddings`` (``check_sequence_length``), so a window of at
        least that many positions is full causal attention, exactly; a smaller one (Mistral 7B v0.1: 4096
        of 32768) is refused (the megatron actor attends to every earlier token on every layer)."""
        window = getattr(cfg, "sliding_window", None)
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if window is not None and (max_pos is None or int(window) < int(max_pos)):
            return (f"hf_config.sliding_window={window} is not supported: the megatron actor uses full causal "
                    f"attention, so sliding_window must be null or >= max_position_embeddings={max_pos}")
        return None


MISTRAL = register_family(Mistral(
    name="mistral",
    architectures=("MistralForCausalLM",),
    tiny_config=dict(head_dim=32, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, PROJ_WEIGHT, PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM,
           OUTPUT),
))
