"""Rollouts that overlap training (``rollout.mode: one_step_off | async``): sources whose samples come from
a child process on devices of its own (``trainer/sources/child_process.py``); this file is the trainer's
side (:class:`OverlapSource`) and registers the two modes (:class:`OneStepOff`, :class:`Async`).

Versions. A policy's version is the number of RL iterations its weights completed; iteration ``k``
trains the weights of version ``k - 1``. Each sample carries the version that generated it, and its
staleness is ``(k - 1) - version``: 0 in ``sync``, exactly 1 in ``one_step_off`` (iteration k + 1's samples
are generated with k - 1's weights while k trains), at most ``rollout.max_staleness`` in ``async``. The
rollout process never starts a batch without weights within the bound, and :meth:`OverlapSource.next`
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
every rank streams their HF-named buckets (the gathers are collectives) and rank 0 puts each into the
rollout process's queue as one shared-memory buffer (not waiting for any generation to end). Validation sends the weights of the
iteration it validates, and the rollout process samples the held-out prompts with them.

Resume. The prompt stream's cursor saved with a checkpoint is the one after the last batch trained;
batches generated but not trained (at most ``bound + 1``) are dropped with the process and generated
again after a resume, from the same prompts and seeds, with the checkpoint's weights.

Faults. A rollout process that dies, or a batch that takes more than ``rollout.wait_timeout_s``, stops the
run with one line (:class:`~megatron_credit.cli.RunStopped`); the rollout process exits when trainer rank
0 does.
"""
from __future__ import annotations

import atexit
import pickle
import queue
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_credit.batch.train_batch import TrainBatch
from megatron_credit.cli import RunStopped
from megatron_credit.rollout.placement import dp_rank_of_group
from megatron_credit.trainer.sources.base import ROLLOUT_SOURCES, SourceInputs, Weights, check_full, counted
from megatron_credit.trainer.sources.child_process import POLL_S, ChildSpec, child_main, flatten
from megatron_credit.trainer.sources.routing import SampleRouter


class OverlapSource(SampleRouter):
    """The trainer's side of the rollout process (module docstring); every rank makes one. A mode is a
    subclass that sets :attr:`interruptible` and its staleness bound."""

    interruptible = False
    """New weights are taken between draws (``async``), or between batches only (``one_step_off``)."""

    # -- the mode's facts ---------------------------------------------------------------------------
    @classmethod
    def staleness_bound(cls, rollout) -> int:
        return rollout.max_staleness

    @classmethod
    def check_section(cls, rollout) -> None:
        return None

    @classmethod
    def recipe_problems(cls, rollout, *, world_size: int) -> list[str]:
        out = []
        if rollout.gpus and len(rollout.gpus) != rollout.tensor_parallel_size:
            out.append(f"rollout.gpus={list(rollout.gpus)} must name rollout.engine_options.tensor_parallel_size="
                       f"{rollout.tensor_parallel_size} device(s): the rollout process runs one engine on them")
        if rollout.on_update == "partial" and rollout.engine != "hf":
            out.append(f"rollout.on_update=partial: the {rollout.engine} engine cannot take new weights in the middle "
                       "of a draw; use rollout.on_update=finish")
        return out

    @classmethod
    def build(cls, inputs: SourceInputs) -> OverlapSource:
        recipe, r, t = inputs.recipe, inputs.recipe.rollout, inputs.recipe.train
        if set(r.gpus) & set(range(inputs.node_ranks)):
            raise ValueError(f"rollout.gpus={list(r.gpus)} overlaps the trainer's devices 0..{inputs.node_ranks - 1} of "
                             "rank 0's node: the rollout process needs GPUs of its own")
        return cls(rollout=r, reward=recipe.reward, model=recipe.model, data=recipe.data, hf_config=inputs.hf_config,
                   seed=recipe.seed, max_draws=recipe.algorithm.max_draws,
                   dynamic_sampling=recipe.algorithm.dynamic_sampling, val_every=t.val_every,
                   val_prompts=t.val_prompts, val_samples=t.val_samples, tokenizer=inputs.tokenizer,
                   prompts=inputs.prompts, has_val=inputs.val_prompts is not None, device=inputs.device,
                   dp_group=inputs.dp_group, dp_of_rank=inputs.dp_of_rank, log=inputs.log)

    # -- a run's source -----------------------------------------------------------------------------
    def __init__(self, *, rollout, reward, model, data, hf_config, seed: int, max_draws: int,
                 dynamic_sampling: bool, val_every: int, val_prompts: int, val_samples: int, tokenizer, prompts,
                 has_val: bool, device, dp_group, dp_of_rank: list[int], log=print):
        self.rollout, self.reward, self.model, self.data, self.hf_config = rollout, reward, model, data, hf_config
        self.seed, self.max_draws, self.dynamic_sampling = seed, max_draws, dynamic_sampling
        self.val_every, self.val_prompts, self.val_samples, self.has_val = val_every, val_prompts, val_samples, has_val
        self.tokenizer, self.prompts, self.log = tokenizer, prompts, log
        self.device, self.dp_group = device, dp_group
        self.rank = dist.get_rank()
        self.dp_of_rank = list(dp_of_rank)
        self.dp_rank, self.dp_size = self.dp_of_rank[self.rank], max(self.dp_of_rank) + 1
        self.bound = self.staleness_bound(rollout)
        self.proc = self.inbox = self.outbox = None
        self.pushed: int | None = None
        self.ready: dict[tuple[str, int], Any] = {}
        self.last_sync: dict[str, float] = {}
        if device.type == "cuda" and not rollout.gpus:
            raise ValueError(f"rollout.mode={rollout.mode}: the rollout process needs GPUs of its own "
                             "(rollout.gpus: local device indices outside the trainer's ranks)")

    # -- the rollout process ------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        import os

        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        spec = ChildSpec(rollout=self.rollout, reward=self.reward, model=self.model, data=self.data,
                          hf_config=self.hf_config, seed=self.seed, start_step=step, cursor=self.prompts.state_dict(),
                          max_draws=self.max_draws, dynamic_sampling=self.dynamic_sampling,
                          val_every=self.val_every, val_prompts=self.val_prompts, val_samples=self.val_samples,
                          bound=self.bound, interruptible=self.interruptible,
                          num_threads=torch.get_num_threads(), parent_pid=os.getpid())
        # not a daemon: the rollout process may start processes of its own (the reward pool, vLLM's workers);
        # so it is stopped at exit even where the loop's own close() did not run
        self.proc = ctx.Process(target=child_main, args=(spec, self.inbox, self.outbox), name="rollout", daemon=False)
        self.proc.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the rollout process (asked, then terminated after 30 s); a no-op once stopped."""
        if self.proc is None:
            return
        try:
            self.inbox.put(("stop",))
            self.proc.join(timeout=30)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=10)
            self.proc = None

    def push(self, weights: Weights) -> None:
        """``weights`` to the rollout process, once per version (every rank takes part in the gathers;
        rank 0 sends). Sets ``sync/bytes`` and ``sync/seconds``."""
        version = weights.version
        if self.pushed == version:
            return
        t0, sizes = time.perf_counter(), []
        for bucket in counted(weights.buckets(), sizes):
            if self.rank == 0:
                self.inbox.put(("bucket", version, *flatten(bucket)))
        if self.rank == 0:
            self.inbox.put(("version", version))
        self.pushed = version
        self.last_sync = {"sync/bytes": float(sum(sizes)), "sync/seconds": time.perf_counter() - t0}

    def _wait(self, kind: str, step: int):
        """Rank 0: the rollout process's ``kind`` message of ``step`` (others that come first are kept)."""
        t0 = time.perf_counter()
        while (kind, step) not in self.ready:
            try:
                msg = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RunStopped(f"the rollout process exited (code {self.proc.exitcode}) while iteration {step} "
                                     "waited for it") from None
                if time.perf_counter() - t0 > self.rollout.wait_timeout_s:
                    raise RunStopped(f"iteration {step} waited more than rollout.wait_timeout_s="
                                     f"{self.rollout.wait_timeout_s:g} s for the rollout process") from None
                continue
            if msg[0] == "error":
                raise RunStopped(f"the rollout process failed: {msg[1]}")
            self.ready[(msg[0], msg[1])] = msg[2]
        return self.ready.pop((kind, step))

    # -- RolloutSource ------------------------------------------------------------------------------
    def next(self, iteration: int, *, weights: Weights) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's rows of iteration ``iteration``, generated by versions within the staleness bound;
        ``weights`` (those of ``iteration - 1``) go to the rollout process first."""
        if self.rank == 0 and self.proc is None:
            self._start(iteration)
        self.push(weights)
        t0 = time.perf_counter()
        box: list[Any] = [None]
        if self.rank == 0:
            payload = pickle.loads(self._wait("batch", iteration))  # noqa: S301  (this job's own process)
            box = [{k: v for k, v in payload.items() if k != "groups"}]
        wait = time.perf_counter() - t0
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0, device=self.device)
        info = box[0]
        count = self.rollout.prompts_per_step
        check_full(info["kept"], count=count, max_draws=self.max_draws)
        versions = info["versions"]
        too_old = [v for v in versions if (iteration - 1) - v > self.bound]
        if too_old:  # the rollout process never makes these; refused rather than trained on
            raise RunStopped(f"iteration {iteration} got samples of version {min(too_old)}, older than "
                             f"rollout.max_staleness={self.bound}")
        held = {(0, k): g for k, g in enumerate(payload["groups"])} if self.rank == 0 else {}
        rows = self._route([(0, k) for k in range(count)], held)
        mine = [v for k, v in enumerate(versions) if dp_rank_of_group(k, groups=count, dp_size=self.dp_size) == self.dp_rank]
        self.prompts.load_state_dict(info["cursor"])  # what a checkpoint of this iteration resumes from
        batch, metrics = self._assemble(rows, mine, iteration, draws=info["draws"], kept=info["kept"],
                                        wall=info["gen_s"], engines=1, partial=info["partial"],
                                        pool_sums=info["pool"] if self.rank == 0 else {})
        gen = max(info["gen_s"], 1e-9)
        metrics["time/rollout_wait_s"] = wait
        metrics["time/rollout_hidden_frac"] = min(max(1.0 - wait / gen, 0.0), 1.0)
        return batch, metrics

    def validate(self, iteration: int, *, weights: Weights) -> dict[str, float]:
        """Avg@k, Cons@k, Pass@k of ``weights`` (those of ``iteration``), sampled by the rollout process
        with the seeds ``sync`` uses."""
        if not self.has_val:
            return {}
        self.push(weights)
        sums = None
        if self.rank == 0:
            self.inbox.put(("validate", iteration))
            sums = self._wait("val", iteration)
        return self._val_metrics(sums, self.val_samples)


@ROLLOUT_SOURCES.register("one_step_off")
class OneStepOff(OverlapSource):
    """Iteration k + 1's batch is generated with the weights of k - 1 while k trains: staleness exactly 1
    (the first iteration's 0); new weights are loaded before each batch."""

    @classmethod
    def staleness_bound(cls, rollout) -> int:
        return 1

    @classmethod
    def check_section(cls, rollout) -> None:
        if rollout.max_staleness != 1:
            raise ValueError(f"rollout.max_staleness={rollout.max_staleness}: one_step_off trains on samples exactly one "
                             "version old; use rollout.mode=async for another bound")


@ROLLOUT_SOURCES.register("async")
class Async(OverlapSource):
    """Generation runs continuously, up to ``rollout.max_staleness`` versions ahead; new weights are loaded
    between draws too (``rollout.on_update``)."""

    interruptible = True
