"""The old home of :mod:`megatron_credit.rewards.verifier_workers`, kept for one release.

Every name this module had is looked up there, with a one-line ``DeprecationWarning`` naming the new one.
"""
from __future__ import annotations

_RENAMED = {"RewardPool": "VerifierWorkers", "RewardPoolConfig": "VerifierWorkersConfig"}
"""Old name -> new name in ``megatron_credit.rewards.verifier_workers``."""
_MOVED = ("RewardItem", "IMPORT_GRACE_S")
"""Public names that kept their name and only moved."""


def __getattr__(name: str):
    """``RewardPool``, ``RewardPoolConfig`` (now ``VerifierWorkers``, ``VerifierWorkersConfig``) and the other
    public names of this module, from ``megatron_credit.rewards.verifier_workers``, with a warning."""
    if name in _RENAMED or name in _MOVED:
        import warnings

        from megatron_credit.rewards import verifier_workers

        new = _RENAMED.get(name, name)
        warnings.warn(f"megatron_credit.rewards.pool.{name} is now megatron_credit.rewards.verifier_workers.{new}; "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(verifier_workers, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
