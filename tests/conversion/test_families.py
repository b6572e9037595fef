"""Each model family is one ``families/<family>.py`` holding its facts; nothing else asks which family a
config is. Mistral's ``sliding_window`` and the Gemma families are refused in one line naming the field;
the planner's parameter count of every family equals the ``transformers`` model's.

The logit parity and bit-identical round trips of Mistral run with the other families in
``test_parity.py`` (``tests/support/parity.FAMILIES``) and ``test_maps.py``.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_credit.conversion import FAMILIES, family_for_config
from megatron_credit.conversion.testing import tiny_hf_config
from megatron_credit.families import REFUSED_MODEL_TYPES, family_of, supported_model_types

REPO = Path(__file__).resolve().parents[2]


def test_each_family_is_one_registry_entry_keyed_by_its_model_type():
    assert sorted(FAMILIES) == ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
    assert supported_model_types() == ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe")
    for name in FAMILIES:
        fam = FAMILIES.get(name)
        assert family_of(name) is fam and fam.name == name and len(fam.architectures) == 1
        cfg = tiny_hf_config(name)
        assert cfg.model_type == name and cfg.architectures == [fam.architectures[0]]
        assert family_for_config(cfg) is fam


def test_each_family_is_declared_in_its_own_file():
    import sys

    for name in FAMILIES:
        module = sys.modules[f"megatron_credit.families.{name}"]
        assert any(v is FAMILIES.get(name) for v in vars(module).values()), name


def test_no_model_type_branch_outside_the_family_files():
    """A family's facts live in its own file: no ``model_type == "qwen2"`` (or ``in (...)``) elsewhere."""
    branch = re.compile(r"""model_type\s*(==|!=)\s*["']|model_type\s+(not\s+)?in\s*[(\[{]\s*["']""")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "megatron_credit").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert hits == []


def test_tiny_config_of_an_unknown_family_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"^unknown family 'gpt2'; valid: \['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe'\]$"):
        tiny_hf_config("gpt2")


# --- Mistral's sliding window ----------------------------------------------------------------------
def _sliding_msg(window, max_pos):
    return (f"hf_config.sliding_window={window} is not supported: the megatron actor uses full causal attention, "
            f"so sliding_window must be null or >= max_position_embeddings={max_pos}")


@pytest.mark.parametrize("window,max_pos", [(255, 256), (1, 256), (4096, 32768)])  # the last: Mistral 7B v0.1
def test_mistral_sliding_window_shorter_than_the_positions_is_refused(window, max_pos):
    from megatron_credit.models import check_parallel_fits_model, transformer_config_from_hf
    from megatron_credit.recipe.config import ParallelConfig

    cfg = tiny_hf_config("mistral", sliding_window=window, max_position_embeddings=max_pos)
    for check in (lambda: family_for_config(cfg), lambda: check_parallel_fits_model(cfg, ParallelConfig()),
                  lambda: transformer_config_from_hf(cfg, parallel=ParallelConfig())):
        with pytest.raises(ValueError, match="^" + re.escape(_sliding_msg(window, max_pos)) + "$"):
            check()
    inline = SimpleNamespace(model_type="mistral", sliding_window=window, max_position_embeddings=max_pos)
    with pytest.raises(ValueError, match="^" + re.escape(_sliding_msg(window, max_pos)) + "$"):
        family_for_config(inline)  # a recipe's inline architecture names no class


@pytest.mark.parametrize("window", [None, 256, 10**6])
def test_mistral_window_covering_every_position_is_full_attention_and_accepted(window):
    """HF lets query q see key k when q - k < sliding_window; positions stop below max_position_embeddings
    (``check_sequence_length``), so a window >= max_position_embeddings never hides a key."""
    from megatron_credit.models import transformer_config_from_hf
    from megatron_credit.recipe.config import ParallelConfig

    cfg = tiny_hf_config("mistral", sliding_window=window, max_position_embeddings=256)
    assert family_for_config(cfg) is FAMILIES.get("mistral")
    tc = transformer_config_from_hf(cfg, parallel=ParallelConfig())
    assert tc.kv_channels == 32 and not tc.add_qkv_bias and not tc.add_bias_linear and not tc.qk_layernorm


def test_converter_refuses_a_sliding_window_in_one_line_before_writing(tmp_path, capsys):
    """In process: the refusal comes before any weight is read or any process group is started."""
    from tools import convert_hf_to_megatron

    src, out = tmp_path / "mistral_v01", tmp_path / "out"
    src.mkdir()
    tiny_hf_config("mistral", sliding_window=128).to_json_file(str(src / "config.json"))
    assert convert_hf_to_megatron.main(["--hf-dir", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: " + _sliding_msg(128, 256)]
    assert not out.exists()


# --- Gemma ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(REFUSED_MODEL_TYPES))
def test_gemma_is_refused_with_the_missing_megatron_feature(model_type):
    from transformers import AutoConfig

    from megatron_credit.models import check_parallel_fits_model
    from megatron_credit.models.arch_keys import check_architecture_keys
    from megatron_credit.recipe.config import ParallelConfig

    cfg = AutoConfig.for_model(model_type)
    want = f"hf_config.model_type={model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}"
    for check in (lambda: family_for_config(cfg), lambda: check_parallel_fits_model(cfg, ParallelConfig())):
        with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
            check()
    assert "\n" not in want and "which the megatron layer specs here do not have" in want
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
        check_architecture_keys({"model_type": model_type})


# --- the planner's parameter count -----------------------------------------------------------------
@pytest.mark.parametrize("family,kw", [("qwen2", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True}),
                                       ("mistral", {}), ("mistral", {"tie_word_embeddings": True}), ("qwen3_moe", {})])
def test_planner_parameter_count_equals_the_transformers_model(family, kw):
    from transformers import AutoModelForCausalLM

    from megatron_credit.planning.plan import Architecture, total_param_count

    cfg = tiny_hf_config(family, **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert total_param_count(Architecture.from_hf(cfg)) == sum(p.numel() for p in model.parameters())


def test_the_old_tp_layout_name_warns_and_is_tp_split():
    """``TPLayout`` (a family plugin's import) still resolves, for one release, to :class:`TPSplit`, from
    the module and from the package, with a warning naming the new name."""
    from megatron_credit import families
    from megatron_credit.families import TPSplit, base

    for module in (base, families):
        with pytest.warns(DeprecationWarning, match="^megatron_credit.families.base.TPLayout is now TPSplit;"):
            old = module.TPLayout
        assert old is TPSplit and old.GATED_ROWS.value == "gated_rows"
    with pytest.warns(DeprecationWarning, match="TPLayout is now TPSplit"):
        from megatron_credit.families.base import TPLayout
    assert TPLayout is TPSplit
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        base.NO_SUCH_NAME
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        families.NO_SUCH_NAME
