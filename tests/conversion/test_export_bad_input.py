"""The exporters never replace a user's files, and every run round-trips.

A tiny run with an inline ``model.architecture`` is made by ``pretrain_rl.py``; one subprocess then
exports it (``export_run_to_hf``), converts the export to megatron and back, and points both exporters
at a folder holding a user's own HF checkpoint (two shards, their index, ``model.safetensors``,
``config.json``). Saving a dist checkpoint starts a multiprocessing Manager, hence the subprocess.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.paths import REPO
from tests.support.runs import TINY_CHECKPOINTED, run_pretrain_rl, subprocess_env

pytestmark = pytest.mark.dist


USER_FILES = {"model-00001-of-00002.safetensors": b"user shard 1", "model-00002-of-00002.safetensors": b"user shard 2",
              "model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                         "b": "model-00002-of-00002.safetensors"}}).encode(),
              "model.safetensors": b"user single file", "config.json": b'{"model_type": "llama", "mine": true}'}


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _main(fn, argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = fn(argv)
        except SystemExit as exc:  # argparse: an unknown option
            code = exc.code
    return code, err.getvalue()


def _roundtrip(root: str) -> None:
    import torch

    from megatron_credit.conversion.converters import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_credit.conversion.run_export import export_run_checkpoint
    from megatron_credit.commands import convert_megatron_to_hf as to_hf
    from megatron_credit.commands import export_run_to_hf as export

    root = Path(root)
    ckpt = root / "run" / "checkpoints" / "iter_0000002"
    res: dict = {"exported": export_run_checkpoint(ckpt, root / "hf")}
    res["architectures"] = json.loads((root / "hf" / "config.json").read_text()).get("architectures")
    try:  # recorded, not raised: the refusals below are checked on their own
        convert_hf_to_megatron(root / "hf", root / "mc", progress=False)
        convert_megatron_to_hf(root / "mc", root / "back", progress=False)
        a, b = _tensors(root / "hf"), _tensors(root / "back")
        res["round_trip_equal"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    except Exception as exc:  # noqa: BLE001  (then a megatron checkpoint for the checks below, by hand)
        res["round_trip_equal"] = f"{type(exc).__name__}: {exc}"
        a = _tensors(root / "hf")
        shutil.copytree(root / "hf", root / "hf_arch")
        cfg = json.loads((root / "hf_arch" / "config.json").read_text())
        (root / "hf_arch" / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"]}))
        shutil.rmtree(root / "mc", ignore_errors=True)
        convert_hf_to_megatron(root / "hf_arch", root / "mc", progress=False)
    user = root / "user"
    user.mkdir()
    for name, blob in USER_FILES.items():
        (user / name).write_bytes(blob)
    res["export_refused"] = _main(export.main, ["--checkpoint", str(ckpt), "--out", str(user)])
    res["convert_refused"] = _main(to_hf.main, ["--ckpt", str(root / "mc"), "--out", str(user), "--no-progress"])
    res["user_files_kept"] = all((user / n).is_file() and (user / n).read_bytes() == blob for n, blob in USER_FILES.items())
    res["user_listing"] = sorted(p.name for p in user.iterdir())
    res["again_into_own_export"] = _main(export.main, ["--checkpoint", str(ckpt), "--out", str(root / "hf")])
    res["overwrite"] = _main(to_hf.main, ["--ckpt", str(root / "mc"), "--out", str(user), "--no-progress",
                                          "--overwrite"])
    res["overwritten_equal"] = sorted(_tensors(user)) == sorted(a)
    (root / "results.json").write_text(json.dumps(res, indent=1))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    (root / "recipe.yaml").write_text(yaml.safe_dump(TINY_CHECKPOINTED))
    proc = run_pretrain_rl("--config", root / "recipe.yaml", "--output-dir", root / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = f"from tests.conversion.test_export_bad_input import _roundtrip; _roundtrip({str(root)!r})"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


def test_an_inline_architecture_run_round_trips(results):
    assert results["exported"] == ["model.safetensors"]
    assert results["architectures"] == ["Qwen2ForCausalLM"]
    assert results["round_trip_equal"] is True


@pytest.mark.parametrize("tool", ["export_refused", "convert_refused"])
def test_exporters_refuse_a_folder_holding_a_user_checkpoint(results, tool):
    code, err = results[tool]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    for name in USER_FILES:
        assert name in errors[0]
    assert "did not write and would replace or delete" in errors[0] and "--overwrite" in errors[0]
    assert results["user_files_kept"] is True
    assert results["user_listing"] == sorted(USER_FILES)  # nothing written there either


def test_an_export_may_replace_its_own_files_and_overwrite_replaces_the_users(results):
    assert results["again_into_own_export"][0] == 0, results["again_into_own_export"]
    assert results["overwrite"][0] == 0 and results["overwritten_equal"] is True, results["overwrite"]
