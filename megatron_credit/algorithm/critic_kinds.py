"""Critic kinds by name (``algorithm.params.critic``): one vocabulary for every algorithm with a critic.
Each algorithm accepts some of them (PPO: ``trunk``, ``separate``; CompPO: ``tac``, ``standard``, ``trunk``).

- ``trunk``: a value head on the actor's final hidden state, trained with the policy (one model, one
  optimizer, one clip);
- ``separate``: a value model of its own (``trainer/critic_model.py``), as verl / OpenRLHF build it;
- ``tac``: CompPO's transport-aligned critic on the actor's detached features (the last layers' hidden
  states and the final layer's top-K attention), its own parameters and clip;
- ``standard``: a linear head on the detached final hidden state.

>>> sorted(CRITIC_KINDS), CRITIC_KINDS.get("separate").separate_model
(['separate', 'standard', 'tac', 'trunk'], True)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_credit.registry import Registry


@dataclass(frozen=True, kw_only=True)
class CriticKind:
    """What a critic kind asks of the trainer."""

    separate_model: bool = False
    """A value model of its own (not a head on the actor)."""
    actor_options: Optional[Callable[..., dict]] = None
    """``fn(params, hf_config, *, dtype, pp_size) -> Actor keywords`` of a critic on the actor's detached
    features (``critic_factory``, ``critic_layers``, ``capture_top_k``); None: the Actor's default head."""
    diagnostics: Optional[Callable[..., dict]] = None
    """``fn(values, returns, mask, params) -> {"sum:...": tensor}``: this kind's diagnostics of the
    iteration's values against its returns (``values, returns, mask: [B, T]``), added to the step's
    statistics after the advantages; None: none."""


def _tac(params: Any, hf_config, *, dtype, pp_size: int) -> dict:
    """The TAC fuses at most the layers of the last pipeline stage (the critic lives there)."""
    from megatron_credit.models.critic import TransportAlignedCritic

    layers = min(params.critic_layers, hf_config.num_hidden_layers // pp_size)
    factory = functools.partial(TransportAlignedCritic, hf_config.hidden_size, num_layers=layers,
                                value_clamp=params.value_clamp, dtype=dtype)
    return {"critic_factory": factory, "critic_layers": layers, "capture_top_k": params.critic_top_k}


def _standard(params: Any, hf_config, *, dtype, pp_size: int) -> dict:
    from megatron_credit.models.critic import StandardCritic

    factory = functools.partial(StandardCritic, hf_config.hidden_size, value_clamp=params.value_clamp)
    return {"critic_factory": factory, "critic_layers": 1, "capture_top_k": 0}


def _feature_diagnostics(values, returns, mask, params: Any) -> dict:
    """A feature critic's rank-local ``critic/{spearman,value_mae,clamp_frac}`` (averaged over ranks);
    its explained variance comes from global sums in the update (``critic/explained_var``)."""
    import torch

    from megatron_credit.models.critic import critic_diagnostics

    d = critic_diagnostics(values, returns, mask, value_clamp=params.value_clamp)
    out = {f"sum:rank_avg/critic/{k}": v for k, v in d.items() if k != "explained_var"}
    out["sum:rank_avg_count"] = torch.tensor(1.0)
    return out


CRITIC_KINDS: Registry[CriticKind] = Registry("critic kind")
CRITIC_KINDS.add("trunk", CriticKind())
CRITIC_KINDS.add("separate", CriticKind(separate_model=True))
CRITIC_KINDS.add("tac", CriticKind(actor_options=_tac, diagnostics=_feature_diagnostics))
CRITIC_KINDS.add("standard", CriticKind(actor_options=_standard, diagnostics=_feature_diagnostics))


def check_critic(name: str, accepted: tuple[str, ...]) -> None:
    """Refuse ``algorithm.params.critic=name`` unless it is a kind this algorithm accepts."""
    if name not in accepted or name not in CRITIC_KINDS:
        raise ValueError(f"algorithm.params.critic={name!r}: valid values {list(accepted)}")
