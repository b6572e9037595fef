"""``data.source`` is a registry: a plug-in task source is one file, a bad name or option one line."""
from __future__ import annotations

import textwrap

import pytest

from megatron_credit.data.sources import PROMPT_SOURCES
from megatron_credit.recipe.sections import DataConfig

PLUGIN = '''
from dataclasses import dataclass

from megatron_credit.data.prompts import SyntheticPrompts
from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.data.sources import PROMPT_SOURCES, PromptData, PromptSource


class Tok:
    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        return [ord(c) for c in messages[0]["content"]]


class Echo:
    def __init__(self, word):
        self.word = word

    def record(self, i):
        return PromptRecord(uid=f"echo:{i}", data_source="synthetic_arith", ground_truth=str(i),
                            messages=(ChatMessage(role="user", content=f"{self.word}{i}"),))


@PROMPT_SOURCES.register("echo_test_source")
class EchoSource(PromptSource):
    @dataclass(frozen=True, kw_only=True)
    class Config(PromptSource.Config):
        word: str = "n"

    def build(self, *, seed, model_path, val_every, val_prompts, log):
        task = Echo(self.config.word)
        return PromptData(Tok(), SyntheticPrompts(task, Tok()), None, None)
'''


@pytest.fixture
def echo_source(tmp_path):
    from megatron_credit.plugins import load_plugin

    path = tmp_path / "echo_source.py"
    path.write_text(PLUGIN)
    load_plugin(str(path))
    yield
    PROMPT_SOURCES.remove("echo_test_source")


def test_a_plugin_source_is_one_file(echo_source):
    from megatron_credit.data.setup import build_data

    d = DataConfig(source="echo_test_source", options={"word": "w"})
    tok, stream, val, task = build_data(d, seed=0, model_path=None, val_every=1, val_prompts=2)
    recs = stream.take(2)
    assert [r.messages[0].content for r in recs] == ["w0", "w1"]
    assert [r.prompt_ids for r in recs] == [(119, 48), (119, 49)]
    assert val is None and task is None and stream.state_dict() == {"cursor": 2, "scope": "job"}
    with pytest.raises(ValueError) as err:
        DataConfig(source="echo_test_source", options={"word": 3})
    assert "data.options.word" in str(err.value) and "\n" not in str(err.value)


def test_bad_source_name_is_one_line_listing_valid_names():
    with pytest.raises(ValueError) as err:
        DataConfig(source="synthetic_arithm")
    msg = str(err.value)
    assert msg.startswith("data.source: unknown source 'synthetic_arithm'; valid names: ['dataset', ")
    assert "'synthetic_arith'" in msg and "'synthetic_tool'" in msg and "\n" not in msg


def test_builtin_sources_refuse_options_and_keep_their_checks():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['task'\] in data.options"):
        DataConfig(source="synthetic_arith", options={"task": "x"})
    with pytest.raises(ValueError, match="data.train_path is required with data.source: dataset"):
        DataConfig(source="dataset")
    with pytest.raises(ValueError, match="data.decisive"):
        DataConfig(source="synthetic_chain", decisive="middle")
    assert set(PROMPT_SOURCES.names()) >= {"dataset", "synthetic_arith", "synthetic_chain", "synthetic_tool"}
