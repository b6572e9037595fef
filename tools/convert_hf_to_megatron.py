"""HF safetensors folder -> megatron-core distributed checkpoint (torch_dist), loadable at any TP / PP.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out ckpt/qwen25_7b [--tp 4 --pp 2]

``--tp`` / ``--pp`` check that the planned parallel sizes divide the model (the checkpoint itself is
topology-free: megatron reshards on load). ``--dtype`` casts the weights; a cast that loses precision
needs ``--allow-lossy-dtype``. See ``megatron_credit/conversion/checkpoint.py`` for the layout.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--out", required=True, help="output folder (created; its model/ must be empty)")
    p.add_argument("--tp", type=int, default=1, help="planned tensor-parallel size (validated)")
    p.add_argument("--pp", type=int, default=1, help="planned pipeline-parallel size (validated)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--allow-lossy-dtype", action="store_true", help="allow a cast that loses precision")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_credit.conversion.checkpoint import convert_hf_to_megatron

    try:
        meta = convert_hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                      allow_lossy_dtype=args.allow_lossy_dtype, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({meta['family']}, {meta['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
