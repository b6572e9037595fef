"""megatron-core distributed checkpoint (written by convert_hf_to_megatron) -> HF safetensors folder.

Runs :func:`megatron_credit.commands.convert_megatron_to_hf.main` from a checkout (installed: ``mc-convert-megatron-to-hf``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.convert_megatron_to_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
