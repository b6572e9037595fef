"""HF safetensors folder -> megatron-core distributed checkpoint (torch_dist), loadable at any TP / PP.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out ckpt/qwen25_7b [--tp 4 --pp 2]

``--tp`` / ``--pp`` / ``--ep`` check that the planned parallel sizes divide the model (the checkpoint itself
is topology-free: megatron reshards on load; every expert is written whole, whatever ``--ep``). ``--dtype`` casts the weights; a cast that loses precision
needs ``--allow-lossy-dtype``. A model larger than ``--max-part-gib`` is written a part of its layers at a
time (``conversion/parts.py``): host memory stays bounded by a part. See ``megatron_credit/conversion/converters.py`` for the
folder's files.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    from megatron_credit.cli import positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--out", required=True, help="output folder: new or empty, not inside --hf-dir")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out, replacing model/, config.json, conversion_meta.json "
                        "and tokenizer files there (other files stay)")
    p.add_argument("--tp", type=positive_int, default=1, help="planned tensor-parallel size (validated)")
    p.add_argument("--pp", type=positive_int, default=1, help="planned pipeline-parallel size (validated)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="planned expert-parallel size (validated: it must divide the routed experts)")
    p.add_argument("--max-part-gib", type=positive_float, default=16.0,
                   help="host memory for decoder layers at a time: a model larger than this is converted in parts "
                        "of as many layers as fit (at least one), the embedding and the output layer on top "
                        "(default 16)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--allow-lossy-dtype", action="store_true", help="allow a cast that loses precision")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the traceback of user errors")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from megatron_credit.conversion.converters import convert_hf_to_megatron

    meta = convert_hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                  allow_lossy_dtype=args.allow_lossy_dtype, overwrite=args.overwrite,
                                  progress=not args.no_progress, max_part_bytes=args.max_part_gib * 2**30)
    n = meta["layers_per_part"]
    parts = f", {meta['import_parts']} parts of {n} layer{'s' if n > 1 else ''}" if meta["import_parts"] > 1 else ""
    print(f"wrote {args.out} ({meta['family']}, {meta['dtype']}{parts})")
    return 0


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
