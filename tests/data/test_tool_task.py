"""The calculator task's data: the tokenizer's tool markers and template, the task, build_data, the verifier."""
import dataclasses
import re
import tempfile

import pytest

from megatron_credit.data.synthetic import ArithConfig
from megatron_credit.data.tokenizer import (
    ArithTokenizerConfig, _cache_key, _training_corpus, load_arith_tokenizer,
)
from megatron_credit.data.tool_task import TOOL_MARKERS, ToolTask, tool_trace
from megatron_credit.rewards.arith import score_arith

MUL = ArithConfig(ops=("*",), min_operand=10, max_operand=99)
# The default tokenizer's cache key under sentencepiece 0.2.3, and the ids of its generation prompt for
# "37*48=" on the versions whose bytes tests/data/test_tokenizer.py pins.
DEFAULT_KEY_SPM_023 = "6ff310c1fb33b724"
DEFAULT_PROMPT_IDS = [5, 28, 32, 37, 31, 30, 19, 6, 11, 18]


@pytest.fixture(scope="module")
def tool_tok():
    return load_arith_tokenizer(ArithTokenizerConfig(task=MUL, extra_symbols=TOOL_MARKERS, answer_prefix=False,
                                                     cache_dir=tempfile.mkdtemp()))


def test_the_default_tokenizer_keeps_its_file_name_and_ids(monkeypatch):
    import sentencepiece as spm

    version = spm.__version__
    monkeypatch.setattr(spm, "__version__", "0.2.3")  # the key names the version; pin the one we know
    assert _cache_key(ArithTokenizerConfig()) == DEFAULT_KEY_SPM_023
    assert _cache_key(ArithTokenizerConfig(answer_prefix=False)) == DEFAULT_KEY_SPM_023  # template only
    assert _cache_key(ArithTokenizerConfig(extra_symbols=TOOL_MARKERS)) != DEFAULT_KEY_SPM_023
    monkeypatch.setattr(spm, "__version__", version)
    tok = load_arith_tokenizer(ArithTokenizerConfig(cache_dir=tempfile.mkdtemp()))
    assert tok.model_path.endswith(f"arith_bpe_64_{_cache_key(ArithTokenizerConfig())}.model")
    text = tok.apply_chat_template([{"role": "user", "content": "37*48="}], tokenize=False)
    assert text == "<|user|>37*48=<|assistant|>Answer:" and tok.answer_prefix
    if version in ("0.2.2", "0.2.3"):
        assert tok.encode(text) == DEFAULT_PROMPT_IDS


def test_tool_markers_are_one_id_each_and_decode_back(tool_tok):
    ids = [tool_tok.encode(m) for m in TOOL_MARKERS]
    assert all(len(i) == 1 and i[0] != tool_tok.unk_id for i in ids) and len({i[0] for i in ids}) == 4
    for text in ("<call>37*48</call>", "<result>1776</result>", "<call>37*48</call><result>1776</result>Answer:1776"):
        enc = tool_tok.encode(text)
        assert tool_tok.unk_id not in enc and tool_tok.decode(enc) == text
    call = tool_tok.encode("<call>37*48</call>")
    assert call[0] == ids[0][0] and call[-1] == ids[1][0]  # the turn ends on the </call> token
    assert call[1:-1] == tool_tok.encode("37*48")


def test_the_tool_template_has_no_answer_prefix(tool_tok):
    messages = [{"role": "user", "content": "37*48="}]
    assert tool_tok.answer_prefix is False
    assert tool_tok.apply_chat_template(messages, tokenize=False) == "<|user|>37*48=<|assistant|>"
    assert tool_tok.apply_chat_template(messages, tokenize=True) == tool_tok.encode("<|user|>37*48=<|assistant|>")
    assert tool_tok.apply_chat_template(messages, add_generation_prompt=False) == "<|user|>37*48="


def test_the_corpus_holds_calculator_traces():
    cfg = ArithTokenizerConfig(task=MUL, extra_symbols=TOOL_MARKERS, num_train_problems=50)
    corpus, plain = _training_corpus(cfg), _training_corpus(ArithTokenizerConfig(task=MUL, num_train_problems=50))
    assert corpus[:50] == plain[:50]
    q, a = re.match(r"<\|user\|>(\S+=)<\|assistant\|>Answer: (\d+)$", plain[0]).groups()
    assert corpus[50] == f"<|user|>{q}<|assistant|><call>{q[:-1]}</call><result>{a}</result>Answer:{a}"


@pytest.mark.parametrize("symbols", [("<call>",), ("<call>", "</call>", "<result>", "<call>"),
                                     ("<call>", "</call>", "<re sult>", "</result>"),
                                     ("<call>", "</call>", "", "</result>"),
                                     ("<|user|>", "</call>", "<result>", "</result>")])
def test_bad_extra_symbols_are_refused(symbols):
    with pytest.raises(ValueError, match="^extra_symbols must be"):
        ArithTokenizerConfig(extra_symbols=symbols)


def test_tool_task_records_are_multiplications_with_their_traces():
    task = ToolTask(MUL)
    for i in range(20):
        rec, p = task.record(i), task.problem(i)
        x, y = map(int, rec.messages[0].content[:-1].split("*"))
        assert rec.ground_truth == str(x * y) and rec.data_source == "synthetic_arith"
        assert tool_trace(p.question, p.answer) == (f"<call>{x}*{y}</call>", f"<result>{x * y}</result>",
                                                    f"Answer:{x * y}")


def test_build_data_gives_multiplication_prompts(monkeypatch, tmp_path):
    from megatron_credit.recipe.sections import DataConfig
    from megatron_credit.data.setup import build_data

    monkeypatch.setenv("HOME", str(tmp_path))  # the tokenizer cache
    d = DataConfig(source="synthetic_tool", min_operand=10, max_operand=99, tokenizer_vocab_size=64)
    tok, stream, val, task = build_data(d, seed=3, model_path=None, val_every=1, val_prompts=6)
    assert isinstance(task, ToolTask) and task.config.ops == ("*",) and task.config.seed == 3
    assert tok.answer_prefix is False and all(len(tok.encode(m)) == 1 for m in TOOL_MARKERS)
    train = stream.take(6)
    for rec in train + val:
        m = re.fullmatch(r"(\d+)\*(\d+)=", rec.messages[0].content)
        assert m and all(10 <= int(v) <= 99 for v in m.groups())
        assert rec.ground_truth == str(int(m[1]) * int(m[2])) and rec.data_source == "synthetic_arith"
        assert list(rec.prompt_ids) == tok.encode(f"<|user|>{rec.messages[0].content}<|assistant|>")
    assert [r.messages for r in val] == [ToolTask(dataclasses.replace(MUL, seed=4)).record(i).messages
                                         for i in range(6)]
    assert [r.messages for r in train] != [r.messages for r in val]
    assert build_data(d, seed=3, model_path=None, val_every=0, val_prompts=6)[2] is None


def test_the_verifier_scores_the_last_turn(tool_tok):
    eos = tool_tok.eos_token_id
    last_turn = tool_tok.decode(tool_tok.encode("Answer:1776") + [eos])
    assert last_turn == "Answer:1776"
    assert score_arith(last_turn, "1776").correct and not score_arith("Answer:1777", "1776").correct
    call = score_arith(tool_tok.decode(tool_tok.encode("<call>37*48</call>")), "1776")
    assert not call.correct and call.extracted is None and call.score == -1.0
    assert not score_arith("<result>1776</result>", "1776").correct  # the observation earns nothing
