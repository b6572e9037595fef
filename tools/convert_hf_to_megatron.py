"""HF safetensors folder -> megatron-core distributed checkpoint (torch_dist), loadable at any TP / PP.

Runs :func:`megatron_credit.commands.convert_hf_to_megatron.main` from a checkout (installed: ``mc-convert-hf-to-megatron``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.convert_hf_to_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
