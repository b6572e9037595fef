"""Credit assignment: the transport scan and the estimators built on it (torch only, no megatron).

See docs/architecture.md, "One idea at the centre". Every function here is pure: tensors in, tensors out.
"""
from megatron_credit.credit.future_kl import fipo_weights, future_kl
from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.gates import (PositionGateSchedule, comppo_gate, fixed_gates, normalized_concentration,
                                          shuffle_gates)
from megatron_credit.credit.group import (broadcast_to_tokens, dr_grpo_advantages, grpo_advantages,
                                          rloo_advantages)
from megatron_credit.credit.scan import reverse_linear_scan

__all__ = [
    "PositionGateSchedule", "broadcast_to_tokens", "comp_gae", "comppo_gate", "dr_grpo_advantages", "fipo_weights",
    "fixed_gates", "future_kl", "gae", "grpo_advantages", "normalized_concentration", "reverse_linear_scan",
    "rloo_advantages", "shuffle_gates",
]
