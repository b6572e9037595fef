"""The warm-up on the calculator task: rows tokenized as the multi-turn rollout does, the loss on the
model's tokens only, and a cache key that tool_prob = 0 leaves as it was."""
import dataclasses
import random
import tempfile

import pytest
import torch

from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer
from megatron_credit.data.tool_task import TOOL_MARKERS, ToolTask
from megatron_credit.recipe.config import TINY_QWEN2, recipe_from_dict
from megatron_credit.recipe.sections import WarmupConfig
from megatron_credit.trainer.warmup import supervised_batch, warmup_cache_path

MUL = ArithConfig(ops=("*",), min_operand=10, max_operand=99)


@pytest.fixture(scope="module")
def tok():
    return load_arith_tokenizer(ArithTokenizerConfig(task=MUL, extra_symbols=TOOL_MARKERS, answer_prefix=False,
                                                     cache_dir=tempfile.mkdtemp()))


def _prompt(tok, rec):
    return tok.apply_chat_template(rec.chat(), tokenize=True, add_generation_prompt=True)


def _check_row(batch, b, want_ids, trained_positions):
    """Row b holds want_ids then padding; its loss mask (label space) is on exactly trained_positions."""
    n = len(want_ids)
    assert batch.input_ids[b, :n].tolist() == want_ids and int(batch.seq_lens[b]) == n
    assert (batch.input_ids[b, n:] == 0).all()
    want_mask = torch.zeros(batch.input_ids.shape[1], dtype=torch.bool)
    want_mask[[t - 1 for t in trained_positions]] = True  # position t - 1 scores token t
    assert torch.equal(batch.loss_mask[b], want_mask)


def test_tool_traces_train_the_model_turns_and_not_the_observation(tok):
    task = ToolTask(MUL)
    batch = supervised_batch(task, tok, range(6), tool_prob=1.0, seed=0)
    for b in range(6):
        rec, p = task.record(b), task.problem(b)
        prompt = _prompt(tok, rec)
        call = tok.encode(f"<call>{p.question[:-1]}</call>")
        obs = tok.encode(f"<result>{p.answer}</result>")
        answer = tok.encode(f"Answer:{p.answer}") + [tok.eos_token_id]
        ids = prompt + call + obs + answer  # the pieces encoded separately, as the rollout appends them
        start = len(prompt)
        trained = list(range(start, start + len(call))) + list(range(start + len(call) + len(obs), len(ids)))
        _check_row(batch, b, ids, trained)
        masked = batch.labels[b][batch.loss_mask[b]].tolist()
        assert tok.decode(masked) == f"<call>{p.question[:-1]}</call>Answer:{p.answer}"
        assert masked[len(call) - 1] == tok.encode("</call>")[0]  # turn 1 is trained through </call>
        observed = batch.labels[b, start + len(call) - 1: start + len(call) + len(obs) - 1]
        assert tok.decode(observed.tolist()) == f"<result>{p.answer}</result>"
        assert not batch.loss_mask[b, start + len(call) - 1: start + len(call) + len(obs) - 1].any()
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])


def test_tool_prob_zero_answers_at_once(tok):
    task = ToolTask(MUL)
    batch = supervised_batch(task, tok, range(8), tool_prob=0.0, seed=1)
    call_id = tok.encode("<call>")[0]
    assert not (batch.input_ids == call_id).any()
    for b in range(8):
        rec = task.record(b)
        prompt = _prompt(tok, rec)
        ids = prompt + tok.encode(f"Answer:{rec.ground_truth}") + [tok.eos_token_id]
        _check_row(batch, b, ids, range(len(prompt), len(ids)))


def test_tool_prob_mixes_the_two_forms_by_the_seed(tok):
    task = ToolTask(MUL)
    call_id = tok.encode("<call>")[0]
    batch = supervised_batch(task, tok, range(200), tool_prob=0.3, seed=7)
    calls = (batch.input_ids == call_id).any(dim=1)
    rng = random.Random(7)
    assert calls.tolist() == [rng.random() < 0.3 for _ in range(200)]  # one draw per trace
    assert 0.2 < calls.float().mean() < 0.4
    again = supervised_batch(task, tok, range(200), tool_prob=0.3, seed=7)
    assert torch.equal(batch.input_ids, again.input_ids) and torch.equal(batch.loss_mask, again.loss_mask)


def test_arithmetic_rows_are_prompt_answer_eos():
    # The synthetic_arith rows as they were before multi-piece responses: one encoded " answer", then </s>.
    tok = load_arith_tokenizer(ArithTokenizerConfig(cache_dir=tempfile.mkdtemp()))
    task = ArithmeticTask(ArithConfig(max_operand=60))
    batch = supervised_batch(task, tok, range(10), tool_prob=1.0, seed=2)  # tool_prob: the tool task only
    for b in range(10):
        rec = task.record(b)
        prompt = _prompt(tok, rec)
        ids = prompt + tok.encode(" " + rec.ground_truth) + [tok.eos_token_id]
        _check_row(batch, b, ids, range(len(prompt), len(ids)))


def test_tool_prob_zero_keeps_the_cache_key():
    recipe = recipe_from_dict({"model": {"architecture": dict(TINY_QWEN2)}, "warmup": {"steps": 3}})
    # WarmupConfig as it is without the tool_prob field: an existing recipe's key.
    without = dataclasses.make_dataclass(
        "WarmupConfig", [(f.name, f.type, dataclasses.field(default=f.default))
                         for f in dataclasses.fields(WarmupConfig) if f.name != "tool_prob"],
        frozen=True, kw_only=True)
    kw = dict(model=recipe.model, parallel=recipe.parallel, data=recipe.data, seed=0, rank=0)
    path = warmup_cache_path(recipe.warmup, **kw)
    assert path == warmup_cache_path(without(steps=3), **kw)
    assert warmup_cache_path(dataclasses.replace(recipe.warmup, tool_prob=0.5), **kw) != path
