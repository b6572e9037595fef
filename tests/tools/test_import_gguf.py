"""``tools/import_gguf.py`` refuses bad input with one line, exit code 2, and touches no user file.

Small GGUF files are written with the ``gguf`` package's writer (metadata only: the checks run before
any tensor is read). The import of a real GGUF file is tested in ``tests/models/test_real_model_smollm2.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_credit.commands import import_gguf

from tests.support.paths import REPO


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refused(tmp_path: Path, gguf: Path, out: Path, match: str, capsys) -> None:
    before = _snapshot(tmp_path)
    assert import_gguf.main([str(gguf), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert _snapshot(tmp_path) == before  # nothing written, nothing removed


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip file, not a gguf")
    _refused(tmp_path, bad, tmp_path / "out", "is not a GGUF file (it starts with b'PK\\x03\\x04'", capsys)


def test_missing_file(tmp_path, capsys):
    _refused(tmp_path, tmp_path / "nope.gguf", tmp_path / "out", "nope.gguf does not exist", capsys)


def test_truncated_gguf(tmp_path, capsys):
    pytest.importorskip("gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    _refused(tmp_path, bad, tmp_path / "out", "is not a readable GGUF file", capsys)


def test_unmapped_architecture(tmp_path, capsys):
    g = _gguf(tmp_path / "gpt2.gguf", "gpt2")
    assert import_gguf.gguf_architecture(g) == "gpt2"
    _refused(tmp_path, g, tmp_path / "out", "GGUF architecture 'gpt2' is not mapped; supported: "
             "['llama', 'qwen2', 'qwen3']", capsys)


def test_non_empty_out_is_left_alone(tmp_path, capsys):
    g = _gguf(tmp_path / "llama.gguf", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(tmp_path, g, out, "is not empty", capsys)
    (out / "notes.txt").unlink()
    f = tmp_path / "file"
    f.write_text("x")
    _refused(tmp_path, g, f, "exists and is not a folder", capsys)


def test_unwritable_out(tmp_path, capsys):
    g = _gguf(tmp_path / "llama.gguf", "llama")
    parent = tmp_path / "a_file"
    parent.write_text("x")
    _refused(tmp_path, g, parent / "out", "is not a folder", capsys)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            _refused(tmp_path, g, ro / "out", "is not writable", capsys)
        finally:
            ro.chmod(0o755)


@pytest.mark.spawn
def test_script_runs_from_any_directory(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "import_gguf.py"), str(bad), str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {bad} is not a GGUF file (it starts with b'nope', not b'GGUF')"], proc.stderr
