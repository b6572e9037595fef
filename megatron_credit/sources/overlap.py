"""Rollouts that overlap training (``rollout.mode: one_step_off | async``): sources whose samples come from
a rollout pool, the last ``rollout.ranks`` ranks of the launch (``sources/pool.py``), over the
channels of ``sources/bridge.py``; this file is the trainer's side (:class:`OverlapSource`) and
registers the two modes (:class:`OneStepOff`, :class:`Async`).

Versions. A policy's version is the number of RL iterations its weights completed; iteration ``k``
trains the weights of version ``k - 1``. Each sample carries the version that generated it, and its
staleness is ``(k - 1) - version``: 0 in ``sync``, exactly 1 in ``one_step_off`` (iteration k + 1's samples
are generated with k - 1's weights while k trains), at most ``rollout.max_staleness`` in ``async``. The
pool never starts a batch without weights within the bound, and :meth:`OverlapSource.next`
refuses a sample past it (``rollout/staleness_mean``, ``rollout/staleness_max`` and
``rollout/staleness_hist/<s>`` are logged every iteration).

The correction. The trainer recomputes the log-probs of every sample with the weights it is about to
update (the proximal policy, ``old_logp``), and the update is the decoupled objective: the algorithm's
loss with ratios against the proximal policy, times the importance weight of the proximal over the
behaviour policy (the engine's log-probs, ``rollout_logp``), truncated at ``algorithm.tis_cap``
(:data:`~megatron_credit.recipe.sections.OFF_POLICY_TIS_CAP` when unset and the bound is above 0). So
FIPO's Future-KL compares the policy being updated with the proximal one, as on-policy: its first
mini-batch's weights are exactly 1 whatever the staleness, and staleness acts through the importance
weights only. An algorithm's capture reads the behaviour pass, which runs the trainer's current weights.

Weights. Before iteration ``k`` takes its batch, the driver hands over the weights of version ``k - 1``:
every rank streams their HF-named buckets (the gathers are collectives), which every trainer rank then
holds whole, and trainer rank ``e % T`` sends them to engine ``e`` over their weights group (nccl on GPU,
device to device; gloo on CPU), not waiting for any generation to end: the engine's receiving thread stages
them. Validation sends the weights of the iteration it validates, and the pool samples the held-out prompts
with them.

Samples. Each engine sends its kept groups once, as bytes of tensors, to the first rank of the replica
that trains them, which broadcasts them within its replica; the batch's facts (versions, draws, the prompt
cursor) come through the store.

Resume. The prompt stream's cursor saved with a checkpoint is the one after the last batch trained;
batches generated but not trained (at most ``bound + 1``) are dropped with the pool and generated again
after a resume, from the same prompts and seeds, with the checkpoint's weights.

Faults. The trainer's waits end on silence, not on total time: the run stops with one line
(:class:`~megatron_credit.cli.RunStopped`) naming the pool rank when one reports an error, exits, or records
no life for ``Bridge.life_s`` (30 s, or ``rollout.wait_timeout_s`` when shorter: a rank stopped with SIGSTOP
in the middle of a draw, a weight send or a sample exchange), or when no engine made progress (a draw, a
few decode steps) for ``rollout.wait_timeout_s``. Under torchrun a killed rank ends the launch (torchrun's agent stops the others
and names it). The pool exits when the trainer says stop or is gone.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_credit.batch.train_batch import TrainBatch
from megatron_credit.cli import RunStopped
from megatron_credit.recipe import rollout_modes as modes
from megatron_credit.rollout.placement import dp_rank_of_group
from megatron_credit.sources.base import ROLLOUT_SOURCES, SourceInputs, Weights, check_full, counted
from megatron_credit.sources.routing import RolloutSourceBase


class OverlapSource(RolloutSourceBase):
    """The trainer's side of the rollout pool (module docstring); every trainer rank makes one. A mode is a
    subclass that also inherits the mode's facts (``recipe/rollout_modes.py``)."""

    @classmethod
    def build(cls, inputs: SourceInputs) -> OverlapSource:
        from megatron_credit import distributed
        from megatron_credit.sources.bridge import Bridge

        recipe, r, t = inputs.recipe, inputs.recipe.rollout, inputs.recipe.train
        job = distributed.job()
        if job is None or job.pool_ranks != r.ranks:
            raise ValueError(f"rollout.mode={r.mode}: this process was started without its rollout pool "
                             f"(rollout.ranks={r.ranks}); start runs with pretrain_rl.py or torchrun")
        bridge = Bridge(job, rollout_tp=r.tensor_parallel_size, device=inputs.device,
                        timeout_s=recipe.distributed.timeout_s, wait_timeout_s=r.wait_timeout_s)
        return cls(bridge=bridge, rollout=r, reward=recipe.reward, max_draws=recipe.algorithm.max_draws,
                   val_samples=t.val_samples, tokenizer=inputs.tokenizer, prompts=inputs.prompts,
                   has_val=inputs.val_prompts is not None, device=inputs.device, dp_group=inputs.dp_group,
                   dp_of_rank=inputs.dp_of_rank, log=inputs.log)

    # -- a run's source -----------------------------------------------------------------------------
    def __init__(self, *, bridge, rollout, reward, max_draws: int, val_samples: int, tokenizer, prompts,
                 has_val: bool, device, dp_group, dp_of_rank: list[int], log=print):
        self.bridge, self.rollout, self.reward, self.max_draws = bridge, rollout, reward, max_draws
        self.val_samples, self.has_val = val_samples, has_val
        self.tokenizer, self.prompts, self.log = tokenizer, prompts, log
        self.device, self.dp_group = device, dp_group
        self.rank = dist.get_rank()
        self.dp_of_rank = list(dp_of_rank)
        self.dp_rank, self.dp_size = self.dp_of_rank[self.rank], max(self.dp_of_rank) + 1
        self.bound = rollout.staleness_bound
        self.started = False
        self.pushed: int | None = None
        self.last_sync: dict[str, float] = {}
        if self.rank == 0:
            bridge.start_alive()
        atexit.register(self.close)

    def _start(self, step: int) -> None:
        """Tell the pool where the run starts (rank 0, once): the first batch's iteration, the prompt cursor
        after the last batch trained, and where the samples go (each replica's first rank)."""
        if not self.started and self.rank == 0:
            self.bridge.put("start", {"step": step, "cursor": self.prompts.state_dict(),
                                      "heads": self._replica_heads(), "dp_size": self.dp_size})
        self.started = True

    def close(self) -> None:
        """Tell the pool to stop; rank 0 waits for the pool ranks it started (30 s, then terminates them)."""
        from megatron_credit.sources.pool import SPAWNED

        if self.bridge is None:
            return
        try:
            if self.rank == 0:
                self.bridge.stop()
            else:  # close this rank's groups only once the pool was told: a send cut before is its error
                t0 = time.monotonic()
                while not self.bridge.stopping() and not self.bridge.gone(0) and time.monotonic() - t0 < 10:
                    time.sleep(0.05)
            for proc in SPAWNED if self.rank == 0 else ():
                with contextlib.suppress(ProcessLookupError):  # a rank stopped by a signal sees the stop once continued
                    os.kill(proc.pid, signal.SIGCONT)
                try:
                    proc.wait(timeout=30)
                except Exception:  # noqa: BLE001  (subprocess.TimeoutExpired)
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except Exception:  # noqa: BLE001  a rank that cannot act on SIGTERM (stopped, hung in C)
                        proc.kill()
                        proc.wait()
        finally:
            self.bridge.close()
            self.bridge = None

    def push(self, weights: Weights) -> None:
        """``weights`` to the engines, once per version (every rank takes part in the gathers; trainer rank
        ``e % T`` sends engine ``e``'s). Sets ``sync/bytes`` (one version), ``transfer/weight_bytes`` (what the
        engines received) and ``time/weight_sync_s``."""
        version = weights.version
        if self.pushed == version:
            return
        t0, sizes = time.perf_counter(), []
        self.bridge.send_weights(version, counted(weights.buckets(), sizes))
        self.pushed = version
        seconds = time.perf_counter() - t0
        self.last_sync = {"sync/bytes": float(sum(sizes)), "sync/seconds": seconds,
                          "transfer/weight_bytes": float(sum(sizes) * self.bridge.ranks.engines),
                          "time/weight_sync_s": seconds}

    def _wait(self, key: str, what: str):
        from megatron_credit.sources.pool import SPAWNED

        return self.bridge.wait_for(key, what=what, silence_s=self.rollout.wait_timeout_s,
                                    spawned=SPAWNED if self.rank == 0 else None)

    def _receive(self, iteration: int) -> list[Any]:
        """This rank's groups of ``iteration``: a replica head receives them from the engines, and broadcasts
        them within its replica."""
        from megatron_credit.rollout.wire import payload_bytes

        head = self._replica_heads()[self.dp_rank] == self.rank
        got, nbytes, payload = [], 0, 0
        if head:
            got, nbytes = self.bridge.receive_groups(iteration)
            payload = payload_bytes(got)
        got, broadcast = self._replica_broadcast(got, head=head)
        self._sent = (nbytes, payload, broadcast)
        assert len(got) == self.rollout.prompts_per_step // self.dp_size, "each replica gets prompts_per_step / DP groups"
        return [g for _, g in got]

    # -- RolloutSource ------------------------------------------------------------------------------
    def next(self, iteration: int, *, weights: Weights) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's rows of iteration ``iteration``, generated by versions within the staleness bound;
        ``weights`` (those of ``iteration - 1``) go to the engines first."""
        self._start(iteration)
        self.push(weights)
        t0 = time.perf_counter()
        info = self._wait(f"batch/{iteration}", f"iteration {iteration} waited for its batch")
        wait = time.perf_counter() - t0
        count = self.rollout.prompts_per_step
        check_full(info["kept"], count=count, max_draws=self.max_draws, env_failed=tuple(info["env_failed"]))
        versions = info["versions"]
        too_old = [v for v in versions if (iteration - 1) - v > self.bound]
        if too_old:  # the pool never makes these; refused rather than trained on
            raise RunStopped(f"iteration {iteration} got samples of version {min(too_old)}, older than "
                             f"rollout.max_staleness={self.bound}")
        rows = self._receive(iteration)
        mine = [v for k, v in enumerate(versions) if dp_rank_of_group(k, groups=count, dp_size=self.dp_size) == self.dp_rank]
        self.prompts.load_state_dict(info["cursor"])  # what a checkpoint of this iteration resumes from
        batch, metrics = self._assemble(rows, mine, iteration, draws=info["draws"], kept=info["kept"],
                                        wall=info["gen_s"], engines=self.bridge.ranks.engines,
                                        partial=info["partial"],
                                        verifier_sums=info["verifier"] if self.rank == 0 else {})
        gen = max(info["gen_s"], 1e-9)
        metrics["time/rollout_wait_s"] = wait
        metrics["time/rollout_hidden_frac"] = min(max(1.0 - wait / gen, 0.0), 1.0)
        return batch, metrics

    def validate(self, iteration: int, *, weights: Weights) -> dict[str, float]:
        """Avg@k, Cons@k, Pass@k of ``weights`` (those of ``iteration``), sampled by the pool with the seeds
        ``sync`` uses."""
        if not self.has_val:
            return {}
        self._start(iteration + 1)
        self.push(weights)
        if self.rank == 0:  # the request, then its number: the pool reads the count
            self.bridge.put(f"val/{self.bridge.count('val/n')}", iteration)
            self.bridge.count("val/n", 1)
        sums = self._wait(f"val/result/{iteration}", f"validation of iteration {iteration} waited for the pool")
        return self._val_metrics(sums if self.rank == 0 else None, self.val_samples)


@ROLLOUT_SOURCES.register("one_step_off")
class OneStepOff(OverlapSource, modes.OneStepOff):
    """``one_step_off`` (:class:`~megatron_credit.recipe.rollout_modes.OneStepOff`): new weights are loaded
    before each batch."""


@ROLLOUT_SOURCES.register("async")
class Async(OverlapSource, modes.Async):
    """``async`` (:class:`~megatron_credit.recipe.rollout_modes.Async`): new weights are loaded between draws
    too (``rollout.on_update``)."""
