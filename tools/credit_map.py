"""A run's credit map as a page and a PNG of one response (``megatron_credit.commands.credit_map``).

Runs :func:`megatron_credit.commands.credit_map.main` from a checkout; see that module for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.credit_map import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
