"""The synthetic arithmetic task and its sentencepiece tokenizer."""
import dataclasses
import time

import pytest

from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
from megatron_credit.data.tokenizer import ArithTokenizer, ArithTokenizerConfig, load_arith_tokenizer
from megatron_credit.rewards.math import compute_score_for_source


def _eval_left_to_right(text):
    tokens, num, ops = [], "", []
    for ch in text.rstrip("="):
        if ch.isdigit():
            num += ch
        else:
            tokens.append(int(num)), ops.append(ch)
            num = ""
    tokens.append(int(num))
    value = tokens[0]
    for op, x in zip(ops, tokens[1:]):
        value = {"+": value + x, "-": value - x, "*": value * x}[op]
    return value


@pytest.mark.parametrize(
    "cfg",
    [ArithConfig(), ArithConfig(seed=3, num_operands=4, max_operand=20, ops=("+", "-", "*")),
     ArithConfig(seed=1, ops=("-",), allow_negative=True, min_operand=2, max_operand=5)],
)
def test_problems_are_correct_and_deterministic(cfg):
    task = ArithmeticTask(cfg)
    problems = [task.problem(i) for i in range(300)]
    assert problems == [ArithmeticTask(cfg).problem(i) for i in range(300)]
    for p in problems:
        assert p.question.endswith("=")
        value = _eval_left_to_right(p.question)
        assert str(value) == p.answer
        assert cfg.allow_negative or value >= 0
        operands = [int(x) for x in p.question[:-1].replace("-", "+").replace("*", "+").split("+")]
        assert len(operands) == cfg.num_operands
        assert all(cfg.min_operand <= x <= cfg.max_operand for x in operands)
    assert len({p.question for p in problems}) >= 16  # not a constant stream
    other = ArithmeticTask(dataclasses.replace(cfg, seed=cfg.seed + 100))
    assert [other.problem(i) for i in range(50)] != problems[:50]
    if cfg.allow_negative:
        assert any(int(p.answer) < 0 for p in problems)


def test_records_are_scored_by_their_verifier():
    task = ArithmeticTask(ArithConfig(seed=5))
    for rec in task.records(10, 20):
        assert rec.data_source == "synthetic_arith"
        assert rec.uid == f"synthetic_arith:5:{rec.extra_info['index']}"
        gt, source = rec.ground_truth, rec.data_source
        right = compute_score_for_source(f" {gt}", gt, data_source=source)
        wrong = compute_score_for_source(f" {int(gt) + 1}", gt, data_source=source)
        assert right.correct and right.score == 1.0 and not wrong.correct and wrong.score == -1.0
    with pytest.raises(ValueError, match="ops"):
        ArithConfig(ops=("/",))
    with pytest.raises(ValueError, match="num_operands"):
        ArithConfig(num_operands=1)


def test_tokenizer_trains_fast_caches_and_is_deterministic(tmp_path):
    cfg = ArithTokenizerConfig(cache_dir=str(tmp_path / "a"), seed=7)
    t0 = time.perf_counter()
    tok = load_arith_tokenizer(cfg)
    assert time.perf_counter() - t0 < 5.0
    files = list((tmp_path / "a").iterdir())
    assert len(files) == 1 and files[0].suffix == ".model"
    mtime = files[0].stat().st_mtime_ns
    again = load_arith_tokenizer(cfg)  # from the cache, not retrained
    assert files[0].stat().st_mtime_ns == mtime and again.model_path == tok.model_path
    # Same settings in another directory: byte-identical model.
    other = load_arith_tokenizer(ArithTokenizerConfig(cache_dir=str(tmp_path / "b"), seed=7))
    assert open(other.model_path, "rb").read() == open(tok.model_path, "rb").read()
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert 40 <= tok.vocab_size <= cfg.vocab_size
    # A different vocabulary size is a different cache entry.
    load_arith_tokenizer(ArithTokenizerConfig(cache_dir=str(tmp_path / "a"), seed=7, vocab_size=48))
    assert len(list((tmp_path / "a").iterdir())) == 2


def test_tokenizer_digits_template_and_round_trip(tmp_path):
    tok = load_arith_tokenizer(ArithTokenizerConfig(cache_dir=str(tmp_path)))
    digit_ids = {d: tok.encode(d) for d in "0123456789"}
    assert all(len(ids) == 1 for ids in digit_ids.values())
    assert tok.encode("907") == digit_ids["9"] + digit_ids["0"] + digit_ids["7"]  # split_digits
    task = ArithmeticTask(ArithConfig(num_operands=3, ops=("+", "-", "*"), max_operand=99))
    for rec in task.records(0, 50):
        text = tok.apply_chat_template(rec.chat(), tokenize=False, add_generation_prompt=True)
        assert text == f"<|user|>{rec.messages[0].content}<|assistant|>Answer:"
        ids = tok.apply_chat_template(rec.chat(), tokenize=True)
        assert ids == tok.encode(text) and tok.unk_id not in ids
        assert tok.decode(ids) == text
        answer = f" {rec.ground_truth}"
        assert tok.decode(tok.encode(answer) + [tok.eos_id, tok.pad_id]) == answer
    assert tok.encode("x", add_special_tokens=True)[0] == tok.bos_id
    turn = [{"role": "user", "content": "1+1="}]
    assert tok.apply_chat_template(turn, add_generation_prompt=False) == "<|user|>1+1="
    # Role markers are single tokens; ids past the vocabulary decode as <unk> instead of raising.
    assert len(tok.encode("<|assistant|>")) == 1
    assert tok.decode([tok.vocab_size + 5]) == tok.decode([tok.unk_id])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="vocab_size"):
        ArithTokenizerConfig(vocab_size=16)
    assert isinstance(tok, ArithTokenizer) and len(tok) == tok.vocab_size


def test_byte_fallback_tokenizer_encodes_anything(tmp_path):
    cfg = ArithTokenizerConfig(cache_dir=str(tmp_path), vocab_size=320, byte_fallback=True)
    tok = load_arith_tokenizer(cfg)
    text = "héllo, wörld: 12+3"
    ids = tok.encode(text)
    assert tok.unk_id not in ids and tok.decode(ids) == text


def test_infeasible_config_is_rejected_not_a_hang():
    with pytest.raises(ValueError, match="infeasible.*min_operand=1.*max_operand=1"):
        ArithConfig(num_operands=3, min_operand=1, max_operand=1, ops=("-",))
    # Feasible "-"-only configs still work (5 - 2 - 2 >= 0 can be drawn).
    p = ArithmeticTask(ArithConfig(num_operands=3, min_operand=2, max_operand=5, ops=("-",))).problem(0)
    assert int(p.answer) >= 0
    ArithConfig(num_operands=3, min_operand=1, max_operand=1, ops=("-",), allow_negative=True)


def test_nearly_infeasible_config_gives_up_with_a_value_error(monkeypatch):
    from megatron_credit.data import synthetic

    monkeypatch.setattr(synthetic, "_MAX_DRAWS", 3)
    # Feasible only if the first operand is 9 and the rest 0: p = 10^-4 per draw.
    task = ArithmeticTask(ArithConfig(num_operands=5, min_operand=0, max_operand=9, ops=("-",)))
    with pytest.raises(ValueError, match="num_operands=5.*ops=\\('-',\\)"):
        [task.problem(i) for i in range(20)]


def test_majority_answer_rate_is_the_trivial_policys_reward():
    from megatron_credit.data.synthetic import majority_answer_rate

    # Two uniform operands in [0, m]: the most frequent sum, m, has m + 1 of (m + 1)^2 pairs.
    for m in (4, 9):
        assert majority_answer_rate(ArithConfig(max_operand=m)) == pytest.approx(1 / (m + 1), abs=0.01)
