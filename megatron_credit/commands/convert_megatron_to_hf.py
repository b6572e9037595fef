"""megatron-core distributed checkpoint (written by convert_hf_to_megatron) -> HF safetensors folder.

    python tools/convert_megatron_to_hf.py --ckpt ckpt/qwen25_7b --out hf/qwen25_7b [--max-shard-size 5GB]

Writes size-bounded ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``,
``config.json`` and the tokenizer files: a folder ``AutoModelForCausalLM.from_pretrained`` loads.
"""
from __future__ import annotations

import argparse
import re
import sys

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units like ``save_pretrained``; KiB/MiB/GiB binary).

    >>> parse_size("5GB"), parse_size("512MiB"), parse_size("1000")
    (5000000000, 536870912, 1000)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 5GB, 500MB, 2GiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:  # a shard of 0 bytes holds nothing
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


parse_size.kind = "size"  # what the tests that walk every option try on it


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="folder written by convert_hf_to_megatron")
    p.add_argument("--out", required=True, help="output HF folder, not inside --ckpt (only the files of an "
                   "earlier export there are replaced)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace HF files in --out that no earlier export wrote (default: refuse)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--allow-lossy-dtype", action="store_true", help="allow a cast that loses precision")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), help="e.g. 5GB")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the traceback of user errors")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from megatron_credit.conversion.converters import convert_megatron_to_hf

    files = convert_megatron_to_hf(args.ckpt, args.out, dtype=args.dtype, allow_lossy_dtype=args.allow_lossy_dtype,
                                   max_shard_bytes=args.max_shard_size, progress=not args.no_progress,
                                   overwrite=args.overwrite)
    print(f"wrote {len(files)} shard(s) to {args.out}")
    return 0


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
