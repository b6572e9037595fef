"""Memory plan of a recipe on a cluster, before any GPU hour is spent (``megatron_credit.planning.plan``).

Runs :func:`megatron_credit.commands.plan.main` from a checkout (installed: ``mc-plan``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
