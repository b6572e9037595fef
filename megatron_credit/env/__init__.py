"""Environments: what a multi-turn rollout talks to between model turns (tools, games).

| module | what lives there |
| --- | --- |
| ``base.py`` | the contract: ``Environment``, ``StepResult``, the ``ENVIRONMENTS`` registry, ``build_environment`` |
| ``calculator.py`` | ``calculator``: arithmetic tool calls, ``<call>1+2</call>`` answered ``<result>3</result>`` |
| ``feedback.py`` | ``feedback``: a wrong answer gets the verifier's verdict and another try (any data source) |
| ``openenv_adapter.py`` | ``openenv``: an environment written for OpenEnv (``openenv-core``), one instance per episode |
| ``calc_eval.py`` | the calculator's evaluator (``ast``-walked arithmetic with bounds on size) |
| ``sandbox.py``, ``sandbox_worker.py`` | killable workers that run tool code without network or processes |

The package imports the standard library only (no torch, no OpenEnv: the adapter imports it when built): the
sandbox's workers import it and start in a fraction of a second.
"""
from megatron_credit.env.base import ENVIRONMENTS, Environment, StepResult, build_environment
from megatron_credit.env import calculator, feedback, openenv_adapter  # noqa: F401  (registers the built-in environments)

__all__ = ["ENVIRONMENTS", "Environment", "StepResult", "build_environment"]
