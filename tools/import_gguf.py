"""GGUF file -> dequantized HF safetensors folder (weights, config, tokenizer, chat template).

Runs :func:`megatron_credit.commands.import_gguf.main` from a checkout (installed: ``mc-import-gguf``); see that module
for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, importable without installing

from megatron_credit.commands.import_gguf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
