"""Avg@k, Cons@k and Pass@k of a model on a prompt dataset (``megatron_credit.sources.evaluation``).

Runs :func:`megatron_credit.commands.evaluate.main` from a checkout (installed: ``mc-evaluate``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
