"""Hostile checkpoint content for the bad-input tests: a pickle that runs code when an unrestricted
unpickler loads it. The tests check that the project's loaders refuse it and that its marker file is never
created."""
from __future__ import annotations

import os
from pathlib import Path


class RunsCode:
    """A pickle payload that creates ``marker`` when an unrestricted unpickler loads it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
