"""Mistral (7B v0.2 / v0.3, Nemo-style explicit ``head_dim``): the Llama layout without any bias.

HF Mistral hard-codes ``bias=False`` on every projection and reads ``head_dim`` when the config sets it
(Mistral Nemo: 128 with hidden 5120 and 32 heads); megatron's ``kv_channels`` takes it, so the tiny config
decouples it (hidden 64, 4 heads of 32). ``sliding_window`` must be off: a window of fewer positions than
``max_position_embeddings`` (Mistral 7B v0.1: 4096 of 32768) is refused in one line naming the field,
because the megatron actor attends to every earlier token (``models/family_facts.MISTRAL``).
"""
from megatron_credit.conversion.base import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                             PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT, Family, register_family)
from megatron_credit.models.family_facts import MISTRAL as ARCH

MISTRAL = register_family(Family(
    name="mistral",
    architectures=(ARCH.architecture,),
    arch=ARCH,
    tiny_config=dict(head_dim=32, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, PROJ_WEIGHT, PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM,
           OUTPUT),
))
