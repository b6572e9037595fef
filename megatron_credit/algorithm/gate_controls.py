"""Comp-GAE's gate controls by name (``algorithm.params.gate_control``): what transport the advantages use
in place of the behaviour pass's dynamic gate ``kappa``. Torch only; the state (the position schedule)
travels in checkpoints through ``state_dict``.

- ``dynamic``: ``kappa`` itself;
- ``fixed``: ``fixed_gate`` on every response token;
- ``shuffle``: one permutation of this rank's batch's gates over its valid positions (seeded by the run's
  seed, the iteration and the DP rank), which keeps their distribution and breaks their placement;
- ``position``: ``kappa`` while the mean gate per bin of relative position is collected (over DP) for
  ``position_steps`` iterations, then that frozen schedule.

The critic keeps reading the dynamic ``kappa`` under every control: the controls change the credit
transport, not the critic's features, so the gate x critic factorial varies one thing at a time.

>>> sorted(GATE_CONTROLS)
['dynamic', 'fixed', 'position', 'shuffle']
>>> GATE_CONTROLS.get("fixed")(fixed_gate=0.5).gates(torch.ones(1, 2), torch.tensor([[True, False]]), iteration=1)
tensor([[0.5000, 0.0000]])
"""
from __future__ import annotations

import torch

from megatron_credit.credit import gates as g
from megatron_credit.registry import Registry

GATE_CONTROLS: Registry[type] = Registry("gate control")


class GateControlBase:
    """A gate control: ``gates(kappa, mask, iteration=...)`` with ``kappa, mask: [B, T]`` -> ``[B, T]``."""

    def __init__(self, *, fixed_gate: float = 0.61, position_bins: int = 20, position_steps: int = 10,
                 seed: int = 0, dp_rank: int = 0, dp_group=None, device=None):
        self.fixed_gate, self.position_bins, self.position_steps = fixed_gate, position_bins, position_steps
        self.seed, self.dp_rank, self.dp_group, self.device = seed, dp_rank, dp_group, device
        self.schedule = None
        self.collected = 0

    def gates(self, kappa: torch.Tensor, mask: torch.Tensor, *, iteration: int) -> torch.Tensor:
        return torch.where(mask.bool(), kappa, 0.0)

    def state_dict(self) -> dict:
        return {"collected": self.collected,
                "schedule": self.schedule.state_dict() if self.schedule is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.collected = state["collected"]
        if self.schedule is not None and state["schedule"] is not None:
            self.schedule.load_state_dict(state["schedule"])


@GATE_CONTROLS.register("dynamic")
class DynamicGates(GateControlBase):
    """``kappa`` on response tokens."""


@GATE_CONTROLS.register("fixed")
class FixedGates(GateControlBase):
    """``fixed_gate`` on every response token."""

    def gates(self, kappa, mask, *, iteration):
        return g.fixed_gates(mask, self.fixed_gate)


@GATE_CONTROLS.register("shuffle")
class ShuffledGates(GateControlBase):
    """A seeded permutation of the batch's gates over its valid positions."""

    def gates(self, kappa, mask, *, iteration):
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + iteration) * 4099 + self.dp_rank)
        return g.shuffle_gates(kappa, mask, generator=gen)


@GATE_CONTROLS.register("position")
class PositionGates(GateControlBase):
    """``kappa`` while a per-position schedule is collected, then the frozen schedule."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.schedule = g.PositionGateSchedule(self.position_bins)

    def gates(self, kappa, mask, *, iteration):
        if not self.schedule.frozen:
            self.schedule.collect(kappa, mask, group=self.dp_group, device=self.device)
            self.collected += 1
            if self.collected >= self.position_steps:
                self.schedule.freeze()
            return torch.where(mask.bool(), kappa, 0.0)
        return self.schedule.gates(mask)


class GateControl:
    """Comp-GAE's transport from the behaviour pass's dynamic gate ``kappa``: the gate control the
    algorithm's parameters name (``params.gate_control_settings()``: a name in :data:`GATE_CONTROLS` and
    its keywords), whose state travels in checkpoints. ``CompPO.start`` builds it (``algorithm/comppo.py``). ``device``:
    the rank's device, where a control's collectives over ``dp_group`` run (default: the gates' device)."""

    def __init__(self, params, *, seed: int, dp_rank: int, dp_group=None, device=None):
        name, kwargs = params.gate_control_settings()
        self.control = GATE_CONTROLS.get(name)(**kwargs, seed=seed, dp_rank=dp_rank, dp_group=dp_group,
                                               device=device)

    def gates(self, kappa: torch.Tensor, mask: torch.Tensor, *, iteration: int) -> torch.Tensor:
        """``[B, T]`` transport gates for ``kappa, mask: [B, T]``."""
        return self.control.gates(kappa, mask, iteration=iteration)

    def state_dict(self) -> dict:
        return self.control.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.control.load_state_dict(state)
