"""Every recipe in miniature on the CPU (``megatron_credit.commands.rehearse``; ``make rehearse``).

Runs :func:`megatron_credit.commands.rehearse.main` from a checkout; see that module for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.rehearse import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
