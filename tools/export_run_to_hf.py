"""A training run's newest (or a given) checkpoint -> a Hugging Face folder (``conversion/run_export.py``).

Runs :func:`megatron_credit.commands.export_run_to_hf.main` from a checkout (installed: ``mc-export-run-to-hf``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.export_run_to_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
