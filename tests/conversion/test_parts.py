"""The importer in parts of layers (``conversion/parts.py``): a model larger than ``--max-part-gib`` is
built and saved a part of its layers at a time, and the merged checkpoint is the one-part conversion's,
tensor for tensor, loaded at TP = PP = 1 and at TP = 2 / PP = 2 (megatron reshards it as any other), and
exported back to the HF tensors bit for bit. No model larger than a part is ever built: the host memory
is bounded by a part (plus the embedding and the output layer, in the first and last part)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_credit.conversion import converters as C, model_io
from megatron_credit.conversion.hf_io import SafetensorsReader
from megatron_credit.conversion.parts import layer_bytes, layers_per_part
from megatron_credit.conversion.testing import tiny_hf_config
from megatron_credit.families import family_for_config
from tests.support.distributed_harness import module_pool

LAYERS = 6  # parts of 4 layers: 4 + 2 (an uneven last part; PP = 2 stages of 3 cross the parts)
pool2 = module_pool(2)


def _hf_dir(root: Path, family: str, **kw) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    src = root / f"{family}-src"
    AutoModelForCausalLM.from_config(tiny_hf_config(family, num_hidden_layers=LAYERS, vocab_size=160, **kw),
                                     dtype=torch.float32).save_pretrained(src)
    return src


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    with model_io.single_stage_parallel_state():
        model = model_io.build_model(model_io.load_hf_config(ckpt), params_dtype=torch.float32)
        model_io.load_dist_checkpoint(model, ckpt)
        return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _four_layers(src: Path) -> float:
    reader = SafetensorsReader(src)
    cfg = model_io.load_hf_config(src)
    return 4.5 * layer_bytes(reader, family_for_config(cfg), cfg, torch.float32)


@pytest.fixture(scope="module", params=[("qwen3_moe", {}), ("qwen2", {"tie_word_embeddings": True})],
                ids=["qwen3_moe", "qwen2_tied"])
def converted(request, tmp_path_factory):
    family, kw = request.param
    root = tmp_path_factory.mktemp(family)
    src = _hf_dir(root, family, **kw)
    built: list[int] = []
    from megatron_credit import models

    original = models.build_gpt_model

    def counting(hf_config, *a, **k):
        built.append(hf_config.num_hidden_layers)
        return original(hf_config, *a, **k)

    one = C.convert_hf_to_megatron(src, root / "one", progress=False)
    models.build_gpt_model = counting
    try:
        parts = C.convert_hf_to_megatron(src, root / "parts", progress=False, max_part_bytes=_four_layers(src))
    finally:
        models.build_gpt_model = original
    return src, root, one, parts, built


def test_a_large_model_is_built_and_saved_a_part_at_a_time(converted):
    _, root, one, parts, built = converted
    assert (one["import_parts"], one["layers_per_part"]) == (1, LAYERS)
    assert (parts["import_parts"], parts["layers_per_part"]) == (2, 4)
    assert built == [4, 2]  # never the whole model
    assert sorted(p.name for p in (root / "parts" / "model").iterdir() if p.suffix == ".distcp") == \
        ["__0_0.distcp", "__1_0.distcp"]
    assert not any(p.name.startswith(".") and p.is_dir() for p in (root / "parts").iterdir())  # no staging left


def test_the_merged_checkpoint_holds_the_one_part_conversions_tensors(converted):
    _, root, _, _, _ = converted
    one, parts = _state(root / "one"), _state(root / "parts")
    assert set(one) == set(parts)
    for k in one:
        assert torch.equal(one[k], parts[k]), k


def test_it_exports_back_to_the_hf_tensors_bit_for_bit(converted):
    src, root, _, _, _ = converted
    C.convert_megatron_to_hf(root / "parts", root / "back", progress=False)
    a, b = SafetensorsReader(src), SafetensorsReader(root / "back")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k


def test_part_sizes():
    assert layers_per_part(94, 5 << 30, 16 * 2**30) == 3  # Qwen3-235B-A22B's ~5 GiB layers in bf16
    assert layers_per_part(94, 5 << 30, 1.0) == 1  # at least one layer
    assert layers_per_part(4, 10, 1e9) == 4  # all: the one-part conversion


def test_the_option_is_checked_in_one_line(capsys, tmp_path):
    from megatron_credit.commands import convert_hf_to_megatron as cmd

    with pytest.raises(SystemExit):
        cmd.parse_args(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--max-part-gib", "0"])
    assert "argument --max-part-gib: must be > 0, got '0'" in capsys.readouterr().err


def _loaded_at(ckpt_a: str, ckpt_b: str, tp: int, pp: int) -> list[str]:
    """In a pool worker: both checkpoints loaded into this rank's TP / PP shard; the keys that differ."""
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    distributed.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    try:
        states = []
        for ckpt in (ckpt_a, ckpt_b):
            model = model_io.build_model(model_io.load_hf_config(ckpt), params_dtype=torch.float32, tp=tp, pp=pp)
            model_io.load_dist_checkpoint(model, ckpt)
            states.append({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
        return sorted(k for k in states[0] if not torch.equal(states[0][k], states[1][k])) + \
            sorted(set(states[0]) ^ set(states[1]))
    finally:
        distributed.destroy()


@pytest.mark.dist
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_the_merged_checkpoint_reshards_like_the_one_part_one(pool2, converted, tp, pp):
    _, root, _, _, _ = converted
    for rank, differ in enumerate(pool2.run(_loaded_at, str(root / "one"), str(root / "parts"), tp, pp)):
        assert differ == [], (rank, differ)
