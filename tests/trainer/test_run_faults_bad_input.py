"""Faults of a running job: a failed save names a full disk and leaves nothing that blocks
the next one; dropped prompts are counted and warned about. In-process, no model is built."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest


def _failing_save(monkeypatch, exc: BaseException):
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion import mcore_save
    from megatron_credit.trainer import checkpoint

    def save(state, path, **_):
        Path(path, "__0_0.distcp").write_bytes(b"x" * 1000)  # a partial file, as a full disk leaves it
        raise exc

    monkeypatch.setattr(dist_checkpointing, "save", save)
    monkeypatch.setattr(checkpoint, "_sharded_state", lambda actor, for_load: {})
    monkeypatch.setattr(mcore_save, "_save_strategy", lambda: None)
    return checkpoint


class _Actor:
    optimizer_steps = 0


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0"),
])
def test_a_full_disk_is_named_and_the_partial_save_removed(monkeypatch, tmp_path, exc):
    import shutil

    checkpoint = _failing_save(monkeypatch, exc)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000003.tmp" / "model_optim").mkdir(parents=True)  # a killed earlier save
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"saving checkpoint .*iter_0000004: no space left on "
                       r"device \(4096 bytes free under .*\); the partial save was removed"):
        checkpoint.save(str(run), 4, _Actor(), {}, layout={}, keep=2)
    assert os.listdir(run / "checkpoints") == []  # neither this save's .tmp nor the earlier one's


def test_another_save_failure_keeps_its_traceback(monkeypatch, tmp_path):
    checkpoint = _failing_save(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="^a bug$"):
        checkpoint.save(str(tmp_path), 1, _Actor(), {}, layout={}, keep=2)
    assert os.listdir(tmp_path / "checkpoints") == []


def test_a_read_only_disk_is_one_line(monkeypatch, capsys):
    from megatron_credit.cli import run_main

    def main(argv):
        raise OSError(errno.EROFS, "Read-only file system", "/runs/x/config.yaml")

    assert run_main(main, []) == 2
    assert capsys.readouterr().err.strip() == "error: [Errno 30] Read-only file system: '/runs/x/config.yaml'"


def test_prompts_over_the_length_limit_are_counted_and_warned_about():
    from megatron_credit.data.dataset import DatasetStats

    many = DatasetStats(rows=24, too_long=23, kept=1)
    line = many.too_long_warning("data.train_path d.jsonl")
    assert line.startswith("warning: data.train_path d.jsonl: 23 of 24 prompts are over data.max_prompt_len")
    assert DatasetStats(rows=10, too_long=1, kept=9).too_long_warning("x") is None  # a tenth: no warning
