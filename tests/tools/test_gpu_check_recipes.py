"""The recipes ``tools/gpu_check.sh`` trains on a GPU (``tools/gpu_check_trainer.py``) are valid and
planned here, on CPU, so a lent GPU's minutes are not spent on a recipe typo: each one passes
``pretrain_rl.py --dry-run`` on one H200 (the planner fits it), has the shape the issue asks for, and
``run`` on a machine without CUDA says "skipped: why" (exit 77); ``tools/gpu_check.sh`` never reaches the network and
its dry mode (``GPU_CHECK_DRY=1``) reaches every part on CPU."""
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
@pytest.mark.parametrize("te", [True, False], ids=["te", "local"])
def test_recipe_is_valid_and_fits_one_h200(name, te, tmp_path, capsys):
    import pretrain_rl

    path = G.write(name, tmp_path, te=te, weights=False)
    r = yaml.safe_load(path.read_text())
    assert r["model"]["params_dtype"] == "bfloat16"
    assert r["rollout"]["engine"] == ("vllm" if name.endswith("_vllm") else "hf")
    if name.startswith("demo"):
        assert r["train"]["steps"] == G.DEMO_STEPS and r["model"]["transformer_impl"] == "local"
    else:
        assert r["train"]["steps"] == 1 and r["rollout"]["max_response_len"] == 4096
        assert r["model"]["transformer_impl"] == ("transformer_engine" if te else "local")
    if name.endswith("_vllm"):
        assert r["model"]["name_or_path"] == str(tmp_path / "hf") and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert pretrain_rl.main(["--config", str(path), "--dry-run", "--skip-preflight"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "dry run: the recipe is valid for this world size" in out, out


def test_qwen15b_is_qwen25_1_5b_shaped(tmp_path):
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.planning.plan import plan

    for name in ("qwen15b_hf", "qwen15b_vllm"):
        recipe = load_recipe(str(G.write(name, tmp_path / name, te=False, weights=False)))
        cfg = recipe.model.hf_config()
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (1536, 28, 12, 2, 8960, 151936, True)
        p = plan(recipe, cfg, nodes=1, gpus_per_node=1, gpu="h200")
        assert p.fits and p.peak < 100 * 1024 ** 3, p  # leaves the H200 room; a colocated vLLM takes 0.3 of it


def test_the_trainer_verdict_bounds_the_mismatch_and_wants_the_reward_to_rise(capsys):
    rows = [{"reward/mean": 0.3 + 0.01 * i, "mismatch/logprob_abs_mean": 0.01} for i in range(G.DEMO_STEPS)]
    assert G._verdict("demo_hf", 0, rows, peak=1, gpu_bytes=2) == 0
    high = [dict(r, **{"mismatch/logprob_abs_mean": 2 * G.MISMATCH_BOUND}) for r in rows]
    assert G._verdict("demo_hf", 0, high, peak=1, gpu_bytes=2) == 1  # finite, but over the bound
    flat = [dict(r, **{"reward/mean": 0.5}) for r in rows]
    assert G._verdict("demo_hf", 0, flat, peak=1, gpu_bytes=2) == 1
    assert "failed: the reward did not rise" in capsys.readouterr().out
    assert G._verdict("qwen15b_hf", 0, rows[:1], peak=1, gpu_bytes=2) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.spawn
def test_run_without_cuda_is_skipped_with_why(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_check_trainer.py", "run", "demo_hf", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 77 and proc.stdout.strip().splitlines()[-1] == "skipped: CUDA is not available to torch"


PARTS = ("setup", "env", "scenarios", "demo", "kernels", "qwen15b", "pytest_gpu", "profile", "te_vs_local",
         "demo_vllm", "vllm_roundtrip", "pytest_vllm")


def test_the_script_never_reaches_the_network():
    text = (REPO / "tools" / "gpu_check.sh").read_text()
    pip = [line for line in text.splitlines() if "pip install" in line]
    assert pip and all("--no-index" in line for line in pip), pip
    assert "pip download" not in text and "-e ." not in text


@pytest.mark.spawn
def test_dry_mode_reaches_every_part_and_installs_the_wheelhouse_offline(tmp_path):
    """GPU_CHECK_DRY=1 on this machine: the wheelhouse step installs a wheel built here (no index), each
    part is reached in order, and each that needs CUDA says why it skips."""
    assert subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=REPO).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the dry mode's skips are those of a machine without CUDA")
    pkg = tmp_path / "pkg"
    (pkg / "gpucheck_probe").mkdir(parents=True)
    (pkg / "gpucheck_probe" / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "setup.py").write_text("from setuptools import setup\nsetup(name='gpucheck-probe', version='0.1', "
                                  "packages=['gpucheck_probe'])\n")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(pkg)], check=True, capture_output=True, timeout=120)
    site, report = tmp_path / "site", tmp_path / "out" / "gpu_check_report.md"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GPU_CHECK_DRY": "1", "PYTHON": sys.executable,
           "GPU_CHECK_WHEELHOUSE": str(wheels), "GPU_CHECK_SITE": str(site), "OUT": str(tmp_path / "out"),
           "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=170,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = report.read_text()  # $OUT/gpu_check_report.md by default
    assert (site / "gpucheck_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert "## setup\npassed" in text, text
    assert [text.index(f"## {p}\n") for p in PARTS] == sorted(text.index(f"## {p}\n") for p in PARTS)
    for part in ("scenarios", "demo", "kernels", "qwen15b", "pytest_gpu", "profile"):
        assert f"## {part}\nskipped: CUDA is not available to torch" in text, (part, text)
    assert "## env\n" in text and "- torch " in text
