"""The recipes' prompt files, downloaded and checked (``megatron_credit.commands.prepare_data``).

Runs :func:`megatron_credit.commands.prepare_data.main` from a checkout (installed: ``mc-prepare-data``); see
that module for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
