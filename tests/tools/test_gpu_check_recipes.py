"""The recipes ``tools/gpu_check.sh`` trains on a GPU (``tools/gpu_check_trainer.py``) are valid and
planned here, on CPU, so a lent GPU's minutes are not spent on a recipe typo: each one passes
``pretrain_rl.py --dry-run`` on one H200 (the planner fits it), has the shape the issue asks for, and
``run`` on a machine without CUDA says "skipped: why" (exit 77). ``tools/gpu_check.sh`` parses."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tools import gpu_check_trainer as G

from tests.support.paths import REPO


@pytest.mark.parametrize("name", G.NAMES)
def test_recipe_is_valid_and_fits_one_h200(name, tmp_path, capsys):
    import pretrain_rl

    path = G.write(name, tmp_path, te=True, weights=False)
    r = yaml.safe_load(path.read_text())
    assert r["model"]["params_dtype"] == "bfloat16" and r["model"]["transformer_impl"] == "transformer_engine"
    assert r["rollout"]["engine"] == ("vllm" if name.endswith("_vllm") else "hf")
    if name.startswith("demo"):
        assert r["train"]["steps"] == 3
    else:
        assert r["train"]["steps"] == 2 and r["rollout"]["max_response_len"] == 4096
    if name.endswith("_vllm"):
        assert r["model"]["name_or_path"] == str(tmp_path / "hf") and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert pretrain_rl.main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "dry run: the recipe is valid for this world size" in out, out


def test_llama1b_is_llama_3_2_1b_shaped(tmp_path):
    from megatron_credit.config import load_recipe
    from megatron_credit.planning import plan

    for name in ("llama1b_hf", "llama1b_vllm"):
        recipe = load_recipe(str(G.write(name, tmp_path / name, te=True, weights=False)))
        cfg = recipe.model.hf_config()
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (2048, 16, 32, 8, 8192, 128256, True)
        p = plan(recipe, cfg, nodes=1, gpus_per_node=1, gpu="h200")
        assert p.fits and p.peak < 100 * 1024 ** 3, p  # leaves the H200 room; a colocated vLLM takes 0.3 of it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.spawn
def test_run_without_cuda_is_skipped_with_why(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_check_trainer.py", "run", "demo_hf", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 77 and proc.stdout.strip().splitlines()[-1] == "skipped: CUDA is not available to torch"


@pytest.mark.spawn
def test_gpu_check_script_parses_and_degrades_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=REPO).returncode == 0
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is here: the full check would run")
    report = tmp_path / "report.md"
    proc = subprocess.run(["bash", "tools/gpu_check.sh", str(report)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = report.read_text()
    for part in ("trainer_demo_hf", "trainer_demo_vllm", "trainer_llama1b", "te_vs_local", "pytest_gpu"):
        assert f"## {part}\nskipped: no GPU (nvidia-smi -L failed)" in text, (part, text)
    assert text.index("## trainer_demo_hf") < text.index("## te_vs_local")
