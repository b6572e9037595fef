"""Multi-turn rollouts (``rollout/multi_turn.py``) on the HF engine with a tiny random Qwen2: trajectories built
by appending token ids, the engine's log-probs equal to a teacher-forced forward of the whole trajectory on
the policy's tokens (token-in/token-out), observations out of ``response_mask``, the turn budget, the
environment's faults scored by the abort rule, and the trajectory's wire bytes."""
import threading
import time

import pytest
import torch
from transformers import Qwen2Config

from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.env import ENVIRONMENTS, Environment, StepResult
from megatron_credit.rollout import FinishStatus, HFRolloutEngine, SamplingParams
from megatron_credit.rollout.episode_scores import episode_rewards, scored_text
from megatron_credit.rollout.multi_turn import EpisodeEngine, StepThreads, turn_seed
from megatron_credit.rollout.types import RolloutBatch

VOCAB, EOS = 96, 2
CALLS = tuple(range(40, 60))  # a fifth of the vocabulary ends a call: trajectories of several turns


class Tok:
    """Token ids as text: ``"3 17 42"`` (an observation's text is tokenized once, on its own)."""

    eos_token_id, pad_token_id = EOS, 0

    def encode(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == EOS))


class Echo(Environment):
    """Answers a turn that ends on the call token with a fixed observation whose length depends on the
    turn; done after three turns or when the turn has no call."""

    stop_texts = tuple(str(t) for t in CALLS)

    def start(self, record):
        return {"turns": 0, "truth": record.ground_truth}

    def step(self, state, action):
        state["turns"] += 1
        if int(action.split()[-1]) not in CALLS or state["turns"] >= 3:
            return StepResult(done=True, reward=0.0)
        obs = " ".join(str(60 + k) for k in range(state["turns"] + 1))
        return StepResult(observation=obs, reward=0.25, tool_calls=1)


class Raises(Echo):
    def step(self, state, action):
        if state["turns"] >= 1:
            raise RuntimeError("the tool's server is down")
        return super().step(state, action)


class Hangs(Echo):
    def step(self, state, action):
        if state["turns"] >= 1:
            time.sleep(30)
        return super().step(state, action)


PROMPTS = [[3, 17, 42], [5, 6, 7, 8], [60], [12, 13, 14, 15]]
RECORDS = [PromptRecord(uid=f"p{i}", data_source="synthetic_arith", messages=(ChatMessage(role="user", content="x"),),
                        ground_truth="1") for i in range(len(PROMPTS))]


def tiny_engine():
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      initializer_range=0.3, tie_word_embeddings=False)
    return HFRolloutEngine(hf_config=cfg, init_seed=0)


@pytest.fixture(scope="module")
def hf():
    return tiny_engine()


def _params(**kw):
    return SamplingParams(**{**dict(temperature=1.0, max_new_tokens=6, stop_token_ids=(EOS,), n=3, seed=5), **kw})


def _episodes(engine, env_cls=Echo, **kw):
    return EpisodeEngine(engine, env_cls(env_cls.Config()), Tok(), **{**dict(max_turns=4, max_total_tokens=40,
                                                                            step_timeout_s=5.0), **kw})


def _teacher_forced(model, s):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    p = len(s.prompt_ids)
    return logp[p - 1:p - 1 + len(s.response_ids)].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]


def test_trajectories_are_token_in_token_out(hf):
    ep = _episodes(hf)
    batch = ep.generate(PROMPTS, _params(), group_ids=[10, 11, 12, 13], records=RECORDS)
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [(g, j) for g in (10, 11, 12, 13) for j in range(3)]
    multi = 0
    for s in batch.samples:
        act, turns = s.action_mask, s.turn_ids.long()
        assert act.shape == turns.shape == (len(s.response_ids),)
        # observations are exactly Echo's ids, after each turn that ended on the call token, and log-prob 0
        k, at = 0, 0
        while at < len(s.response_ids):
            run = 0
            while at + run < len(s.response_ids) and act[at + run]:
                run += 1
            assert run > 0 and (turns[at:at + run] == k).all()
            at += run
            if at == len(s.response_ids):
                break
            assert s.response_ids[at - 1] in CALLS
            want = [60 + j for j in range(k + 2)]
            assert s.response_ids[at:at + len(want)] == want and not act[at:at + len(want)].any()
            assert (s.logprobs[at:at + len(want)] == 0).all() and (turns[at:at + len(want)] == k).all()
            at += len(want)
            k += 1
        multi += k > 0
        assert s.episode.turns == k + 1 and s.episode.tool_calls == k
        assert s.episode.turn_rewards == tuple([0.25] * k + [0.0])
        # the engine's log-probs are the trainer's: a teacher-forced forward of the whole trajectory
        want = _teacher_forced(hf.model, s)
        torch.testing.assert_close(s.logprobs.double()[act], want[act], rtol=0, atol=1e-5)
    assert multi >= 4, "the test needs trajectories of several turns"


def test_a_trajectory_does_not_depend_on_the_batch(hf):
    ep = _episodes(hf)
    both = ep.generate(PROMPTS, _params(), group_ids=[10, 11, 12, 13], records=RECORDS)
    one = ep.generate(PROMPTS[2:3], _params(), group_ids=[12], records=RECORDS[2:3])
    assert [s.response_ids for s in one.samples] == [s.response_ids for s in both.samples[6:9]]
    assert turn_seed(5, 1) != turn_seed(5, 2)


def test_observations_are_context_not_actions(hf):
    batch = _episodes(hf).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    padded = batch.to_padded(pad_token_id=0)
    assert padded.obs_mask is not None and padded.obs_mask.any()
    assert not (padded.obs_mask & padded.response_mask).any()
    for i, s in enumerate(batch.samples):
        p = len(s.prompt_ids)
        assert padded.response_mask[i, p:p + len(s.response_ids)].tolist() == s.action_mask.tolist()
        assert padded.obs_mask[i, p:p + len(s.response_ids)].tolist() == (~s.action_mask).tolist()
    assert scored_text(Tok(), batch.samples[0]) == Tok().decode(
        [t for t, a, k in zip(batch.samples[0].response_ids, batch.samples[0].action_mask, batch.samples[0].turn_ids)
         if a and k == batch.samples[0].turn_ids[-1]], skip_special_tokens=True)


def test_the_verifier_reads_a_stopped_response_without_its_eos(tmp_path):
    """A response that stops ends in the tokenizer's EOS; a ``transformers`` tokenizer decodes it as text by
    default, and DAPO's verifier then read ``Answer:1<eos>`` as the answer ``1<eos>``: every correct response
    of a Qwen chat model (``<|im_end|>``) scored -1. The graded text leaves special tokens out."""
    from transformers import AutoTokenizer

    from megatron_credit.commands.rehearse import write_tokenizer
    from megatron_credit.rewards.dapo import score_dapo
    from megatron_credit.rollout.types import RolloutSample

    write_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode("Answer:1", add_special_tokens=False) + [tok.eos_token_id]
    sample = RolloutSample(prompt_ids=[3], response_ids=ids, logprobs=torch.zeros(len(ids)),
                           status=FinishStatus.STOPPED, group_id=0, sample_index=0, logprobs_mode="raw")
    assert tok.decode(ids) == "Answer:1<eos>"  # what the verifier was given
    assert scored_text(tok, sample) == "Answer:1" and score_dapo(scored_text(tok, sample), "1").correct


def test_the_trajectory_budget_cuts(hf):
    batch = _episodes(hf, max_total_tokens=8).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert all(len(s.response_ids) <= 8 for s in batch.samples)
    cut = [s for s in batch.samples if len(s.response_ids) == 8]
    assert cut and all(s.status == FinishStatus.TRUNCATED for s in cut)
    batch = _episodes(hf, max_turns=1).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert all(s.action_mask.all() and s.episode.turns == 1 for s in batch.samples)


@pytest.mark.parametrize("env_cls,why", [(Raises, "raised RuntimeError: the tool's server is down"),
                                         (Hangs, "timed out after 0.5 s")])
def test_a_failing_environment_ends_its_trajectory_and_the_run_goes_on(hf, env_cls, why):
    ep = _episodes(hf, env_cls, step_timeout_s=0.5)
    t0 = time.monotonic()
    batch = ep.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert time.monotonic() - t0 < 10
    failed = [s for s in batch.samples if s.episode.env_errors]
    assert failed, "some trajectory called the tool a second time"
    assert all(s.episode.turns == 2 for s in failed)  # ended at the failing step: turn 0, then turn 1
    rewards, correct = episode_rewards(batch.samples, torch.ones(len(batch)), torch.ones(len(batch), dtype=torch.bool))
    for i, s in enumerate(batch.samples):
        if s.episode.env_errors:
            assert rewards[i] == -1.0 + 0.25 and not correct[i]  # the abort rule, plus turn 0's reward
        else:
            assert rewards[i] == 1.0 + sum(s.episode.turn_rewards) and correct[i]
    assert list(ep.errors) == [next(r for r in ep.errors if why in r)]  # one reason, named
    assert sum(ep.errors.values()) == len(failed)


class BadIds(Echo):
    def step(self, state, action):
        return StepResult(observation=[-7, 10**9, 3], tool_calls=1)


class ReturnsNone(Echo):
    def step(self, state, action):
        return None


class NaNReward(Echo):
    def step(self, state, action):
        return StepResult(observation="61 62", reward=float("nan"), tool_calls=1)


class WrongType(Echo):
    def step(self, state, action):
        return {"observation": "61", "done": False}


class DoneText(Echo):
    def step(self, state, action):
        return StepResult(observation="61", done="no")


class StartRaises(Echo):
    def start(self, record):
        raise KeyError("ground_truth")


HOSTILE = [(BadIds, "environment step's observation token id -7 is outside the vocabulary [0, 96)"),
           (ReturnsNone, "environment step returned NoneType None, not a StepResult"),
           (NaNReward, "environment step's reward is float nan, not a finite number"),
           (WrongType, "environment step returned dict {'observation': '61', 'done': False}, not a StepResult"),
           (DoneText, "environment step's done is str 'no', not a bool"),
           (StartRaises, "environment start raised KeyError: 'ground_truth'")]


@pytest.mark.parametrize("env_cls,why", HOSTILE, ids=[c.__name__ for c, _ in HOSTILE])
def test_a_hostile_environments_output_is_an_environment_failure(hf, env_cls, why):
    """What an environment returns is checked before the loop uses it: a bad output ends its trajectory,
    scored by the abort rule, with the reason on the sample; the metrics count the reasons, the log gets
    one line per reason, and the run stops after ``env.max_failed_iterations`` such iterations in a row."""
    from types import SimpleNamespace

    from megatron_credit.sources.routing import RolloutSourceBase
    from megatron_credit.trainer.divergence import EnvironmentGuard

    ep = _episodes(hf, env_cls)
    batch = ep.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert all(s.episode.env_errors == 1 and s.episode.turns == 1 and s.error == why for s in batch.samples)
    assert all(s.action_mask.all() for s in batch.samples)  # nothing of the bad output entered a trajectory
    assert dict(ep.errors) == {why: 12}
    rewards, correct = episode_rewards(batch.samples, torch.ones(12), torch.ones(12, dtype=torch.bool))
    assert rewards.tolist() == [-1.0] * 12 and not correct.any()
    router = SimpleNamespace(device=torch.device("cpu"), dp_size=1, dp_group=None)
    metrics = RolloutSourceBase._episode_metrics(router, batch.samples, batch.to_padded(pad_token_id=0), correct)
    assert (metrics["env/errors"], metrics["env/failed_frac"], metrics["env/error_reasons"]) == (12, 1.0, {why: 12})
    assert metrics["accuracy/first_turn"] == 0.0  # aborted: incorrect, though each played one turn
    guard = EnvironmentGuard(name="hostile", max_failed_iterations=2)
    assert guard.lines(7, metrics) == [f"iteration 7: env hostile failed on 12 trajectories (ended by the abort rule): "
                                       f"{why}"]
    assert guard.check(7, metrics) is None
    assert guard.check(8, metrics) == (f"env hostile failed on every trajectory for 2 iterations in a row up to "
                                       f"iteration 8: {why}; stopped before saving it (fix the environment; "
                                       "env.max_failed_iterations=2)")


def test_an_environment_failing_on_some_trajectories_does_not_stop_the_run(hf):
    from types import SimpleNamespace

    from megatron_credit.sources.routing import RolloutSourceBase
    from megatron_credit.trainer.divergence import EnvironmentGuard

    batch = _episodes(hf, Raises).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    router = SimpleNamespace(device=torch.device("cpu"), dp_size=1, dp_group=None)
    metrics = RolloutSourceBase._episode_metrics(router, batch.samples, batch.to_padded(pad_token_id=0),
                                            torch.ones(12, dtype=torch.bool))
    failed = sum(s.episode.env_errors for s in batch.samples)
    one_turn = sum(s.episode.turns == 1 for s in batch.samples)
    assert 0 < one_turn < 12 and metrics["accuracy/first_turn"] == one_turn / 12  # every verdict correct here
    assert 0 < failed < 12 and metrics["env/failed_frac"] == failed / 12
    assert metrics["env/error_reasons"] == {"environment step raised RuntimeError: the tool's server is down": failed}
    guard = EnvironmentGuard(name="raises", max_failed_iterations=1)
    assert guard.check(1, metrics) is None and guard.check(2, {"env/failed_frac": 0.0}) is None
    assert guard.check(3, {"env/failed_frac": 1.0}) is not None and guard.failed_in_a_row == 1


class Verbose(Echo):
    def step(self, state, action):
        return StepResult(observation=" ".join(["61"] * 33_334))  # 100,000 characters


def test_a_long_observation_is_cut_to_the_budget_and_flagged(hf):
    batch = _episodes(hf, Verbose).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    for s in batch.samples:
        turn0 = int(s.action_mask.sum())
        assert len(s.response_ids) == 40 and s.response_ids[turn0:] == [61] * (40 - turn0)
        assert s.status == FinishStatus.TRUNCATED and s.episode.env_errors == 0 and s.error == ""


class SpyTok(Tok):
    """Tok with a vocabulary as it spells it (``"61 "``: a token covers its digits and a space) that records
    the length of every text it encodes."""

    def __init__(self):
        self.encoded: list[int] = []

    def get_vocab(self):
        return {f"{i} ": i for i in range(128)}

    def encode(self, text):
        self.encoded.append(len(text))
        return super().encode(text)


def test_a_long_observation_is_tokenized_only_as_far_as_the_budget_reaches(hf):
    """A 100,000-character observation with 40 tokens of budget: what is tokenized is a prefix of at most
    (room + 1) x the longest token's spelling (4 characters here), and the trajectory is the same as when
    the whole text is tokenized (the test above, without a vocabulary to bound by)."""
    from megatron_credit.rollout.env_checks import longest_token_chars

    tok = SpyTok()
    assert longest_token_chars(tok) == 4 and longest_token_chars(Tok()) is None
    engine = EpisodeEngine(hf, Verbose(Verbose.Config()), tok, max_turns=4, max_total_tokens=40, step_timeout_s=5.0)
    batch = engine.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert tok.encoded and max(tok.encoded) <= 41 * 4 < 100_000
    whole = _episodes(hf, Verbose).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    for s, w in zip(batch.samples, whole.samples):
        assert s.response_ids == w.response_ids and s.status == w.status == FinishStatus.TRUNCATED


def test_trajectories_cross_the_wire(hf):
    from megatron_credit.rollout.wire import decode, encode, payload_bytes

    batch = _episodes(hf).generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    groups = [(k, (batch.samples[3 * k:3 * k + 3], torch.rand(3), torch.rand(3) > 0.5)) for k in range(4)]
    buf = encode(groups)
    assert payload_bytes(groups) < buf.numel() <= 1.1 * payload_bytes(groups) + 64 * 12
    for (k, (ss, r, c)), (k2, (ss2, r2, c2)) in zip(groups, decode(buf)):
        assert k == k2 and torch.equal(r, r2) and torch.equal(c, c2)
        for a, b in zip(ss, ss2):
            assert a.response_ids == b.response_ids and torch.equal(a.logprobs, b.logprobs)
            assert torch.equal(a.action_mask, b.action_mask) and torch.equal(a.turn_ids, b.turn_ids)
            assert a.episode == b.episode
    padded = RolloutBatch(samples=[s for _, (ss, _, _) in decode(buf) for s in ss]).to_padded(pad_token_id=0)
    ref = batch.to_padded(pad_token_id=0)
    assert torch.equal(padded.obs_mask, ref.obs_mask) and torch.equal(padded.turn_ids, ref.turn_ids)
    assert torch.equal(padded.turn_rewards, ref.turn_rewards)


class SlowThenHangs(Echo):
    """Every step takes 0.2 s; the second step of the trajectories of group 1 hangs."""

    def start(self, record):
        return {**super().start(record), "uid": record.uid}

    def step(self, state, action):
        time.sleep(0.2)
        if state["turns"] >= 1 and state["uid"] == "p1":
            time.sleep(60)
        return super().step(state, action)


def test_the_step_deadline_counts_from_each_steps_start(hf):
    """12 steps of 0.2 s on 2 threads take 1.2 s, over the 0.5 s deadline, and none of them times out: the
    deadline is per step. Hung steps are abandoned and do not starve the steps queued behind them."""
    ep = _episodes(hf, SlowThenHangs, step_timeout_s=0.5)
    ep.threads = 2
    ep._executor.shutdown()
    ep._executor = StepThreads(2)
    t0 = time.monotonic()
    batch = ep.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert time.monotonic() - t0 < 20
    for s, rec in zip(batch.samples, [r for r in RECORDS for _ in range(3)]):
        hung = rec.uid == "p1" and s.episode.turns >= 2
        assert s.episode.env_errors == (1 if hung else 0), (rec.uid, s.episode)
    assert any(s.episode.env_errors for s in batch.samples)


def test_step_threads_run_fail_and_cancel():
    threads = StepThreads(1)
    gate = threading.Event()
    first = threads.submit(gate.wait, 10)
    failing = threads.submit(int, "x")
    queued = threads.submit(int, "3")
    assert queued.cancel() and not first.done()
    gate.set()
    assert first.result(5) is True and isinstance(failing.exception(5), ValueError)
    started = threading.Event()
    hung = threads.submit(lambda: started.set() or threading.Event().wait())  # never returns
    assert started.wait(5)
    waiting = threads.submit(int, "4")
    threads.shutdown()  # the hung step keeps its thread; what no thread started is cancelled
    assert waiting.cancelled() and hung.running()


HUNG_FOR_GOOD = """
import threading, time, sys
sys.path.insert(0, {root!r})
from tests.rollout.test_multi_turn import Echo, PROMPTS, RECORDS, _episodes, _params, tiny_engine

class Never(Echo):
    def step(self, state, action):
        if state["turns"] >= 1:
            threading.Event().wait()  # a plugin's environment that never answers
        return super().step(state, action)

engine = tiny_engine()
ep = _episodes(engine, Never, step_timeout_s=0.5)
batch = ep.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
ep.close()
print("errors", sum(s.episode.env_errors for s in batch.samples), flush=True)
"""


@pytest.mark.spawn
def test_a_step_hung_for_good_does_not_keep_a_finished_process_from_exiting(tmp_path):
    # An executor's threads are joined at the interpreter's exit: one step that never returns kept the run
    # from exiting after its last iteration. The step threads are daemons, left to the process's end.
    import subprocess
    import sys

    from tests.support.paths import ROOT
    from tests.support.runs import subprocess_env

    script = tmp_path / "hung.py"
    script.write_text(HUNG_FOR_GOOD.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = int(out.stdout.split("errors")[-1])
    assert errors > 0  # steps did hang (and were abandoned): the process still exited


def test_the_pools_hook_runs_between_turns(hf):
    """A pool engine's ``between_steps`` (its progress beat; in ``on_update: partial`` the newer weights) runs
    between turns as well as between decode steps, and a setting through the wrapper reaches the engine."""

    class Inner:
        def __init__(self):
            self.between_steps, self.calls = None, []

        def generate(self, prompts, params, *, group_ids=None):
            self.calls.append(len(prompts))
            return hf.generate(prompts, params, group_ids=group_ids)

    inner = Inner()
    ep = EpisodeEngine(inner, Echo(Echo.Config()), Tok(), max_turns=4, max_total_tokens=40, step_timeout_s=5.0)
    seen = []
    ep.between_steps = lambda: seen.append(len(inner.calls))
    assert inner.between_steps is not None  # set on the engine that decodes
    ep.generate(PROMPTS, _params(), group_ids=[0, 1, 2, 3], records=RECORDS)
    assert len(inner.calls) >= 2 and seen == list(range(1, len(inner.calls)))  # before every later turn


class Steady(Echo):
    """Three turns on every trajectory, an observation after each; the step of the trajectory of prompt
    ``p{k}`` sleeps ``slow_s`` at its turn ``k`` (``None``: none sleeps), so each turn has one slow step
    and each trajectory at most one."""

    slow_s = None

    def start(self, record):
        return {"turns": 0, "k": int(record.uid[1:])}

    def step(self, state, action):
        if self.slow_s is not None and state["k"] == state["turns"]:
            time.sleep(self.slow_s)
        state["turns"] += 1
        return StepResult(observation="61 62", reward=0.25, done=state["turns"] >= 3, tool_calls=1)


class SlowSteady(Steady):
    slow_s = 0.3


EIGHT = [[3 + k, 17, 42 - k] for k in range(8)]
EIGHT_RECORDS = [PromptRecord(uid=f"p{k}", data_source="synthetic_arith",
                              messages=(ChatMessage(role="user", content="x"),), ground_truth="1") for k in range(8)]


class Timed:
    """An engine that keeps the seconds its ``generate`` calls took (a loaded machine's noise is there)."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, prompts, params, *, group_ids=None):
        t0 = time.perf_counter()
        try:
            return self.engine.generate(prompts, params, group_ids=group_ids)
        finally:
            self.seconds += time.perf_counter() - t0


def test_a_trajectory_goes_on_as_soon_as_its_step_returns(hf):
    """Eight trajectories of three turns, one slow step (0.3 s) per turn on a different trajectory each
    turn: in lockstep the draw waits for the slow step of every turn (0.9 s besides generating); a
    trajectory that goes on as soon as its own step returns makes it about one slow step. The tokens are
    those of the lockstep draw and of each trajectory played alone: the seeds, not the order the steps end
    in, pick them (the engine's log-probs agree to float rounding: its batches differ)."""
    params = _params(n=1, max_new_tokens=4, stop_token_ids=())  # no EOS: every trajectory plays its 3 turns
    groups = list(range(8))
    lockstep = _episodes(hf, Steady, max_total_tokens=64, lockstep=True)
    ref = lockstep.generate(EIGHT, params, group_ids=groups, records=EIGHT_RECORDS).samples
    engine = Timed(hf)
    slow = _episodes(engine, SlowSteady, max_total_tokens=64)
    t0 = time.perf_counter()
    batch = slow.generate(EIGHT, params, group_ids=groups, records=EIGHT_RECORDS).samples
    waited = time.perf_counter() - t0 - engine.seconds  # the draw's time besides generating
    alone = [lockstep.generate(EIGHT[k:k + 1], params, group_ids=[k], records=EIGHT_RECORDS[k:k + 1]).samples[0]
             for k in range(8)]
    for other in (ref, alone):
        assert [s.response_ids for s in batch] == [s.response_ids for s in other]
        assert [(s.episode, s.status, s.action_mask.tolist()) for s in batch] == \
            [(s.episode, s.status, s.action_mask.tolist()) for s in other]
        for s, o in zip(batch, other):
            torch.testing.assert_close(s.logprobs, o.logprobs, rtol=0, atol=1e-5)
    assert all(s.episode.turns == 3 for s in batch)
    assert waited < 0.6, waited  # lockstep waits 0.9 s; here the slow steps overlap the others' turns


def test_lockstep_waits_for_every_step_of_the_turn(hf):
    """``env.lockstep``: the later turns of the draw are generated together, one engine call per turn."""

    class Counting:
        def __init__(self):
            self.between_steps, self.calls = None, []

        def generate(self, prompts, params, *, group_ids=None):
            self.calls.append(sorted(group_ids))
            return hf.generate(prompts, params, group_ids=group_ids)

    inner = Counting()
    ep = EpisodeEngine(inner, Steady(Steady.Config()), Tok(), max_turns=4, max_total_tokens=64, step_timeout_s=5.0,
                       lockstep=True)
    batch = ep.generate(EIGHT, _params(n=1, max_new_tokens=4), group_ids=list(range(8)), records=EIGHT_RECORDS)
    going = [[k for k, s in enumerate(batch.samples) if s.episode.turns > t] for t in (1, 2)]
    assert inner.calls == [list(range(8)), *going]


class Scripted:
    """An engine that answers trajectory ``g``'s turn ``k`` with ``script[g][k]`` (token ids) and EOS."""

    def __init__(self, script):
        self.script, self.turn = script, {}

    def generate(self, prompts, params, *, group_ids=None):
        from megatron_credit.rollout.types import RolloutSample

        out = []
        for p, g in zip(prompts, group_ids):
            k = self.turn.get(g, 0)
            self.turn[g] = k + 1
            ids = list(self.script[g][k]) + [EOS]
            out.append(RolloutSample(prompt_ids=list(p), response_ids=ids, logprobs=torch.zeros(len(ids)),
                                     status=FinishStatus.STOPPED, group_id=g, sample_index=0, logprobs_mode="raw"))
        return RolloutBatch(samples=out)


def test_first_turn_accuracy_separates_the_first_attempt_from_the_final_one():
    """The feedback environment on four scripted trajectories (the answer is 1): right at once, right at the
    second attempt, wrong three times, right at once. The final verdicts are 3 of 4 correct; the first
    attempts 2 of 4 (``accuracy/first_turn``)."""
    from megatron_credit.env.feedback import Feedback
    from megatron_credit.rewards.math import compute_score_for_source
    from megatron_credit.rollout.episode_scores import first_turn_correct

    env = Feedback(Feedback.Config(incorrect_text="90 91", no_answer_text="92", end_texts=(str(EOS),)))
    script = {0: [[1]], 1: [[4], [1]], 2: [[4], [5], [6]], 3: [[1]]}
    ep = EpisodeEngine(Scripted(script), env, Tok(), max_turns=3, max_total_tokens=40, step_timeout_s=5.0,
                       vocab_size=VOCAB)
    batch = ep.generate([[7], [8], [9], [10]], _params(n=1), group_ids=[0, 1, 2, 3],
                        records=[RECORDS[0]] * 4).samples
    assert [s.episode.turns for s in batch] == [1, 2, 3, 1]
    assert batch[1].response_ids == [4, EOS, 90, 91, 1, EOS]
    verdicts = [compute_score_for_source(scored_text(Tok(), s), "1", data_source="synthetic_arith") for s in batch]
    rewards, correct = episode_rewards(batch, torch.tensor([v.score for v in verdicts]),
                                       torch.tensor([v.correct for v in verdicts]))
    assert correct.tolist() == [True, True, False, True]
    assert first_turn_correct(batch, correct).tolist() == [True, False, False, True]
    assert first_turn_correct(batch, correct).float().mean().item() == 0.5
