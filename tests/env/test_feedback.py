"""The feedback environment (``env/feedback.py``): a wrong attempt gets the verifier's verdict and another
try, up to ``env.max_turns``; a right one ends the episode. Driven by the multi-turn loop on the tiny HF
engine of ``tests/rollout/test_multi_turn.py``, whose token ids are their own text."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.env import ENVIRONMENTS, build_environment
from megatron_credit.env.feedback import Feedback
from megatron_credit.rewards.arith import score_arith
from megatron_credit.rollout import SamplingParams
from megatron_credit.rollout.multi_turn import EpisodeEngine
from tests.rollout.test_multi_turn import EOS, Tok, tiny_engine

ENDS = (EOS,) + tuple(range(40, 60))  # a fifth of the vocabulary ends a turn as EOS does: short attempts
OPTIONS = {"incorrect_text": "90 {answer} 91", "no_answer_text": "92", "retry_reward": -0.25}
PROMPTS = [[3, 17, 42], [5, 6, 7, 8]]


def records(truths):
    return [PromptRecord(uid=f"p{i}", data_source="synthetic_arith", ground_truth=t,
                         messages=(ChatMessage(role="user", content="x"),)) for i, t in enumerate(truths)]


def play(engine, truths, max_turns=4):
    env = build_environment("feedback", OPTIONS)
    ep = EpisodeEngine(engine, env, Tok(), max_turns=max_turns, max_total_tokens=60, step_timeout_s=5.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=ENDS, n=3, seed=5)
    return ep.generate(PROMPTS, params, group_ids=[0, 1], records=records(truths)).samples


def turns_of(s):
    """The trajectory as ``[(attempt ids, observation ids), ...]``."""
    out = []
    for k in range(int(s.turn_ids[-1]) + 1):
        at = (s.turn_ids == k).tolist()
        act = s.action_mask.tolist()
        out.append(([t for t, a, m in zip(s.response_ids, at, act) if a and m],
                    [t for t, a, m in zip(s.response_ids, at, act) if a and not m]))
    return out


@pytest.fixture(scope="module")
def hf():
    return tiny_engine()


def test_a_wrong_attempt_gets_the_verdict_and_another_try(hf):
    samples = play(hf, ["999", "999"])  # a leading integer of 999 never comes: every attempt is wrong
    after_eos = 0
    for s in samples:
        turns = turns_of(s)
        assert len(turns) == 4 and s.episode.turns == 4  # every try used, up to env.max_turns
        for attempt, obs in turns[:-1]:
            assert obs == [90, attempt[0], 91]  # the verdict names the answer the verifier read
            after_eos += attempt[-1] in ENDS
        assert turns[-1][1] == [] and s.episode.turn_rewards == (-0.25, -0.25, -0.25, -0.25)
    assert after_eos >= 6, "attempts that end on EOS go on (Feedback.continues_after_eos)"


def test_a_right_attempt_ends_the_episode(hf):
    first = turns_of(play(hf, ["999", "999"])[0])  # the seeds are fixed: the same attempts again
    truth = str(first[1][0][0])  # trajectory 0 answers this on its second attempt
    s = play(hf, [truth, "999"])[0]
    turns = turns_of(s)
    assert [a for a, _ in turns] == [a for a, _ in first[:2]] and len(turns) == 2
    assert score_arith(Tok().decode(turns[-1][0]), truth).correct and s.episode.turn_rewards == (-0.25, 0.0)


def test_a_verdict_without_an_answer_or_a_ground_truth():
    env = Feedback(Feedback.Config(no_answer_text="none", end_texts=("</s>",)))
    state = env.start(records(["12"])[0])
    assert env.step(state, "no digits</s>").observation == "none"
    assert env.step(state, "12</s>").done  # the EOS text is not part of the answer
    assert env.step(env.start(records(["x"])[0]), "12").done  # bad ground truth: no try can change it
    assert env.stop_texts == () and Feedback(Feedback.Config(stop_text="</a>")).stop_texts == ("</a>",)


@pytest.mark.parametrize("options, message", [
    ({"incorrect_text": "{verdict}"}, "env.options.incorrect_text may only name {answer}"),
    ({"retry_reward": float("nan")}, "env.options.retry_reward must be a finite number"),
    ({"end_texts": [""]}, "env.options.end_texts must hold non-empty strings"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        build_environment("feedback", options)
    assert "feedback" in ENVIRONMENTS
