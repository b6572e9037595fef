"""The synthetic task's tokenizer: the corpus it is trained on, and the model it writes."""
import hashlib
import tempfile

import pytest

from megatron_credit.data.synthetic import ArithConfig
from megatron_credit.data.tokenizer import (
    REQUIRED_CHARS, ArithTokenizerConfig, _train, _training_corpus, load_arith_tokenizer,
)

# The default model's bytes as sentencepiece 0.2.2 (the GPU machine's) and 0.2.3 (CI's) write them: the
# demo's tokens are the same on both. Another version may legitimately write other bytes.
DEFAULT_MODEL_SHA256 = "1eac20b1b628"
KNOWN_VERSIONS = ("0.2.2", "0.2.3")


@pytest.mark.parametrize("task", [ArithConfig(), ArithConfig(num_operands=4)], ids=["default", "4 operands"])
def test_the_corpus_shows_every_required_character(task):
    # sentencepiece 0.2.2 aborts the whole process on a required character with frequency 0.
    corpus = _training_corpus(ArithTokenizerConfig(task=task))
    assert set(REQUIRED_CHARS) <= set("".join(corpus))


def test_every_required_character_is_one_known_piece():
    tok = load_arith_tokenizer(ArithTokenizerConfig(cache_dir=tempfile.mkdtemp()))
    for c in REQUIRED_CHARS:
        ids = tok.encode(c)
        assert len(ids) == 1 and ids[0] != tok.unk_id, (c, ids)
        assert tok.decode(ids) == c


def test_the_default_model_is_the_same_bytes_on_known_sentencepiece_versions():
    import sentencepiece as spm

    if spm.__version__ not in KNOWN_VERSIONS:
        pytest.skip(f"sentencepiece {spm.__version__}: the pinned bytes are those of {KNOWN_VERSIONS}")
    assert hashlib.sha256(_train(ArithTokenizerConfig())).hexdigest().startswith(DEFAULT_MODEL_SHA256)
