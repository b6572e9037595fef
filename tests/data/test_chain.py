"""The chain task (``data/chain.py``), its verifier and its warm-up labels, against loop references."""
import random
import tempfile

import pytest
import torch

from megatron_credit.data.chain import ChainConfig, ChainTask, first_wrong_step
from megatron_credit.rewards.math import compute_score_for_source
from megatron_credit.recipe.config import recipe_from_dict
from megatron_credit.recipe.sections import DataConfig


def _sums_loop(question):
    total, out = 0, []
    for term in question.rstrip("=").split("+"):
        total += int(term)
        out.append(total)
    return out


@pytest.mark.parametrize("cfg", [ChainConfig(), ChainConfig(seed=4, num_operands=3, min_operand=2, max_operand=5),
                                 ChainConfig(seed=9, num_operands=11, decisive="late")])
def test_problems_are_correct_and_deterministic(cfg):
    task = ChainTask(cfg)
    problems = [task.problem(i) for i in range(300)]
    assert problems == [ChainTask(cfg).problem(i) for i in range(300)]
    for p in problems:
        sums = _sums_loop(p.question)
        assert list(p.sums) == sums and p.answer == str(sums[-1]) and len(sums) == cfg.num_operands
        assert all(cfg.min_operand <= x <= cfg.max_operand for x in p.operands)
        assert task.response_text(p.sums) == "".join(" " + str(s) for s in sums)
        assert len(task.response_text(p.sums)) + 1 <= cfg.max_response_tokens()  # one token per char + stop
    possible = (cfg.max_operand - cfg.min_operand + 1) ** cfg.num_operands
    assert len({p.question for p in problems}) > min(250, 0.9 * possible)  # covers the space
    assert ChainTask(ChainConfig(seed=cfg.seed + 1, num_operands=cfg.num_operands)).problem(0) != problems[0]


def test_warmup_labels_slip_once_in_the_decisive_window():
    for decisive, window in (("any", range(1, 7)), ("early", range(1, 4)), ("late", range(4, 7))):
        task = ChainTask(ChainConfig(seed=2, decisive=decisive))
        rng, slipped, where = random.Random(0), 0, set()
        for i in range(2000):
            p = task.problem(i)
            text = task.warmup_response(i, rng, slip_prob=0.3)
            written = [int(x) for x in text.split()]
            step = first_wrong_step(text, p.sums)
            if step is None:
                assert written == list(p.sums)
                continue
            slipped += 1
            where.add(step)
            delta = written[step - 1] - p.sums[step - 1]
            assert abs(delta) == 1  # off by one, and every later sum follows the slipped value
            assert written == [s + delta if k >= step else s for k, s in enumerate(p.sums, start=1)]
        assert where == set(window)
        assert abs(slipped / 2000 - 0.3) < 4 * (0.3 * 0.7 / 2000) ** 0.5


def test_verifier_scores_only_the_last_number():
    task = ChainTask(ChainConfig(seed=1, num_operands=5))
    rng = random.Random(1)
    for rec in task.records(0, 100):
        gt, sums = rec.ground_truth, rec.extra_info["sums"]
        assert rec.data_source == "synthetic_chain" and gt == str(sums[-1])
        for response in (task.response_text(sums), task.response_text(sums[:-1]),
                         task.response_text([s + rng.choice((-1, 1)) for s in sums[:-1]] + sums[-1:]),
                         task.response_text(sums) + " 7", "", " x"):
            numbers = [w for w in response.split() if w.lstrip("-").isdigit()]
            want = bool(numbers) and int(numbers[-1]) == int(gt)  # loop reference
            got = compute_score_for_source(response, gt, data_source="synthetic_chain")
            assert got.correct == want and got.score == (1.0 if want else -1.0)


def test_supervised_batch_teaches_the_chain_labels():
    from megatron_credit.data.synthetic import ArithConfig
    from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer
    from megatron_credit.trainer.warmup import supervised_batch

    task = ChainTask(ChainConfig(seed=0, num_operands=4))
    tok = load_arith_tokenizer(ArithTokenizerConfig(task=ArithConfig(num_operands=4), cache_dir=tempfile.mkdtemp()))
    batch = supervised_batch(task, tok, range(8), slip_prob=0.5, seed=3)
    rng = random.Random(3)
    for b, i in enumerate(range(8)):
        want = task.warmup_response(i, rng, slip_prob=0.5)
        labels = batch.labels[b][batch.loss_mask[b]].tolist()
        assert labels[-1] == tok.eos_token_id and tok.decode(labels[:-1]) == want
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])


def test_config_fields_are_checked():
    assert DataConfig(source="synthetic_chain", num_operands=6, decisive="early").decisive == "early"
    with pytest.raises(ValueError, match="data.decisive"):
        DataConfig(source="synthetic_chain", decisive="middle")
    with pytest.raises(ValueError, match="data.max_operand"):
        DataConfig(source="synthetic_chain", max_operand=12)
    with pytest.raises(ValueError, match="train.max_wall_s"):  # a field's range: checked when the recipe loads
        recipe_from_dict({"train": {"max_wall_s": 0}})
    with pytest.raises(ValueError, match="slip_prob"):
        recipe_from_dict({"warmup": {"slip_prob": 1.5}})
