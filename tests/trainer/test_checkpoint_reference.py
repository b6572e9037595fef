"""A frozen reference that is still the HF weights the run started from is checkpointed as their folder
and a SHA-256 (``trainer/checkpoint.reference_extras``), not as a second copy of the weights; the resume
is bit-identical, and a folder whose weights changed since is refused in one line."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.support.runs import char_tokenizer, metrics_rows, run_pretrain_rl, stable


pytestmark = pytest.mark.dist


def _hf_folder(path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                      eos_token_id=2)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    char_tokenizer(str(path))


def test_reference_of_hf_weights_is_saved_as_a_digest_and_resumes_exactly(tmp_path):
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    _hf_folder(model)
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
             "reward_model": {"ground_truth": str(a + b)}} for a in range(6) for b in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"model": {"name_or_path": str(model)},
              "data": {"source": "dataset", "train_path": str(data), "max_prompt_len": 32},
              "algorithm": {"name": "grpo", "kl_coef": 0.05}, "optim": {"lr": 1e-3},
              "rollout": {"prompts_per_step": 8, "n": 4, "max_response_len": 4},
              "train": {"val_every": 0, "num_minibatches": 2},
              "checkpoint": {"every": 1, "keep": 3, "save_at_end": False},
              "logging": {"progress": False, "plots": False, "tensorboard": False}}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    args = ["--config", str(tmp_path / "recipe.yaml")]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    proc = run_pretrain_rl("--output-dir", a, *args, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_pretrain_rl("--output-dir", b, *args, "train.steps=1").returncode == 0
    rank = os.path.join(b, "checkpoints", "iter_0000001", "rank_00000.pt")
    saved = torch.load(rank, weights_only=True)["reference"]
    assert set(saved) == {"hf_weights", "sha256"} and saved["hf_weights"] == str(model) and len(saved["sha256"]) == 64
    assert os.path.getsize(rank) < 200_000  # RNG states and the data cursor only
    proc = run_pretrain_rl("--output-dir", b, *args, "train.steps=2")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert stable(metrics_rows(b)) == stable(metrics_rows(a)) and [r["step"] for r in metrics_rows(b)] == [1, 2]
    assert "actor/kl_ref" in metrics_rows(b)[1]  # the reference pass ran after the resume
    # the folder's weights changed since the save: the reference cannot be rebuilt from it
    c = str(tmp_path / "c")
    shutil.copytree(os.path.join(b, "checkpoints", "iter_0000001"), os.path.join(c, "checkpoints", "iter_0000001"))
    from safetensors.torch import load_file, save_file

    f = next(p for p in os.listdir(model) if p.endswith(".safetensors"))
    state = load_file(model / f)
    k = next(iter(state))
    state[k] = state[k] + 1e-3
    save_file(state, model / f, metadata={"format": "pt"})
    proc = run_pretrain_rl("--output-dir", c, *args, "train.steps=2")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "reference model" in errors[0] and "model.name_or_path" in errors[0] and str(model) in errors[0]
