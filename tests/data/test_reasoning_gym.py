"""``data.source: reasoning_gym``: seeded prompts of a reasoning-gym task, scored by the task's own scorer."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is the test extra's (pip install -e '.[test]')")

from megatron_credit.data.setup import build_data  # noqa: E402
from megatron_credit.recipe.sections import DataConfig  # noqa: E402
from megatron_credit.rewards.math import compute_score_for_source  # noqa: E402
from megatron_credit.rewards.reasoning_gym import score_reasoning_gym  # noqa: E402
from tests.support.runs import char_tokenizer  # noqa: E402

OPTIONS = {"task": "basic_arithmetic", "task_options": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
           "system_prompt": None, "answer_tag": None}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("char_tok")
    char_tokenizer(str(out))
    return str(out)


def data(tok_dir, **options):
    return DataConfig(source="reasoning_gym", tokenizer_path=tok_dir, max_prompt_len=512,
                      options={**OPTIONS, **options})


def test_seeded_prompts_are_deterministic(tok_dir):
    d = data(tok_dir)
    _, stream, val, task = build_data(d, seed=7, model_path=None, val_every=1, val_prompts=3)
    train = stream.take(4)
    _, again, val2, _ = build_data(d, seed=7, model_path=None, val_every=1, val_prompts=3)
    assert [r.messages for r in again.take(4)] == [r.messages for r in train]
    assert [r.prompt_ids for r in val2] == [r.prompt_ids for r in val]
    assert task.record(0).messages == train[0].messages  # the warm-up's task is the training stream's
    assert [r.messages for r in val] != [r.messages for r in train[:3]]  # validation is seed + 1
    other = build_data(d, seed=8, model_path=None, val_every=0, val_prompts=3)[1].take(4)
    assert [r.messages for r in other] != [r.messages for r in train]
    rec = train[0]
    assert rec.data_source == "reasoning_gym" and rec.uid == "reasoning_gym:basic_arithmetic:7:0"
    assert len(rec.messages) == 1 and rec.messages[0].role == "user"
    assert rec.messages[0].content.startswith("Calculate ")
    gt = json.loads(rec.ground_truth)
    assert gt["task"] == "basic_arithmetic" and gt["config"]["seed"] == 7 and gt["answer_tag"] is None
    assert str(eval(gt["metadata"]["expression"])) == gt["answer"]  # the entry's answer is the expression's value
    assert stream.state_dict() == {"cursor": 4, "scope": "job"}


def test_the_scorer_gives_1_for_the_answer_and_0_for_a_wrong_one(tok_dir):
    _, stream, _, _ = build_data(data(tok_dir), seed=7, model_path=None, val_every=0, val_prompts=0)
    for rec in stream.take(3):
        answer = json.loads(rec.ground_truth)["answer"]
        right = compute_score_for_source(f" {answer} ", rec.ground_truth, data_source=rec.data_source)
        wrong = compute_score_for_source(str(int(answer) + 1), rec.ground_truth, data_source=rec.data_source)
        assert (right.score, right.correct, right.extracted) == (1.0, True, answer)  # reasoning-gym's 1
        assert (wrong.score, wrong.correct) == (-1.0, False)  # reasoning-gym's 0


def test_answer_tags_and_system_prompt(tok_dir):
    d = data(tok_dir, system_prompt="direct", answer_tag="answer")
    rec = build_data(d, seed=7, model_path=None, val_every=0, val_prompts=0)[1].take(1)[0]
    assert [m.role for m in rec.messages] == ["system", "user"] and "<answer>" in rec.messages[0].content
    answer = json.loads(rec.ground_truth)["answer"]
    assert score_reasoning_gym(f"so <answer>0</answer> no: <answer> {answer}</answer>", rec.ground_truth).correct
    untagged = score_reasoning_gym(answer, rec.ground_truth)
    assert (untagged.score, untagged.extracted) == (-1.0, None)
    assert score_reasoning_gym("1", "not json").status == "bad_ground_truth"
    own = build_data(data(tok_dir, system_prompt="Reply with the number only."), seed=7, model_path=None,
                     val_every=0, val_prompts=0)[1].take(1)[0]
    assert own.messages[0].content == "Reply with the number only."
    with pytest.raises(ValueError, match=r"^data.options.system_prompt: unknown reasoning-gym system prompt 'dircet'"):
        data(tok_dir, system_prompt="dircet")


def test_bad_task_or_option_is_one_line():
    for options, start in [({"task": "basic_arithmetc"}, "data.options.task: unknown reasoning-gym task "
                                                         "'basic_arithmetc'; valid names: ['ab', "),
                           ({"task": "basic_arithmetic", "task_options": {"min_terms": 0}},
                            "data.options.task_options: reasoning-gym task 'basic_arithmetic' refuses"),
                           ({"task": "basic_arithmetic", "task_options": {"seed": 1}},
                            "data.options.task_options must not set ['seed']"),
                           ({"task": "basic_arithmetic", "tokenizer": "bpe"},
                            "data.options.tokenizer must be 'model' or 'synthetic', got 'bpe'"),
                           ({"task": "basic_arithmetic", "tokenizer": "synthetic"},  # data.tokenizer_vocab_size 64
                            "data.tokenizer_vocab_size must be >= 300 with data.options.tokenizer: synthetic")]:
        with pytest.raises(ValueError) as err:
            DataConfig(source="reasoning_gym", options=options)
        assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


def test_a_prompt_over_max_prompt_len_is_one_line(tok_dir):
    d = DataConfig(source="reasoning_gym", tokenizer_path=tok_dir, max_prompt_len=5, options=OPTIONS)
    with pytest.raises(ValueError, match=r"^data.max_prompt_len=5: prompt reasoning_gym:basic_arithmetic:7:0 is "):
        build_data(d, seed=7, model_path=None, val_every=0, val_prompts=0)[1].take(1)
