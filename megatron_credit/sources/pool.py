"""A rollout pool rank (``rollout.ranks: N``; ``rollout.mode: one_step_off | async``): what the last ``N``
ranks of a launch run instead of the trainer (``pretrain_rl.py`` sends them here).

Engine ``e``'s leader (``bridge.PoolRanks``) builds the recipe's engine on its devices, the prompt stream,
the validation prompts and the verifier workers; the engine's other ranks only wait for the end. The leader's
receiving thread takes each version the trainer sends over the engine's weights group and stages it in the
bridge's ring of host chunks (``sources/staging.py``: at most one staged version, which a newer one
replaces), so the trainer never waits for a generation to end to hand over its weights (at most for one
load, when a version arrives while one is loading and another is staged). The generating loop then fills the
batch of iteration ``j`` with the draws ``sync`` makes (the same draw loop and per-engine share,
``sources.base.draw_until_full`` and ``draw_share``;
seeds from (run seed, ``j``, draw); every engine takes the draw's ``rollout.prompts_per_step`` prompts and
samples its contiguous slice, with each prompt's index in the draw, so the samples do not depend on the
number of engines), once it holds weights of version ``>= j - 1 - bound``: so no sample is ever older than
the bound, and with bound 0 the batches are ``sync``'s, bit for bit. It loads the newest weights before each
batch; ``async`` also between draws, where ``on_update: finish`` lets the draw in flight end under the
weights it started with, and ``partial`` loads them between two decode steps. Each group carries the oldest
version that generated it.

Each engine sends its kept groups straight to the trainer's replica heads (``Bridge.send_groups``); the
first engine puts the batch's facts (versions, draws, the prompt cursor, the verifier workers' counts) into
the store. Validation requests are served between batches (``one_step_off``) or between draws (``async``).

A pool rank exits when the trainer says stop, when its launch is gone (the store, trainer rank 0's life
beat, or, for ranks the entry point started, its parent), or on an error, which it puts into the store as one line first. It ignores the
run's exit signals (``checkpoint.exit_signals``: a scheduler sends them to every process of the job): the
trainer finishes its iteration, saves it, and then says stop.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from megatron_credit.sources.bridge import BEAT_S, POLL_S, Bridge


def serve(recipe, hf_config, *, job, device: torch.device, local_rank: int) -> int:
    """A pool rank's main: serve until the trainer stops; returns the exit code (1 after an error, which the
    trainer reports)."""
    r = recipe.rollout
    for name in recipe.checkpoint.exit_signals:  # the trainer saves and then says stop; a pool rank waits for it
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    bridge = Bridge(job, rollout_tp=r.tensor_parallel_size, device=device, timeout_s=recipe.distributed.timeout_s)
    bridge.start_alive()
    parent = int(os.environ.get(PARENT_ENV, "0"))
    try:
        if not bridge.is_leader:  # an engine's other ranks: their devices are the engine's
            while not bridge.stopping() and _parent_alive(parent) and not bridge.gone(0):
                time.sleep(POLL_S * 4)
            return 0
        PoolEngine(recipe, hf_config, bridge=bridge, device=device, local_rank=local_rank, parent=parent).run()
        return 0
    except BaseException as exc:  # noqa: BLE001  (reported to the trainer as one line, then the rank exits)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return failed(bridge, job.rank, exc)
    finally:
        bridge.close()


def failed(bridge, rank: int, exc: BaseException) -> int:
    """A pool rank's exit code after ``exc``. After the trainer said stop, an exchange cut short by its ranks'
    exit (an async pool sends the next batch while the trainer finishes: ``Connection closed by peer``) is the
    run's end: 0, nothing reported. Otherwise the error is one line in the launch's log and in the store for
    the trainer to name, and the rank waits for the trainer to read it: 1."""
    try:
        if bridge.stopping():
            return 0
    except Exception:  # noqa: BLE001  (the store is gone: the error is this rank's to report)
        pass
    line = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    # in the launch's log too: the trainer names it, unless the launcher ends the trainer first
    print(f"error: rollout pool rank {rank}: {line}", file=sys.stderr, flush=True)
    try:
        bridge.fail(line)
        t0 = time.monotonic()  # let the trainer read it before this rank's exit ends the launch
        while not bridge.stopping() and time.monotonic() - t0 < 30:
            time.sleep(POLL_S)
    except Exception:  # noqa: BLE001  (the store is gone too)
        pass
    return 1


SPAWNED: list = []
"""The pool ranks ``pretrain_rl.py`` started itself (no launcher), as ``subprocess.Popen``: trainer rank 0
watches them and waits for them at the end."""

STOP, VALIDATE, BATCH, WAIT = 1, 2, 3, 4
"""The first engine's decisions (``PoolEngine._decide``)."""
DECIDE_S = 5.0
"""The longest the other engines wait in one decision."""

PARENT_ENV = "MEGATRON_CREDIT_POOL_PARENT"
"""The pid of the trainer process that started this pool rank (``pretrain_rl.py`` without torchrun)."""


def _parent_alive(pid: int) -> bool:
    return not pid or os.getppid() == pid


class _Stopped(Exception):
    """The trainer said stop (or is gone) while the engine was generating."""


class PoolEngine:
    """Engine ``e``'s leader: the generating loop and the receiving thread (module docstring)."""

    def __init__(self, recipe, hf_config, *, bridge: Bridge, device: torch.device, local_rank: int, parent: int):
        from megatron_credit.rollout.placement import split

        r = recipe.rollout
        self.recipe, self.rollout, self.bridge, self.parent = recipe, r, bridge, parent
        self.e, self.engines = bridge.engine, bridge.ranks.engines
        self.split = lambda count: split(count, self.engines)[self.e]
        self.bound = r.staleness_bound
        self.interruptible = r.mode_facts().interruptible
        with self._beating():  # the data, the engine (minutes for a large vLLM one) and the reward workers
            self._build(recipe, hf_config, device=device, local_rank=local_rank)
        self.stop_ids = tuple(i for i in (getattr(self.tokenizer, "eos_token_id", None),) if i is not None)
        self.cond = threading.Condition()
        self.received = -1  # the newest complete version received (staged in the bridge's ring until loaded)
        self.loaded = -1  # the version the engine holds
        self.failure: str | None = None
        self.stopped = False
        self.swaps = 0  # weight loads in the middle of a draw (partial rollouts)
        self.beat_at = 0.0
        self.val_seen = 0  # validation requests served
        self.partial = r.on_update == "partial" and self.interruptible
        if self.partial and not hasattr(self.engine, "between_steps"):
            raise ValueError(f"rollout.on_update=partial: the {r.engine} engine cannot take new weights in the "
                             "middle of a draw; use finish")
        if hasattr(self.engine, "between_steps"):
            self.engine.between_steps = self._between_steps
        elif hasattr(self.engine, "on_progress"):  # an engine that reports its steps but takes no weights in a draw
            self.engine.on_progress = self._progress

    def _build(self, recipe, hf_config, *, device: torch.device, local_rank: int) -> None:
        """The prompts, the engine and the reward workers of this engine's leader."""
        from megatron_credit.rollout.engine import build_trainer_engine
        from megatron_credit.rollout.multi_turn import build_episode_engine
        from megatron_credit.sources.base import build_verifier_workers
        from megatron_credit.data.setup import build_data

        r, t = recipe.rollout, recipe.train
        self.tokenizer, self.prompts, self.val, _ = build_data(
            recipe.data, seed=recipe.seed, model_path=recipe.model.name_or_path, val_every=t.val_every,
            val_prompts=t.val_prompts)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.engine = build_episode_engine(
            build_trainer_engine(r, recipe.model, seed=recipe.seed, hf_config=hf_config, device=device,
                                 gpus=tuple(range(local_rank, local_rank + r.tensor_parallel_size))),
            recipe.env, self.tokenizer)
        self.verifier_workers = build_verifier_workers(recipe.reward)

    # -- progress, stop ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _beating(self):
        """Progress beats every ``BEAT_S`` from a thread while a call that cannot report its own progress runs
        (the engine's build, a weight load): the trainer's wait ends on silence, and these take long at 32B
        without being stuck (a build that hangs ends in vLLM's own start-up timeout)."""
        done = threading.Event()

        def beat():
            while not done.wait(BEAT_S):
                self.bridge.count(f"hb/{self.e}", 1)
        thread = threading.Thread(target=beat, name="pool-busy-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.beat_at >= BEAT_S:
            self.bridge.count(f"hb/{self.e}", 1)
            self.beat_at = now

    def _should_stop(self) -> bool:
        return (self.stopped or self.bridge.stopping() or not _parent_alive(self.parent)
                or self.bridge.gone(0))  # trainer rank 0 stopped living

    def _progress(self) -> None:
        """After a step of an engine's scheduler: a progress beat at most every ``BEAT_S``; stop if told."""
        if time.monotonic() - self.beat_at >= BEAT_S:
            self._beat(force=True)
            if self._should_stop():
                raise _Stopped()

    def _between_steps(self) -> bool:
        """Between two decode steps: a progress beat; stop if told; load newer weights if any came and the
        mode takes them mid-draw (True: the draw goes on under them)."""
        now = time.monotonic()
        if now - self.beat_at >= BEAT_S:
            self._beat(force=True)
            if self._should_stop():
                raise _Stopped()
        if not self.partial or self.received <= self.loaded:
            return False
        self._load_newest()
        self.swaps += 1
        return True

    # -- the receiving thread -----------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                version = self.bridge.receive_weights(self._should_stop)
                if version is None:
                    break
                with self.cond:
                    self.received = version
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001
            with self.cond:
                self.failure = f"receiving weights: {type(exc).__name__}: {' '.join(str(exc).split())}"
                self.cond.notify_all()
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _load_newest(self) -> None:
        """Load the staged version, if one is (the newest complete one: ``sources/staging.py``)."""
        with self.bridge.ring.take() as staged:
            if staged is not None:
                version, buckets = staged
                with self._beating():
                    self.engine.update_weights(buckets)
                self.loaded = version

    def _wait_version(self, version: int) -> bool:
        """Wait until a version ``>= version`` was received (False: stopping)."""
        with self.cond:
            while self.received < version:
                if self.failure:
                    raise RuntimeError(self.failure)
                if self.stopped:
                    return False
                self.cond.wait(timeout=POLL_S)
                self.stopped = self.stopped or self._should_stop()
        return True

    # -- the generating loop ------------------------------------------------------------------------
    def run(self) -> None:
        b = self.bridge
        threading.Thread(target=self._receive, name="pool-weights", daemon=True).start()
        start = None
        while start is None:
            if self._should_stop():
                return self._end()
            start = b.get("start")
            time.sleep(0 if start else POLL_S)
        self.heads, self.dp_size = start["heads"], start["dp_size"]
        self.prompts.load_state_dict(start["cursor"])
        step = first = start["step"]
        try:
            while True:
                # the oldest weights batch `step` may use: within the bound, and never older than the first
                # version the trainer sends (a resumed run has no older one)
                oldest = max(step - 1 - self.bound, first - 1)
                action, n = self._decide(oldest)
                if action == STOP:
                    break
                if action == VALIDATE:
                    self._serve_validation(n)
                elif action == BATCH:
                    if not self._wait_version(oldest):
                        break
                    self._batch(step)
                    step += 1
        except _Stopped:
            pass
        self._end()

    def _decide(self, oldest: int) -> tuple[int, int]:
        """What every engine does next, as the first engine decides it (one small sum over the engines, so
        their collectives meet): stop, serve the validation requests up to ``n``, make the next batch (the
        first engine holds weights of version ``oldest``), or look again (at most every few seconds)."""
        decision = torch.zeros(2, dtype=torch.int64)
        if self.e == 0:
            decision[:] = torch.tensor(self._look(oldest))
        self.bridge.pool_sum(decision)
        return int(decision[0]), int(decision[1])

    def _look(self, oldest: int) -> tuple[int, int]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < DECIDE_S:
            if self._should_stop():
                return STOP, 0
            n = self.bridge.count("val/n")
            if n > self.val_seen:
                return VALIDATE, n
            with self.cond:
                if self.failure:
                    raise RuntimeError(self.failure)
                if self.received >= oldest:
                    return BATCH, 0
                self.cond.wait(timeout=POLL_S)
        return WAIT, 0

    def _end(self) -> None:
        self.stopped = True
        if self.verifier_workers is not None:
            self.verifier_workers.close()

    # -- validation ---------------------------------------------------------------------------------
    def _serve_validation(self, n: int) -> None:
        """Serve the validation requests up to the ``n``-th, in order (every engine)."""
        while self.val_seen < n:
            self._validate(self.bridge.get(f"val/{self.val_seen}"))
            self.val_seen += 1

    def _validate(self, step: int) -> None:
        """Validation of the weights of ``step`` (the trainer sent them just before asking): each engine its
        slice of the prompts, with the seeds ``sync`` uses; the first engine puts the sums."""
        from megatron_credit.sources.evaluation import metric_sums, sample_and_grade
        from megatron_credit.rollout.placement import draw_seed

        if not self._wait_version(step):
            raise _Stopped()
        self._load_newest()
        k = self.recipe.train.val_samples
        names = (f"avg@{k}", f"cons@{k}", f"pass@{k}", "num_problems")
        vec = torch.zeros(len(names), dtype=torch.float64)
        if self.val is not None:
            prompts = list(self.val)
            mine = self.split(len(prompts))
            if len(mine):
                problems = sample_and_grade(self.engine, self.tokenizer, [prompts[i] for i in mine], k=k,
                                            verifier_workers=self.verifier_workers,
                                            sampling=self._params(k, draw_seed(self.recipe.seed, -1)),
                                            first_group=mine.start, scoring=self._beating)
                sums = metric_sums(problems, k=k)
                vec += torch.tensor([sums[name] for name in names], dtype=torch.float64)
        self.bridge.pool_sum(vec)
        self._beat(force=True)
        if self.e == 0:
            self.bridge.put(f"val/result/{step}", dict(zip(names, vec.tolist())))

    # -- a batch ------------------------------------------------------------------------------------
    def _params(self, n: int, seed: int):
        from megatron_credit.sources.base import sampling_params

        return sampling_params(self.rollout, self.stop_ids, n=n, seed=seed)

    def _batch(self, step: int) -> None:
        """Iteration ``step``'s kept groups, as ``sync`` draws them: this engine's go to the trainer's replica
        heads; the first engine puts the batch's facts."""
        from megatron_credit.rollout.placement import dp_rank_of_group, draw_seed
        from megatron_credit.sources.base import VERIFIER_COUNTS, draw_share, draw_until_full, env_failures

        r, recipe = self.rollout, self.recipe
        count, n = r.prompts_per_step, r.n
        self._load_newest()
        held: dict[tuple[int, int], Any] = {}
        # verifier counts, the environment's failed and all trajectories, partial draws, wall
        tally = torch.zeros(len(VERIFIER_COUNTS) + 4, dtype=torch.float64)
        versions: dict[tuple[int, int], int] = {}

        def draw(d: int) -> list:
            records = self.prompts.take(count)
            if self.interruptible:  # validation between draws, then the newest weights
                if d:
                    asked = torch.tensor([self.bridge.count("val/n") if self.e == 0 else 0], dtype=torch.int64)
                    self._serve_validation(int(self.bridge.pool_sum(asked)))
                self._load_newest()
            version, swaps, t0 = self.loaded, self.swaps, time.perf_counter()
            verdict = torch.zeros(2 * count, dtype=torch.int64)  # per prompt: counts + 1, version + 1 (0: not mine)
            groups, counts, verifier_counts = draw_share(
                self.engine, self.verifier_workers, self.tokenizer, records, self.split(count),
                self._params(n, draw_seed(recipe.seed, step, d)), rollout=r, reward=recipe.reward,
                dynamic_sampling=recipe.algorithm.dynamic_sampling, scoring=self._beating)
            for p, group in groups.items():
                held[(d, p)] = group
                verdict[p] = 1 + counts[p]
                verdict[count + p] = 1 + version
            for i, key in enumerate(VERIFIER_COUNTS):
                tally[i] += verifier_counts.get(key, 0.0)
            tally[-2] += self.swaps > swaps
            tally[-1] += time.perf_counter() - t0
            self.bridge.pool_sum(verdict)
            self._beat(force=True)
            for p in range(count):
                versions[(d, p)] = int(verdict[count + p]) - 1
            return [(d, p) for p in range(count) if int(verdict[p]) == 2]

        kept, draws = draw_until_full(draw, count=count, max_draws=recipe.algorithm.max_draws)
        by_head: dict[int, list] = {h: [] for h in self.heads}
        for k, key in enumerate(kept[:count]):
            if key in held:
                by_head[self.heads[dp_rank_of_group(k, groups=count, dp_size=self.dp_size)]].append((k, held[key]))
        self.bridge.send_groups(step, by_head)
        aborted, trajectories, why = env_failures(held.values())
        tally[-4] += aborted
        tally[-3] += trajectories
        self.bridge.pool_sum(tally)
        if self.e == 0:
            sums = dict(zip(VERIFIER_COUNTS, tally[:len(VERIFIER_COUNTS)].tolist()))
            self.bridge.put(f"batch/{step}", {
                "versions": [versions[key] for key in kept[:count]], "draws": draws, "kept": len(kept),
                "verifier": sums, "cursor": self.prompts.state_dict(), "gen_s": float(tally[-1]) / self.engines,
                "partial": min(int(tally[-2]), draws), "env_failed": [int(tally[-4]), int(tally[-3]), why]})
