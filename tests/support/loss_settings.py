"""The public policy losses with the settings of the algorithm that uses each (``DAPO.Config``,
``FIPO.Config``, ``GSPO.Config``) bound as keywords, so a test of the loss math may leave out what it
does not vary. The functions themselves take every clip setting without a default: the configs hold them.
"""
import dataclasses
import functools

from megatron_credit.algorithm.fipo import FIPO
from megatron_credit.algorithm.grpo import DAPO, GSPO
from megatron_credit.losses import policy

_fipo = {k: v for k, v in dataclasses.asdict(FIPO.Config()).items() if k != "drop_multi_dual_clip"}

ppo_clip_loss = functools.partial(policy.ppo_clip_loss, **dataclasses.asdict(DAPO.Config()))
fipo_policy_loss = functools.partial(policy.fipo_policy_loss, **_fipo)
gspo_loss = functools.partial(policy.gspo_loss, **dataclasses.asdict(GSPO.Config()))
