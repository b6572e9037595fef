"""The preflight (``planning/preflight.py``): the model, the data and the output folder a recipe names, each
failure one ``error:`` line, through ``tools/plan.py``, ``pretrain_rl.py --dry-run`` and the trainer's start;
and the dry run's launch (``WORLD_SIZE`` counts a rollout pool's ranks, ``--nodes``) with the same figures as
``tools/plan.py``."""
from __future__ import annotations

import json
import os

import pytest

from megatron_credit.gpu_kinds import GIB
from megatron_credit.planning.preflight import check_data, check_model, check_output, data_file_rows, preflight
from megatron_credit.recipe.config import load_recipe, recipe_from_dict
from tests.support.paths import ROOT

FIPO_32B = os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml")
ASYNC_32B = os.path.join(ROOT, "examples", "fipo_qwen25_32b_async.yaml")
MOE_30B = os.path.join(ROOT, "examples", "fipo_qwen3_30b_a3b.yaml")


def _dataset_recipe(model_dir, train, val=None, **extra):
    data = {"source": "dataset", "train_path": str(train), "max_prompt_len": 64}
    if val is not None:
        data["val_path"] = str(val)
    return recipe_from_dict({"model": {"name_or_path": str(model_dir)}, "data": data,
                             "rollout": {"prompts_per_step": 2, "n": 2}, "train": {"num_minibatches": 1}, **extra})


def _rows(n, *, columns=("data_source", "prompt", "reward_model")):
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "1+1?"}],
           "reward_model": {"ground_truth": "2"}, "extra_info": None}
    return [{k: v for k, v in row.items() if k in columns} for _ in range(n)]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 checkpoint folder: config.json, safetensors and a tokenizer file."""
    from megatron_credit.conversion.testing import tiny_hf_config, write_random_hf_checkpoint

    out = tmp_path_factory.mktemp("tiny_qwen2")
    write_random_hf_checkpoint(tiny_hf_config("qwen2"), out)
    (out / "tokenizer_config.json").write_text("{}")
    return out


def test_a_model_folder_with_config_weights_and_tokenizer_passes(model_dir, tmp_path):
    check = check_model(_dataset_recipe(model_dir, tmp_path / "t.parquet"))
    assert check.problem is None
    assert check.found.startswith(f"{model_dir}: ok (Qwen2ForCausalLM, family qwen2, ")
    assert "tensors in 1 safetensors file(s)" in check.found


def test_each_thing_missing_from_a_model_is_one_line_naming_the_field(model_dir, tmp_path):
    import shutil

    missing = check_model(load_recipe(FIPO_32B)).problem
    assert missing == ("model.name_or_path=/models/Qwen2.5-32B: no such folder; download it: hf download "
                       "Qwen/Qwen2.5-32B --local-dir /models/Qwen2.5-32B (the recipe's examples/<recipe>.sh does)")
    base = check_model(load_recipe(MOE_30B)).problem  # the Base model the recipe says, not the post-trained one
    assert "hf download Qwen/Qwen3-30B-A3B-Base --local-dir /models/Qwen3-30B-A3B-Base" in base
    unknown = check_model(recipe_from_dict({"model": {"name_or_path": str(tmp_path / "mystery")}})).problem
    assert unknown.endswith("no such folder; put a Hugging Face checkpoint folder there (config.json, "
                            "*.safetensors, the tokenizer)")
    hub = check_model(recipe_from_dict({"model": {"name_or_path": "Qwen/Qwen2.5-7B"}})).problem
    assert hub.startswith("model.name_or_path=Qwen/Qwen2.5-7B is not a folder: the trainer reads a local checkpoint; "
                          "download it: hf download Qwen/Qwen2.5-7B --local-dir /models/Qwen2.5-7B")

    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_model(recipe_from_dict({"model": {"name_or_path": str(empty)}})).problem == (
        f"model.name_or_path={empty}: the folder has no config.json; put a Hugging Face checkpoint folder there "
        "(config.json, *.safetensors, the tokenizer)")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(model_dir / "config.json", no_weights / "config.json")
    problem = check_model(recipe_from_dict({"model": {"name_or_path": str(no_weights)}})).problem
    assert problem.startswith(f"model.name_or_path={no_weights}: no model.safetensors or model.safetensors.index.json")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    problem = check_model(recipe_from_dict({"model": {"name_or_path": str(gpt2)}})).problem
    assert problem.startswith(f"model.name_or_path={gpt2}: unsupported architecture ['GPT2LMHeadModel']")
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tok)
    (no_tok / "tokenizer_config.json").unlink()
    problem = check_model(_dataset_recipe(no_tok, tmp_path / "t.parquet")).problem
    assert problem == (f"model.name_or_path={no_tok}: no tokenizer (tokenizer.json, tokenizer_config.json or "
                       "tokenizer.model) in the folder; copy the checkpoint's or set data.tokenizer_path")
    # a synthetic task brings its own tokenizer: the folder needs none
    assert check_model(recipe_from_dict({"model": {"name_or_path": str(no_tok)}})).problem is None


def test_data_files_are_read_from_their_footer_or_lines_and_checked(model_dir, tmp_path):
    train = _parquet(tmp_path / "train.parquet", _rows(3))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in _rows(2)) + "\n")
    assert data_file_rows(str(train)) == (3, ("data_source", "prompt", "reward_model"))
    assert data_file_rows(str(val)) == (2, ("data_source", "prompt", "reward_model"))
    check = check_data(_dataset_recipe(model_dir, train, val))
    assert check.problem is None and check.found == f"ok: {train} (3 rows), {val} (2 rows)"

    missing = check_data(_dataset_recipe(model_dir, tmp_path / "data" / "dapo-math-17k.parquet")).problem
    assert missing == (f"data.train_path={tmp_path}/data/dapo-math-17k.parquet: no such file; make it with "
                       f"mc-prepare-data --out {tmp_path}/data (docs/data.md), or pass data.train_path=<your "
                       "DAPO-schema .parquet or .jsonl>")
    no_column = _parquet(tmp_path / "nocol.parquet", _rows(3, columns=("data_source", "prompt")))
    assert check_data(_dataset_recipe(model_dir, no_column)).problem == (
        f"data.train_path={no_column}: no column(s) ['reward_model'] (found ['data_source', 'prompt']); the recipes "
        "read the DAPO-Math-17K schema (docs/data.md; mc-prepare-data converts)")
    one_row = _parquet(tmp_path / "one.parquet", _rows(1))
    assert check_data(_dataset_recipe(model_dir, one_row)).problem == (
        f"data.train_path={one_row}: 1 row(s), fewer than rollout.prompts_per_step=2")
    empty_val = tmp_path / "empty.jsonl"
    empty_val.write_text("")
    assert check_data(_dataset_recipe(model_dir, train, empty_val)).problem == (
        f"data.val_path={empty_val}: 0 row(s), fewer than one")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    assert check_data(_dataset_recipe(model_dir, junk)).problem.startswith(
        f"data.train_path={junk}: not a readable parquet file (")
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    assert check_data(_dataset_recipe(model_dir, csv)).problem == (
        f"data.train_path={csv}: unsupported format; use .parquet or .jsonl")
    assert check_data(load_recipe(os.path.join(ROOT, "examples", "demo_cpu.yaml"))).found == (
        "data.source=synthetic_arith (generated, no files)")


def test_the_output_folder_must_be_writable_with_room_for_the_kept_checkpoints(tmp_path, monkeypatch):
    import collections
    import shutil

    ok = check_output(str(tmp_path / "a" / "b"), checkpoint_bytes=GIB, keep=2)
    assert ok.problem is None and ok.found.startswith(f"{tmp_path}/a/b: ok (writable; ")
    assert ok.found.endswith("GiB free for up to 3.0 GiB of checkpoints)") and not (tmp_path / "a").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert check_output(str(blocker / "run"), checkpoint_bytes=1, keep=1).problem == (
        f"--output-dir {blocker}/run: {blocker} is a file, not a folder")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * GIB, 90 * GIB, 10 * GIB))
    run = tmp_path / "run"
    assert check_output(str(run), checkpoint_bytes=4 * GIB, keep=2).problem == (
        f"--output-dir {run}: 12.0 GiB needed for the checkpoints kept at the fullest (checkpoint.keep=2 + the one "
        f"being written, 4.0 GiB each, less 0 already there), 10.0 GiB free in {tmp_path}; lower checkpoint.keep "
        "or use a larger file system")
    # a resumed run already holds its kept checkpoints: only the one being written is new
    for step in (10, 20):
        d = run / "checkpoints" / f"iter_{step:07d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
    assert check_output(str(run), checkpoint_bytes=4 * GIB, keep=2).problem is None


def test_tools_plan_prints_every_failed_check_as_one_line_and_exits_2(tmp_path, capsys):
    from megatron_credit.commands.plan import main

    code = main(["--config", FIPO_32B, "--output-dir", str(tmp_path / "run"), "checkpoint.keep=1",
                 f"data.train_path={tmp_path}/dapo-math-17k.parquet", f"data.val_path={tmp_path}/aime-2024.parquet"])
    out, err = capsys.readouterr()
    assert code == 2 and "verdict: FITS" in out and out.rstrip().endswith("preflight:"), out
    lines = err.splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), err
    assert lines[0].startswith("error: model.name_or_path=/models/Qwen2.5-32B: no such folder")
    assert lines[1].startswith(f"error: data.train_path={tmp_path}/dapo-math-17k.parquet: no such file")
    assert lines[2].startswith(f"error: --output-dir {tmp_path}/run: 854.4 GiB needed") or "GiB free" in lines[2]
    assert main(["--config", FIPO_32B, "--skip-preflight"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("preflight: skipped (--skip-preflight): the model, the data and "
                                                     "the output folder were not checked")


def test_a_missing_model_at_training_time_is_the_same_line_and_exit_2(tmp_path, capsys):
    import pretrain_rl

    code = pretrain_rl.main(["--config", os.path.join(ROOT, "examples", "grpo_qwen25_7b.yaml"),
                             "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: model.name_or_path=/models/Qwen2.5-7B: no such folder; download it: hf download "
                          "Qwen/Qwen2.5-7B --local-dir /models/Qwen2.5-7B")
    assert "; data.train_path=/data/dapo-math-17k.parquet: no such file" in err
    assert not (tmp_path / "run").exists()


def test_the_dry_run_counts_the_pool_in_world_size_and_prints_tools_plan_s_figures(tmp_path, capsys, monkeypatch):
    """``WORLD_SIZE=64`` (torchrun's count: 32 trainer ranks + the pool's 32) and ``--nodes 8`` both plan the async
    recipe as ``tools/plan.py`` does, line for line after the title; ``WORLD_SIZE=48`` leaves 16 trainer ranks,
    which its layout cannot use."""
    import pretrain_rl
    from megatron_credit.commands.plan import main as plan_main

    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert plan_main(["--config", ASYNC_32B, "--skip-preflight"]) == 0
    planned = capsys.readouterr().out.splitlines()[1:]
    monkeypatch.setenv("WORLD_SIZE", "64")
    assert pretrain_rl.main(["--config", ASYNC_32B, "--dry-run", "--skip-preflight"]) == 0
    out = capsys.readouterr().out.splitlines()
    title = next(i for i, line in enumerate(out) if line.startswith("plan of 64 rank(s): fipo, 4 node(s) x 8"))
    assert out[title + 1:title + 1 + len(planned)] == planned
    assert out[-1] == "dry run: the recipe is valid for this world size; nothing was built"
    monkeypatch.delenv("WORLD_SIZE")
    assert pretrain_rl.main(["--config", ASYNC_32B, "--dry-run", "--skip-preflight", "--nodes", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[title + 1:title + 1 + len(planned)] == planned
    monkeypatch.setenv("WORLD_SIZE", "48")
    assert pretrain_rl.main(["--config", ASYNC_32B, "--dry-run", "--skip-preflight"]) == 2
    assert "16" in capsys.readouterr().err
    assert pretrain_rl.main(["--config", ASYNC_32B, "--dry-run", "--nodes", "8"]) == 2
    assert capsys.readouterr().err == ("error: --nodes 8 x cluster.gpus_per_node=8 = 64 GPUs, but WORLD_SIZE=48: "
                                       "pass one of them\n")
    # sync at WORLD_SIZE=32: the host memory per node of the recipe's nodes of 8, as tools/plan.py prints it
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert pretrain_rl.main(["--config", FIPO_32B, "--dry-run", "--skip-preflight"]) == 0
    host = [line for line in capsys.readouterr().out.splitlines() if line.startswith("host offload")]
    assert plan_main(["--config", FIPO_32B, "--skip-preflight"]) == 0
    assert host == [line for line in capsys.readouterr().out.splitlines() if line.startswith("host offload")]
    assert len(host) == 1 and host[0].endswith("per node of 8"), host
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert pretrain_rl.main(["--config", ASYNC_32B, "--dry-run"]) == 2
    assert capsys.readouterr().err == ("error: WORLD_SIZE=32 leaves no trainer rank beside rollout.ranks=32: "
                                       "WORLD_SIZE counts every rank of the launch, the pool's included (e.g. 64 for "
                                       "the recipe's cluster)\n")


def test_preflight_runs_every_check_in_order(model_dir, tmp_path):
    train = _parquet(tmp_path / "train.parquet", _rows(4))
    checks = preflight(_dataset_recipe(model_dir, train), run_dir=str(tmp_path / "run"), checkpoint_bytes=1)
    assert [c.name for c in checks] == ["model", "data", "output"] and all(c.problem is None for c in checks)
    assert [c.line().split()[0] for c in checks] == ["model", "data", "output"]


def test_resuming_a_run_folder_of_another_algorithm_is_one_line(tmp_path, capsys):
    """After ``make demo`` (a FIPO run in runs/demo_cpu), ``algorithm.name=grpo`` into the same folder is
    refused in one line naming both algorithms, before anything is built; the same algorithm is not."""
    import yaml

    import pretrain_rl

    run = tmp_path / "demo"
    ckpt = run / "checkpoints" / "iter_0000160"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": "fipo"}, "train": {"steps": 160}}))
    assert pretrain_rl.main(["--output-dir", str(run), "algorithm.name=grpo", "train.steps=50"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {run} holds a fipo run ({run}/config.yaml); algorithm.name=grpo would resume it as "
                   "another algorithm: pass --output-dir <new dir> for a new run (or --resume PATH to resume a "
                   "checkpoint on purpose)\n")
    assert pretrain_rl.main(["--output-dir", str(run), "train.steps=160"]) == 0  # fipo, at its end: nothing to do
    assert capsys.readouterr().out.startswith(f"already finished: {run} is at iteration 160 of train.steps=160")


def test_an_unknown_rollout_engine_is_one_line_before_anything(capsys):
    """The recipe, a leaf, cannot look ``rollout.engine`` up: both entry points check it at start-up."""
    import pretrain_rl
    from megatron_credit.commands.plan import main as plan_main

    line = "error: rollout.engine: unknown rollout engine 'sglang'; valid names: ['hf', 'vllm']\n"
    assert pretrain_rl.main(["rollout.engine=sglang", "--dry-run"]) == 2 and capsys.readouterr().err == line
    assert pretrain_rl.main(["rollout.engine=sglang"]) == 2 and capsys.readouterr().err == line
    assert plan_main(["--config", FIPO_32B, "rollout.engine=sglang"]) == 2 and capsys.readouterr().err == line
