"""``env.name: openenv`` (``env/openenv_adapter.py``): a guess-the-number game written against OpenEnv's own API
(``tests/env/openenv_targets.py``) played through the adapter, alone and in the multi-turn loop on the tiny HF
engine of ``tests/rollout/test_multi_turn.py`` (token ids are their own text); the library's faults reach the
loop's checks; bad options and a missing library are one line.

The games need ``openenv-core`` (the ``openenv`` extra, not the test extra: it brings gradio and pandas, and its
import takes seconds); without it they are skipped, and the checks that need no library still run."""
from __future__ import annotations

import builtins
import gc
import importlib.util
import sys

import pytest

from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.env import ENVIRONMENTS, StepResult, build_environment
from megatron_credit.env.openenv_adapter import OpenEnv

needs_openenv = pytest.mark.skipif(importlib.util.find_spec("openenv") is None,
                                   reason="openenv-core is the openenv extra's (pip install -e '.[openenv]')")
TARGETS = "tests.env.openenv_targets"
OPTIONS = {"env": f"{TARGETS}:GuessNumber", "action": f"{TARGETS}:GuessAction",
           "reset_fields": {"target": "ground_truth"}, "observation_text": "{verdict}"}


def records(truths, **extra):
    return [PromptRecord(uid=f"p{i}", data_source="synthetic_arith", ground_truth=t, extra_info=dict(extra),
                         messages=(ChatMessage(role="user", content="guess"),)) for i, t in enumerate(truths)]


@needs_openenv
def test_a_game_through_the_adapter():
    from tests.env import openenv_targets as game

    env = build_environment("openenv", {**OPTIONS, "end_texts": ["</s>"],
                                        "observation_text": "[{verdict} after {guesses}]"})
    assert env.continues_after_eos and env.stop_texts == ()
    other = build_environment("openenv", {**OPTIONS, "stop_texts": ["</guess>"], "continues_after_eos": False})
    assert other.stop_texts == ("</guess>",) and other.continues_after_eos is False  # what the loop reads
    state = env.start(records(["7"])[0])
    assert state.env.state.target == 7  # reset(target=<the record's ground truth>)
    assert env.step(state, "3 </s>") == StepResult(observation="[91 after 1]", reward=game.MISS)
    assert env.step(state, "9</s>") == StepResult(observation="[92 after 2]", reward=game.MISS)
    assert not state.env.closed
    assert env.step(state, "7 7</s>") == StepResult(reward=game.HIT, done=True)
    assert state.env.closed  # an episode that is done closes its instance at once
    # The game's own end (max_guesses) is the episode's; a trajectory rubric's reward comes at that step.
    late = build_environment("openenv", {**OPTIONS, "env": f"{TARGETS}:guess_at_the_end",
                                         "env_kwargs": {"max_guesses": 2}})
    state = late.start(records(["5"])[0])
    assert late.step(state, "1") == StepResult(observation="91", reward=0.0)
    assert late.step(state, "6") == StepResult(reward=0.0, done=True)  # lost: the rubric's 0
    state = late.start(records(["5"])[0])
    assert [late.step(state, t) for t in ("9", "5")] == [StepResult(observation="92", reward=0.0),
                                                         StepResult(reward=1.0, done=True)]


@needs_openenv
def test_each_episode_has_its_own_instance_closed_at_the_end():
    from tests.env import openenv_targets as game

    env = build_environment("openenv", {**OPTIONS, "reset_fields": {"target": "extra_info.secret",
                                                                    "episode_id": "uid"}})
    a, b = (env.start(r) for r in records(["1", "2"], secret="4"))
    assert a.env is not b.env and (a.env.state.target, b.env.state.target) == (4, 4)
    assert (a.env.state.episode_id, b.env.state.episode_id) == ("p0", "p1")
    env.step(a, "3")
    assert (a.env.state.step_count, b.env.state.step_count) == (1, 0)
    dropped, kept = a.env, b.env
    del a
    gc.collect()
    assert dropped.closed and not kept.closed  # an episode the loop drops closes its instance
    env.close()
    assert kept.closed
    with pytest.raises(ValueError, match="returned an instance that another episode holds"):
        shared = build_environment("openenv", {**OPTIONS, "env": f"{TARGETS}:shared"})
        first = shared.start(records(["1"])[0])  # noqa: F841  (held while the second starts)
        shared.start(records(["1"])[0])
    assert game.SHARED in game.BUILT


def turns_of(s):
    """The trajectory as ``[(turn ids, observation ids), ...]``."""
    act, turn = s.action_mask.tolist(), s.turn_ids.tolist()
    return [([t for t, k, a in zip(s.response_ids, turn, act) if k == j and a],
             [t for t, k, a in zip(s.response_ids, turn, act) if k == j and not a]) for j in range(turn[-1] + 1)]


def play(env, truths, hf):
    from megatron_credit.rollout import SamplingParams
    from megatron_credit.rollout.multi_turn import EpisodeEngine
    from tests.rollout.test_multi_turn import EOS, Tok

    ends = (EOS,) + tuple(range(40, 60))  # a fifth of the vocabulary ends a turn as EOS does: short turns
    ep = EpisodeEngine(hf, env, Tok(), max_turns=4, max_total_tokens=60, step_timeout_s=5.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=ends, n=3, seed=5)
    return ep, ep.generate([[3, 17, 42], [5, 6, 7, 8]], params, group_ids=[0, 1], records=records(truths)).samples


@pytest.fixture(scope="module")
def hf():
    from tests.rollout.test_multi_turn import tiny_engine

    return tiny_engine()


@needs_openenv
def test_the_game_in_the_multi_turn_loop(hf):
    from tests.env import openenv_targets as game

    built = len(game.BUILT)
    _, first = play(build_environment("openenv", OPTIONS), ["999", "999"], hf)  # no guess is 999: 3 misses each
    assert [len(turns_of(s)) for s in first] == [3] * 6  # the game ends after 3 guesses (env.max_turns is 4)
    # A target that trajectory j of prompt 0 guesses at turn k after guesses below it: with the same seeds it
    # sees the same observations ("too low") up to there, so it plays the same turns and wins at turn k.
    j, k, target = next((j, k, turns[k][0][0]) for j, turns in enumerate(turns_of(s) for s in first[:3])
                        for k in (1, 2) if all(turns[i][0][0] < turns[k][0][0] for i in range(k)))
    ep, samples = play(build_environment("openenv", OPTIONS), [str(target), "999"], hf)
    assert [turns_of(s)[0][0] for s in samples] == [turns_of(s)[0][0] for s in first]
    for s in samples:
        truth = target if s.group_id == 0 else 999
        turns, rewards = turns_of(s), []
        for n, (guess, obs) in enumerate(turns):  # the game's rules, turn by turn
            hit = guess[0] == truth
            rewards.append(game.HIT if hit else game.MISS)
            if hit or n == 2:  # done: nothing follows
                assert obs == [] and n == len(turns) - 1
            else:
                assert obs == [int(game.LOW if guess[0] < truth else game.HIGH)] and n < len(turns) - 1
        assert s.episode.turn_rewards == tuple(rewards) and s.episode.env_errors == 0 and s.error == ""
    assert len(turns_of(samples[j])) == k + 1 and samples[j].episode.turn_rewards[-1] == game.HIT
    ep.env.close()
    gc.collect()
    assert len(game.BUILT) == built + 12 and all(g.closed for g in game.BUILT[built:])


@needs_openenv
@pytest.mark.parametrize("how, reason", [
    ("raise", "environment step raised RuntimeError: the game server is down"),
    ("none", "environment step raised TypeError: Broken.step returned NoneType, not an OpenEnv Observation"),
    ("nan", "environment step's reward is float nan, not a finite number"),
    ("done", "environment step's done is str 'yes', not a bool"),
])
def test_a_broken_library_environment_is_an_environment_failure(hf, how, reason):
    env = build_environment("openenv", {**OPTIONS, "env": f"{TARGETS}:Broken", "env_kwargs": {"how": how}})
    ep, samples = play(env, ["999", "999"], hf)  # every first guess misses: every trajectory has a second step
    assert [s.error for s in samples] == [reason] * 6 and ep.errors == {reason: 6}
    for s in samples:  # the first (good) step's observation, the second turn, nothing of the bad output
        assert len(turns_of(s)) == 2 and turns_of(s)[1][1] == [] and s.episode.turn_rewards == (-0.25, 0.0)
        assert s.episode.aborted


def test_without_the_library_the_error_is_one_line(monkeypatch):
    for name in [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")] + ["openenv"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import openenv...` now raises ImportError
    with pytest.raises(ValueError) as err:
        build_environment("openenv", OPTIONS)
    assert str(err.value) == "env.name=openenv needs `pip install openenv-core==0.3.0` (openenv is not installed)"
    assert "openenv" in ENVIRONMENTS


def test_a_dependency_the_library_misses_is_named(monkeypatch):
    """Installed, but a module it imports is missing (a broken install): not "not installed"."""
    def failing_import(name, *args, **kwargs):
        if name.startswith("openenv"):
            raise ModuleNotFoundError("No module named 'gradio'", name="gradio")
        return real_import(name, *args, **kwargs)

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(ValueError) as err:
        build_environment("openenv", OPTIONS)
    assert str(err.value) == ("env.name=openenv: importing openenv failed (No module named 'gradio'); it needs "
                              "`pip install openenv-core==0.3.0` with its dependencies")


@pytest.mark.parametrize("options, message", [
    ({"env": ""}, "env.options.env must name the OpenEnv environment as 'module:factory', got ''"),
    ({"action": "tests.env.openenv_targets"}, "env.options.action must name the OpenEnv action as 'module:Class'"),
    ({"action_field": "a b"}, "env.options.action_field must be a field name, got 'a b'"),
    ({"reset_fields": {"target": "answer"}}, "env.options.reset_fields.target must be one of ['ground_truth', "),
    ({"observation_text": "{verdict"}, "env.options.observation_text is not a format string"),
    ({"observation_text": "{}"}, "env.options.observation_text must name observation fields"),
    ({"end_texts": [""]}, "env.options.end_texts must hold non-empty strings"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError) as err:
        OpenEnv.Config(**{**OPTIONS, **options})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@needs_openenv
@pytest.mark.parametrize("options, message", [
    ({"env": "tests.env.no_such_module:X"}, "env.options.env: cannot import 'tests.env.no_such_module'"),
    ({"env": f"{TARGETS}:Nope"}, "env.options.env: 'tests.env.openenv_targets' has no 'Nope'"),
    ({"env": f"{TARGETS}:HIT"}, "env.options.env: 'tests.env.openenv_targets:HIT' is float, not a class or"),
    ({"env": f"{TARGETS}:OneThread"}, "env.options.env: 'tests.env.openenv_targets:OneThread' sets "
                                      "REQUIRES_SINGLE_THREAD_EXECUTOR"),
    ({"action": f"{TARGETS}:GuessState"}, "env.options.action: 'tests.env.openenv_targets:GuessState' is not a "
                                          "subclass of OpenEnv's Action"),
    ({"action_field": "text"}, "env.options.action_field: GuessAction has no field 'text'; its fields: "
                               "['message', 'metadata']"),
])
def test_bad_library_references_name_the_field(options, message):
    with pytest.raises(ValueError) as err:
        build_environment("openenv", {**OPTIONS, **options})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@needs_openenv
def test_an_observation_field_the_template_names_but_the_game_lacks():
    env = build_environment("openenv", {**OPTIONS, "observation_text": "{hint}"})
    with pytest.raises(ValueError, match=r"env.options.observation_text names 'hint', which GuessObservation "
                                         r"lacks; its fields: \['done', 'guesses', 'metadata', 'reward', 'verdict'\]"):
        env.step(env.start(records(["7"])[0]), "3")
