"""A LoRA run's checkpoint out to Hugging Face (``conversion/run_export.py``): as a PEFT adapter that ``peft``
loads onto the base model, and as the merged model; both give the trainer's logits.

The run is written the trainer's way, in this process: an actor with adapters (rank 4, alpha 12: a scale
other than the default 2) on a Qwen2 base saved as HF safetensors (GQA, biased QKV, a gated MLP), its
adapters set to random values (trained ones; a fresh ``B`` is zero), saved by ``trainer.checkpoint.save``.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_credit.conversion.run_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_run_checkpoint

VOCAB = 96


def _batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    pos = torch.arange(10).expand(2, 10)
    return ids, pos


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(root, run_dir, checkpoint, our logits [B, S, V])`` of a LoRA run on a saved HF base."""
    import yaml

    from megatron_credit import distributed
    from megatron_credit.conversion.testing import tiny_hf_config, write_random_hf_checkpoint
    from megatron_credit.models.lora import adapters
    from megatron_credit.recipe.config import recipe_from_dict, recipe_to_dict
    from megatron_credit.trainer import checkpoint as trainer_ckpt
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.loop import actor_settings
    from tests.support.distributed_harness import pipeline_forward

    root = tmp_path_factory.mktemp("lora_export")
    base = root / "base"
    cfg = tiny_hf_config("qwen2", num_hidden_layers=2, vocab_size=VOCAB)
    write_random_hf_checkpoint(cfg, base, dtype=torch.float32, seed=5)
    (base / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    run_dir = root / "run"
    run_dir.mkdir()
    recipe = recipe_from_dict({"model": {"name_or_path": str(base), "params_dtype": "float32",
                                         "lora": {"rank": 4, "alpha": 12.0}}})
    with open(run_dir / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe_to_dict(recipe), f, sort_keys=False)
    device = distributed.initialize(recipe.parallel, seed=0)
    try:
        actor = Actor(hf_config=recipe.model.hf_config(), **actor_settings(recipe), device=device,
                      with_critic=True, with_reference=True)
        actor.load_initial_weights(seed=0)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for _, a in adapters(actor.model):
                a.b.copy_(torch.randn(a.b.shape, generator=g) * 0.05)
            actor.model.value_head.weight.fill_(3.0)  # stored next to the adapters, never exported
        actor.sync_optimizer_from_model()
        actor.model.eval()
        ids, pos = _batch()
        logits = pipeline_forward(actor.model, ids, pos, None, hidden_size=cfg.hidden_size)[..., :VOCAB]  # causal
        ckpt = trainer_ckpt.save(str(run_dir), 3, actor, {"note": torch.zeros(1)},
                                 layout={"tp": 1, "pp": 1, "cp": 1, "dp": 1}, keep=3)
    finally:
        distributed.destroy(process_group=True)
    return root, run_dir, ckpt, logits


def _hf_logits(model):
    ids, pos = _batch()
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits


def test_the_peft_adapter_loads_with_peft_and_gives_our_logits(lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, run_dir, ckpt, ours = lora_run
    out = root / "peft"
    assert export_run_checkpoint(ckpt, out, adapter=True) == [ADAPTER_WEIGHTS]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "base_model_name_or_path", "target_modules")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 12, "base_model_name_or_path": str(root / "base"),
        "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}
    tensors = load_file(str(out / ADAPTER_WEIGHTS))
    assert len(tensors) == 2 * 2 * 7  # 2 layers x 7 HF linears x (A, B); no value head, no optimizer state
    # q, k and v share megatron's one A
    a = "base_model.model.model.layers.1.self_attn.{}_proj.lora_A.weight"
    assert torch.equal(tensors[a.format("q")], tensors[a.format("k")])
    assert sorted(p.name for p in out.iterdir()) == [".megatron_credit_export.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    base = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
    plain = _hf_logits(base)
    assert (plain - ours).abs().max() > 1e-2  # the adapters change the logits
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    torch.testing.assert_close(_hf_logits(peft_model), ours, rtol=0, atol=2e-5)


def test_the_merged_model_gives_our_logits_with_the_base_s_tokenizer(lora_run):
    from transformers import AutoModelForCausalLM

    root, run_dir, ckpt, ours = lora_run
    out = root / "merged"
    assert export_run_checkpoint(ckpt, out) == ["model.safetensors"]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}\n'
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(merged), ours, rtol=0, atol=2e-5)


def test_the_export_cli_says_what_it_wrote_and_refuses_in_one_line(lora_run, capsys):
    from megatron_credit.commands.export_run_to_hf import main

    root, run_dir, ckpt, _ = lora_run
    assert main(["--run-dir", str(run_dir), "--out", str(root / "cli"), "--adapter"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote the PEFT adapter of {ckpt} to {root / 'cli'}"

    def refused(meta_edit, *flags) -> str:
        import shutil

        other = root / f"edited{len(list(root.iterdir()))}"
        shutil.copytree(run_dir, other)
        meta_path = other / "checkpoints" / "iter_0000003" / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta_edit(meta)
        meta_path.write_text(json.dumps(meta))
        assert main(["--run-dir", str(other), "--out", str(other / "hf"), *flags]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and not (other / "hf").exists(), lines
        return lines[0]

    line = refused(lambda m: m.pop("lora"), "--adapter")
    assert re.fullmatch(r"error: '.*iter_0000003': --adapter: this run trained every weight \(its meta.json names "
                        r"no LoRA adapters, model.lora.rank 0\); export the model without --adapter", line), line
    line = refused(lambda m: m["lora"].update(base=str(root / "gone")))
    assert line.endswith(f"the adapters' base {str(root / 'gone')!r} (meta.json: lora.base) holds no safetensors "
                         "weights; the export needs the base the run was trained on"), line
    line = refused(lambda m: m["lora"].update(base=None))
    assert line.endswith("the adapters' base was a random initialisation (model.name_or_path held no HF weights), "
                         "so there is no base to merge them into or to name"), line


def test_target_modules_are_short_names_unless_a_frozen_linear_shares_one():
    from megatron_credit.conversion.run_export import _target_modules

    attn = [f"model.layers.{i}.self_attn.{x}_proj" for i in range(12) for x in "qkv"]
    assert _target_modules(attn, {"model.layers.0.mlp.gate_proj"}) == ["k_proj", "q_proj", "v_proj"]
    # a shared expert adapted, the routed experts (also "gate_proj") frozen: an exact expression
    shared = [f"model.layers.{i}.mlp.shared_expert.{x}_proj" for i in range(12) for x in ("gate", "up", "down")]
    routed = {f"model.layers.{i}.mlp.experts.{e}.gate_proj" for i in range(12) for e in range(4)}
    pattern = _target_modules(shared, routed)
    assert isinstance(pattern, str)
    assert all(re.fullmatch(pattern, m) for m in shared)
    assert not any(re.fullmatch(pattern, m) for m in routed)
    assert not re.fullmatch(pattern, "model.layers.x.mlp.shared_expert.gate_proj")
