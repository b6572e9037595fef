"""Peak memory of the converters against the checkpoint size, on a locally generated random model.

    python benchmarks/conversion_memory.py [--layers 18 --hidden 2048 ...] [--workdir /tmp/conv_bench]

Generates a random Qwen2-architecture HF checkpoint in bf16 (~1B parameters by default, written
tensor by tensor), then runs ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``
each in a subprocess and reads that process's peak RSS (``os.wait4`` rusage). A baseline process that
only imports what the converter imports gives the fixed cost. The claim checked: peak minus baseline
stays near one model copy (the model being built) and far below two.
Figures are for this machine's Python/torch; the baseline includes torch, megatron-core and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _run(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd``; return (peak RSS in GiB of that process, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed with exit code {proc.returncode}")
    return usage.ru_maxrss / 2**20, time.time() - t0  # ru_maxrss is KiB on Linux


def _generate(args: argparse.Namespace, out: Path) -> None:
    import torch

    from megatron_credit.conversion.testing import tiny_hf_config, write_random_hf_checkpoint

    cfg = tiny_hf_config("qwen2", num_hidden_layers=args.layers, hidden_size=args.hidden,
                         intermediate_size=args.ffn, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, max_position_embeddings=4096)
    write_random_hf_checkpoint(cfg, out, dtype=torch.bfloat16, max_shard_bytes=1 << 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", default="/tmp/conv_bench")
    p.add_argument("--keep", action="store_true", help="keep the generated folders")
    p.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    work = Path(args.workdir)
    if args.generate_only:
        _generate(args, work / "hf")
        return
    # This process stays small (stdlib only) and runs everything in children: Linux carries a parent's
    # RSS high-water mark into a forked child's ru_maxrss, so a big parent would inflate the figures.
    shutil.rmtree(work, ignore_errors=True)
    _, gen_s = _run([sys.executable, "-W", "ignore", __file__, "--generate-only", *sys.argv[1:]])
    nbytes = json.loads((work / "hf" / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    params = nbytes // 2
    baseline, _ = _run([sys.executable, "-W", "ignore", "-c",
                        "import megatron_credit.conversion.converters, megatron.core.dist_checkpointing, "
                        "megatron.core.models.gpt, transformers, megatron_credit.models"])
    to_mc, to_mc_s = _run([sys.executable, "-W", "ignore", "tools/convert_hf_to_megatron.py", "--hf-dir",
                           str(work / "hf"), "--out", str(work / "mc"), "--no-progress"])
    to_hf, to_hf_s = _run([sys.executable, "-W", "ignore", "tools/convert_megatron_to_hf.py", "--ckpt",
                           str(work / "mc"), "--out", str(work / "hf_back"), "--max-shard-size", "1GiB",
                           "--no-progress"])
    size_gib = nbytes / 2**30
    result = {
        "parameters": params, "checkpoint_gib": round(size_gib, 3), "generate_s": round(gen_s, 1),
        "baseline_rss_gib": round(baseline, 3),
        "hf_to_megatron": {"peak_rss_gib": round(to_mc, 3), "above_baseline_x_ckpt": round((to_mc - baseline) / size_gib, 2),
                           "seconds": round(to_mc_s, 1)},
        "megatron_to_hf": {"peak_rss_gib": round(to_hf, 3), "above_baseline_x_ckpt": round((to_hf - baseline) / size_gib, 2),
                           "seconds": round(to_hf_s, 1), "max_shard_gib": 1.0},
    }
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
