"""What an algorithm keeps across iterations and does around the trainer's fixed steps: an
:class:`AlgorithmState`, built once per launch, saved whole with every checkpoint (``state_dict``).

For the built-in algorithms that is CompPO's: its transport-gate control (``gate_controls``: the gates
Comp-GAE uses, from the captured ``kappa``) and its phase controller (``credit.phase``: the knobs of the
next iteration). Every other algorithm keeps nothing, and each method below is then a no-op. The trainer
calls the methods and names no gate or phase. No megatron import.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_credit.algorithm.knobs import StepKnobs, phase_knobs


def gate_stats(kappa: torch.Tensor, mask: torch.Tensor, transport=None) -> dict[str, torch.Tensor]:
    """Sums for ``comppo/gate_mean`` and the mean dynamic gate in the first / middle / last third of each
    response (by relative position; the paper reports 0.61 and 0.52 / 0.63 / 0.68 on math), and for
    ``comppo/transport_mean``, the mean of the gates the advantages used (``transport``)."""
    m = mask.bool()
    pos = torch.cumsum(m.long(), dim=1) - 1  # index of the token within its response
    length = m.sum(dim=1, keepdim=True).clamp(min=1)
    third = torch.div(3 * pos, length, rounding_mode="floor").clamp(max=2)
    out = {"sum:gate": torch.where(m, kappa, 0.0).sum(), "sum:gate_tokens": m.sum().float()}
    if transport is not None:  # the gate Comp-GAE actually used (a control's, or kappa itself)
        out["sum:transport"] = torch.where(m, transport, 0.0).sum()
    for i, name in enumerate(("first", "mid", "last")):
        sel = m & (third == i)
        out[f"sum:gate_{name}"] = torch.where(sel, kappa, 0.0).sum()
        out[f"sum:gate_{name}_tokens"] = sel.sum().float()
    return out


class AlgorithmState:
    """An algorithm's state across iterations (module docstring). ``spec.state(params, ...)`` builds it:
    ``seed`` and ``dp_rank`` seed a gate control's draws, ``dp_group`` / ``device`` carry its collectives."""

    def __init__(self, spec, params, *, seed: int, dp_rank: int, dp_group: Any = None, device: Any = None):
        self.gate_control = spec.gate_control(params, seed=seed, dp_rank=dp_rank, dp_group=dp_group, device=device)
        self.phase = spec.phase_controller(params)

    def advantage_inputs(self, side: Mapping[str, torch.Tensor], mask: torch.Tensor,
                         iteration: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What the estimator gets beyond the trainer's inputs, from the batch's side channel ``side``
        (``[B, T]`` each), and its ``sum:`` statistics: Comp-GAE's transport ``gates`` from the captured
        ``kappa`` (the dynamic gate, or a control's), for ``iteration``."""
        if self.gate_control is None:
            return {}, {}
        gates = self.gate_control.gates(side["kappa"], mask, iteration=iteration)
        return {"gates": gates}, gate_stats(side["kappa"], mask, gates)

    def knobs(self, base: StepKnobs) -> StepKnobs:
        """The knobs of the next iteration from the recipe's own (``base``): the phase's, when a phase
        controller runs."""
        return base if self.phase is None else phase_knobs(base, self.phase.phase)

    def after_iteration(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Feed the iteration's metrics to the phase controller; returns what to log (``phase/level``: 0
        stable ... 3 hard-stop), {} without one. :meth:`knobs` then gives the next iteration's."""
        if self.phase is None:
            return {}
        from megatron_credit.credit.phase import PHASES

        return {"phase/level": float(PHASES.index(self.phase.step(metrics)))}

    def state_dict(self) -> dict:
        out = {}
        if self.gate_control is not None:
            out["gate_control"] = self.gate_control.state_dict()
        if self.phase is not None:
            out["phase"] = self.phase.state_dict()
        return out

    def load_state_dict(self, state: Optional[Mapping]) -> None:
        """What :meth:`state_dict` saved; a part this state does not keep, or a missing one, is left as it is."""
        state = state or {}
        if self.gate_control is not None and "gate_control" in state:
            self.gate_control.load_state_dict(state["gate_control"])
        if self.phase is not None and "phase" in state:
            self.phase.load_state_dict(state["phase"])
