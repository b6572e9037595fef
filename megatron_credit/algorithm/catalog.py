"""Algorithms by name: the one place where a recipe's ``algorithm.name`` means something (docs/architecture.md, convention 3).

``ALGORITHMS`` maps a name to an algorithm's ``Config`` class (``algorithm/base.py``). The trainer resolves
it once at start-up, ``ALGORITHMS.get(name).from_mapping(recipe params).build()``, and then calls the
:class:`~megatron_credit.algorithm.base.Algorithm` it built. A plugin adds its own with
``ALGORITHMS.add(name, MyAlgorithm.Config)`` (``--plugin``, ``plugins.py``).

>>> ALGORITHMS.get("fipo").from_mapping({"tau": 16}).build().config.tau
16.0
>>> ALGORITHMS.get("trpo")
Traceback (most recent call last):
...
ValueError: unknown algorithm 'trpo'; valid names: ['comppo', 'comppo_fipo', 'dapo', 'dr_grpo', 'fipo', 'grpo', 'gspo', 'ppo', 'rloo']
"""
from __future__ import annotations

from megatron_credit.algorithm.base import Algorithm
from megatron_credit.algorithm.comppo import CompFIPO, CompPO
from megatron_credit.algorithm.fipo import FIPO
from megatron_credit.algorithm.grpo import DAPO, GRPO, GSPO, RLOO, DrGRPO
from megatron_credit.algorithm.ppo import PPO
from megatron_credit.registry import Registry

ALGORITHMS: Registry[type[Algorithm.Config]] = Registry("algorithm")
for _name, _cls in {"grpo": GRPO, "dapo": DAPO, "dr_grpo": DrGRPO, "rloo": RLOO, "gspo": GSPO, "ppo": PPO,
                    "fipo": FIPO, "comppo": CompPO, "comppo_fipo": CompFIPO}.items():
    ALGORITHMS.add(_name, _cls.Config)
