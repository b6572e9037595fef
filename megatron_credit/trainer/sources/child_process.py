"""The rollout process of ``rollout.mode: one_step_off | async``: a child process of trainer rank 0 that
runs one engine on devices of its own (``rollout.gpus``; the CPU without), generating while the trainer
trains.

Trainer rank 0 starts it (:class:`~megatron_credit.trainer.sources.overlap.OverlapSource`) and talks to it
through two queues:

- in: ``("bucket", version, names, dtypes, shapes, flat)`` per weight bucket (one shared-memory buffer
  each), then ``("version", version)`` once the version is whole; ``("validate", step)``; ``("stop",)``;
- out: ``("batch", step, payload)``, ``("val", step, sums)``, ``("error", line)``.

A receiving thread stages each complete version as it arrives, so the trainer never waits for a
generation to end to hand over its weights. The generating loop fills the batch of iteration ``j`` with
the draws ``sync`` makes (the same draw loop, ``sources.base.draw_until_full``) (seeds from (run seed, ``j``, draw), the same prompts, the same dynamic
sampling), once it holds weights of version ``>= j - 1 - bound`` (the staleness bound): so no sample is
ever older than the bound, and with bound 0 the batches are ``sync``'s, bit for bit. It loads the newest
weights before each batch; ``async`` also between draws, where ``on_update: finish`` lets the draw in
flight end under the weights it started with, and ``partial`` loads them between two decode steps and
goes on with the responses in flight under them (their prefixes computed again). Each group carries the
oldest version that generated it.

The process exits when it is told to stop, when trainer rank 0 is gone (it polls its parent), or on an
error, which it reports as one line first.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import threading
import time
from typing import Any

import torch

POLL_S = 0.5
"""How often the waiting loops look at the queues and the parent process."""


@dataclasses.dataclass
class ChildSpec:
    """What the rollout process is built from (picklable: the recipe's sections, not the recipe)."""

    rollout: Any
    reward: Any
    model: Any
    data: Any
    hf_config: Any
    seed: int
    start_step: int
    """The first iteration to generate for (a resumed run's next one)."""
    cursor: dict
    """The prompt stream's state after the last batch the trainer consumed."""
    max_draws: int
    dynamic_sampling: bool
    val_every: int
    val_prompts: int
    val_samples: int
    bound: int
    """``rollout.staleness_bound``."""
    interruptible: bool
    """``async``: new weights are taken between draws (``one_step_off``: between batches only)."""
    num_threads: int
    parent_pid: int


def child_main(spec: ChildSpec, inbox, outbox) -> None:
    """The process's main: generate until stopped; any error goes to ``outbox`` as one line first."""
    try:
        _RolloutChild(spec, inbox, outbox).run()
    except BaseException as exc:  # noqa: BLE001  (reported to the trainer, then the process ends)
        outbox.put(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
        raise SystemExit(1) from exc


class _RolloutChild:
    def __init__(self, spec: ChildSpec, inbox, outbox):
        from megatron_credit.rollout.engine import build_trainer_engine
        from megatron_credit.trainer.data_setup import build_data
        from megatron_credit.trainer.sources.base import build_reward_pool

        torch.set_num_threads(spec.num_threads)
        self.spec, self.inbox, self.outbox = spec, inbox, outbox
        r = spec.rollout
        self.tokenizer, self.prompts, self.val, _ = build_data(
            spec.data, seed=spec.seed, model_path=spec.model.name_or_path, val_every=spec.val_every,
            val_prompts=spec.val_prompts)
        self.prompts.load_state_dict(spec.cursor)
        device = torch.device("cuda", r.gpus[0]) if r.gpus else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.engine = build_trainer_engine(r, spec.model, seed=spec.seed, hf_config=spec.hf_config, device=device,
                                           gpus=tuple(r.gpus) or (0,))
        self.pool = build_reward_pool(spec.reward)
        self.stop_ids = tuple(i for i in (getattr(self.tokenizer, "eos_token_id", None),) if i is not None)
        self.cond = threading.Condition()
        self.staged: tuple[int, list] | None = None  # the newest complete version not loaded yet
        self.received = -1  # the newest complete version received
        self.loaded = -1  # the version the engine holds
        self.requests: list[int] = []  # validation steps asked for
        self.stopping = False
        self.failure: str | None = None
        self.swaps = 0  # weight loads in the middle of a draw (partial rollouts)
        if r.on_update == "partial" and spec.interruptible:
            if not hasattr(self.engine, "between_steps"):
                raise ValueError(f"rollout.on_update=partial: the {r.engine} engine cannot take new weights in the "
                                 "middle of a draw; use finish")
            self.engine.between_steps = self._swap_if_newer

    # -- the receiving thread -----------------------------------------------------------------------
    def _receive(self) -> None:
        parts: list = []
        try:
            while True:
                if os.getppid() != self.spec.parent_pid:  # trainer rank 0 is gone
                    return self._set(stopping=True)
                try:
                    msg = self.inbox.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                kind = msg[0]
                if kind == "bucket":
                    _, _, names, dtypes, shapes, flat = msg
                    parts.append(unflatten(names, dtypes, shapes, flat))
                elif kind == "version":
                    with self.cond:
                        self.staged, self.received = (msg[1], parts), msg[1]
                        self.cond.notify_all()
                    parts = []
                elif kind == "validate":
                    with self.cond:
                        self.requests.append(msg[1])
                        self.cond.notify_all()
                elif kind == "stop":
                    return self._set(stopping=True)
        except BaseException as exc:  # noqa: BLE001
            self._set(failure=f"receiving weights: {type(exc).__name__}: {exc}")

    def _set(self, *, stopping: bool = False, failure: str | None = None) -> None:
        with self.cond:
            self.stopping = self.stopping or stopping or failure is not None
            self.failure = self.failure or failure
            self.cond.notify_all()

    # -- the generating loop ------------------------------------------------------------------------
    def run(self) -> None:
        threading.Thread(target=self._receive, name="rollout-weights", daemon=True).start()
        step = first = self.spec.start_step
        while True:
            # the oldest weights batch `step` may use: within the bound, and never older than the first
            # version the trainer sends (a resumed run has no older one)
            oldest = max(step - 1 - self.spec.bound, first - 1)
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self.requests or self.received >= oldest, timeout=POLL_S)
                if self.failure:
                    raise RuntimeError(self.failure)
                if self.stopping:
                    break
                ready = self.received >= oldest
            if self.requests:
                self._validate(self.requests.pop(0))
            elif ready:
                self.outbox.put(("batch", step, pickle.dumps(self._batch(step), protocol=pickle.HIGHEST_PROTOCOL)))
                step += 1
        if self.pool is not None:
            self.pool.close()

    def _load_newest(self) -> None:
        with self.cond:
            staged, self.staged = self.staged, None
        if staged is not None:
            version, buckets = staged
            self.engine.update_weights(iter(buckets))
            self.loaded = version

    def _swap_if_newer(self) -> bool:
        """Between two decode steps: load newer weights if any came (True: the draw goes on under them)."""
        if self.received <= self.loaded:
            return False
        self._load_newest()
        self.swaps += 1
        return True

    def _params(self, n: int, seed: int):
        from megatron_credit.trainer.sources.base import sampling_params

        return sampling_params(self.spec.rollout, self.stop_ids, n=n, seed=seed)

    def _batch(self, step: int) -> dict:
        """Iteration ``step``'s kept groups, as ``sync`` draws them, each with its version."""
        from megatron_credit.rollout.placement import draw_seed
        from megatron_credit.trainer.sources.base import draw_until_full, generate_and_score, group_counts

        r, spec = self.spec.rollout, self.spec
        count, n = r.prompts_per_step, r.n
        self._load_newest()
        pool_sums: dict[str, float] = {}
        tally = {"partial": 0, "wall": 0.0}

        def draw(d: int) -> list:
            """Draw ``d``: its groups that count, each with the oldest weights that sampled it."""
            records = self.prompts.take(count)
            if spec.interruptible:
                self._load_newest()
            version, swaps, t0 = self.loaded, self.swaps, time.perf_counter()
            batch, rewards, correct, pool = generate_and_score(
                self.engine, self.pool, self.tokenizer, records, self._params(n, draw_seed(spec.seed, step, d)),
                rollout=r, reward=spec.reward, first_group=0)
            tally["wall"] += time.perf_counter() - t0
            tally["partial"] += self.swaps > swaps
            for k, v in pool.items():
                pool_sums[k] = pool_sums.get(k, 0.0) + v
            slices = [slice(p * n, (p + 1) * n) for p in range(count)]
            return [((batch.samples[sl], rewards[sl], correct[sl]), version) for sl in slices
                    if group_counts(correct[sl], dynamic_sampling=spec.dynamic_sampling)]

        kept, draws = draw_until_full(draw, count=count, max_draws=spec.max_draws)
        return {"groups": [g for g, _ in kept[:count]], "versions": [v for _, v in kept[:count]], "draws": draws,
                "kept": len(kept), "pool": pool_sums, "cursor": self.prompts.state_dict(), "gen_s": tally["wall"],
                "partial": tally["partial"]}

    def _validate(self, step: int) -> None:
        """Validation of the weights of ``step`` (the trainer sent them just before asking)."""
        from megatron_credit.rewards.evaluation import metric_sums, sample_and_grade
        from megatron_credit.rollout.placement import draw_seed

        with self.cond:
            self.cond.wait_for(lambda: self.stopping or self.received >= step, timeout=self.spec.rollout.wait_timeout_s)
        self._load_newest()
        k = self.spec.val_samples
        sums = {}
        if self.val is not None:
            problems = sample_and_grade(self.engine, self.tokenizer, list(self.val), k=k, pool=self.pool,
                                        sampling=self._params(k, draw_seed(self.spec.seed, -1)), first_group=0)
            sums = metric_sums(problems, k=k)
        self.outbox.put(("val", step, sums))


def flatten(bucket: list[tuple[str, torch.Tensor]]):
    """One bucket as ``(names, dtypes, shapes, flat bytes)``: one buffer to share instead of one per tensor."""
    names = [name for name, _ in bucket]
    tensors = [t.detach().to("cpu").contiguous() for _, t in bucket]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
    return names, [str(t.dtype).removeprefix("torch.") for t in tensors], [tuple(t.shape) for t in tensors], flat


def unflatten(names, dtypes, shapes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket :func:`flatten` made (views of ``flat``).

    >>> b = [("a", torch.arange(3.0)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
    >>> [(n, t.tolist()) for n, t in unflatten(*flatten(b))]
    [('a', [0.0, 1.0, 2.0]), ('b', [[1.0, 1.0], [1.0, 1.0]])]
    """
    out, at = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, dtype)
        size = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        out.append((name, flat[at:at + size].view(dt).view(shape)))
        at += size
    return out
