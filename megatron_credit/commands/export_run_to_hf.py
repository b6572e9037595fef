"""A training run's newest (or a given) checkpoint -> a Hugging Face folder (``conversion/run_export.py``).

    python tools/export_run_to_hf.py --run-dir runs/fipo_qwen25_32b --out runs/fipo_qwen25_32b/hf
    python tools/export_run_to_hf.py --checkpoint runs/x/checkpoints/iter_0000100 --out hf/x-100
    python tools/export_run_to_hf.py --run-dir runs/fipo_qwen25_32b_lora --out hf/lora --adapter

A LoRA run (``model.lora.rank`` > 0) is exported as its base with the adapters merged in, or with
``--adapter`` as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, for
``peft.PeftModel.from_pretrained`` or vLLM's LoRA serving on the base model).
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a run directory: its newest complete checkpoint is exported")
    src.add_argument("--checkpoint", help="one checkpoint folder <run>/checkpoints/iter_N")
    p.add_argument("--out", required=True, help="output HF folder (not inside the checkpoint)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace HF files in --out that no earlier export wrote (default: refuse)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT adapter instead of the merged model")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from megatron_credit.conversion.run_export import export_run_checkpoint, newest_checkpoint

    ckpt = args.checkpoint or newest_checkpoint(args.run_dir)
    files = export_run_checkpoint(ckpt, args.out, run_dir=args.run_dir, overwrite=args.overwrite,
                                  adapter=args.adapter)
    what = "the PEFT adapter" if args.adapter else f"{len(files)} shard(s)"
    print(f"wrote {what} of {ckpt} to {args.out}")
    return 0


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
