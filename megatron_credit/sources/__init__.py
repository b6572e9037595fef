"""Rollout sources: where the trainer's batches come from, one file per ``rollout.mode``.

| module | what lives there |
| --- | --- |
| ``base.py`` | ``ROLLOUT_SOURCES`` (``rollout.mode`` -> source class), the ``RolloutSource`` contract, the ``Weights`` the driver hands over, the one draw loop (``draw_until_full``), ``generate_and_score`` |
| ``routing.py`` | ``RolloutSourceBase``: the kept groups to the ranks that train them, this rank's ``TrainBatch`` and metrics |
| ``sync.py`` | ``sync``: the engines on the trainer's GPUs; generate, then train |
| ``overlap.py`` | ``one_step_off`` and ``async``: the trainer's side of a rollout pool that generates while the trainer trains |
| ``pool.py`` | that pool: what its ranks (the last ``rollout.ranks`` of the launch) run, engines, staged weights, draws |
| ``bridge.py`` | the channels between the trainer's ranks and the pool's: the store, weights groups, samples |
| ``evaluation.py`` | Avg@k, Cons@k, Pass@k: the validation's sampling and grading, shared with ``tools/evaluate.py`` |
| ``staging.py`` | an engine leader's ring of host chunks (pinned on a GPU): the versions it receives, at most one staged |

A mode is a class registered under its name, serving a run (``next``, ``validate``, ``close``); it
inherits the mode's facts (staleness bound, the recipe's checks) from ``recipe/rollout_modes.py``, where
the recipe reads them without importing this package. Adding one is its facts there, one file here and its
import below. The driver passes the weights each call generates with; a source never reaches into the actor.
"""
from megatron_credit.sources import overlap, sync  # noqa: F401  (register the built-in modes)
from megatron_credit.sources.base import ROLLOUT_SOURCES, RolloutSource, SourceInputs, Weights

__all__ = ["ROLLOUT_SOURCES", "RolloutSource", "SourceInputs", "Weights"]
