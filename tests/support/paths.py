"""The repository's root, for tests that run its scripts (``pretrain_rl.py``, ``tools/``, ``examples/``) or
read its files: ``REPO`` as a ``Path``, ``ROOT`` as a ``str``. One definition, so that a test file can move
between the subpackages of ``tests/`` without a ``__file__``-relative path to fix."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = str(REPO)
