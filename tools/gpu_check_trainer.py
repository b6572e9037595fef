"""The trainer parts of ``tools/gpu_check.sh``: ``pretrain_rl.py`` itself on one GPU (issue 23).

    python tools/gpu_check_trainer.py recipe NAME DIR   # write DIR/recipe.yaml (+ DIR/hf/config.json); no GPU
    python tools/gpu_check_trainer.py run NAME DIR      # write it, train, print the numbers

NAME:

- ``demo_hf`` / ``demo_vllm``: ``examples/demo_cpu.yaml`` with GPU overrides (bf16, the Transformer
  Engine spec when TE imports, else the local spec and the report says so; 3 iterations, no warm-up,
  validation or checkpoints), the HF engine / vLLM (colocated, ``gpu_memory_utilization`` 0.2);
- ``llama1b_hf`` / ``llama1b_vllm``: Llama-3.2-1B's shape (``_llama_1b_architecture``, random init) at
  4,096-token responses (random weights never stop early) for 2 iterations, GRPO, 8 rows per
  iteration with the HF engine, 32 with vLLM.

vLLM reads a checkpoint folder, so the vLLM recipes name ``DIR/hf`` (``model.name_or_path``): ``run``
writes random bf16 weights there, ``recipe`` only its ``config.json`` (what ``--dry-run`` and the
planner need: ``tests/tools/test_gpu_check_recipes.py`` plans every recipe on CPU).

``run`` calls ``pretrain_rl.main`` in this process, then prints: per iteration the rollout tokens/s
(one GPU: per GPU), ``mismatch/logprob_abs_mean`` (engine vs trainer log-probs) from ``metrics.jsonl``;
this process's peak ``torch.cuda.max_memory_allocated`` against the planner's estimate
(``megatron_credit.planning.plan`` on one H200: its train peak, and its rollout peak with the HF
engine; a vLLM engine's memory lives in its own processes). Exit 0 passed, 1 failed, 77 skipped (the
last line says why).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SKIP = 77
NAMES = ("demo_hf", "demo_vllm", "llama1b_hf", "llama1b_vllm")
GPU = "h200"


def _llama_1b_architecture() -> dict:
    """Llama-3.2-1B's config.json numbers (tied head, llama3 RoPE scaling), bf16."""
    return {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "torch_dtype": "bfloat16"}


def recipe_dict(name: str, *, te: bool, hf_dir: str) -> dict:
    """The recipe of part ``name`` as a dict (``te``: the Transformer Engine spec, else local)."""
    import yaml

    if name not in NAMES:
        raise ValueError(f"unknown part {name!r}; one of {NAMES}")
    base = yaml.safe_load((REPO / "examples" / "demo_cpu.yaml").read_text())
    r = copy.deepcopy(base)
    vllm = name.endswith("_vllm")
    r["model"]["params_dtype"] = "bfloat16"
    r["model"]["transformer_impl"] = "transformer_engine" if te else "local"
    r["cluster"] = {"nodes": 1, "gpus_per_node": 1, "gpu": GPU}
    r["warmup"] = {"steps": 0}
    r["checkpoint"] = {"every": 0, "save_at_end": False}
    r["logging"] = {"tensorboard": False, "progress": False, "plots": False}
    r["train"].update(val_every=0)
    if name.startswith("demo"):
        r["train"]["steps"] = 3
    else:
        arch = _llama_1b_architecture()
        r["model"]["architecture"] = arch
        r["algorithm"] = {"name": "grpo"}
        r["rollout"].update(prompts_per_step=8 if vllm else 4, n=4 if vllm else 2, max_response_len=4096)
        r["train"].update(steps=2, num_minibatches=2, max_tokens_per_microbatch=8192, logprob_chunk_size=1024)
        r["optim"] = {"lr": 1.0e-6, "clip_grad": 1.0}
    if vllm:
        arch = r["model"].pop("architecture")
        r["model"]["name_or_path"] = hf_dir
        r["rollout"]["engine"] = "vllm"
        max_len = arch["max_position_embeddings"] if name.startswith("demo") else 4096 + 128
        r["rollout"]["engine_options"] = {"gpu_memory_utilization": 0.2 if name.startswith("demo") else 0.3,
                                          "engine_kwargs": {"max_model_len": max_len, "enforce_eager": True}}
        r["_architecture"] = arch  # written to hf_dir by write(), popped there
    else:
        r["rollout"]["engine"] = "hf"
    return r


def write(name: str, out_dir: str, *, te: bool, weights: bool) -> Path:
    """Write ``out_dir/recipe.yaml`` (and for vLLM ``out_dir/hf``: config.json, random weights when
    ``weights``); returns the recipe's path."""
    import yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    r = recipe_dict(name, te=te, hf_dir=str(out / "hf"))
    arch = r.pop("_architecture", None)
    if arch is not None:
        import torch
        from transformers import AutoConfig

        from megatron_credit.conversion.testing import write_random_hf_checkpoint

        fields = {k: v for k, v in arch.items() if k != "model_type"}
        cfg = AutoConfig.for_model(arch["model_type"], **fields)
        if weights:
            write_random_hf_checkpoint(cfg, out / "hf", dtype=torch.bfloat16, seed=0)
        else:
            (out / "hf").mkdir(exist_ok=True)
            (out / "hf" / "config.json").write_text(json.dumps({**cfg.to_dict(), "dtype": "bfloat16"}, indent=1))
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run(name: str, out_dir: str) -> int:
    import torch

    if not torch.cuda.is_available():
        print("skipped: CUDA is not available to torch")
        return SKIP
    from megatron_credit.device_fields import transformer_engine_importable

    te = transformer_engine_importable()
    if name.endswith("_vllm"):
        try:
            import vllm  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"skipped: vLLM does not import here ({type(exc).__name__}: {str(exc)[:120]})")
            return SKIP
    t0 = time.perf_counter()
    recipe_path = write(name, out_dir, te=te, weights=True)
    print(f"- recipe {recipe_path} ({'TE spec' if te else 'local spec: Transformer Engine does not import'}, bf16, "
          f"written in {time.perf_counter() - t0:.0f} s)")
    import pretrain_rl
    from megatron_credit.config import load_recipe
    from megatron_credit.planning import plan

    run_dir = Path(out_dir) / "run"
    torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    rc = pretrain_rl.main(["--config", str(recipe_path), "--output-dir", str(run_dir), "--resume", "none"])
    wall = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated()
    rows = _rows(run_dir)
    print(f"- pretrain_rl.py exit {rc}, {len(rows)} iteration(s) in {wall:.0f} s")
    for row in rows:
        print(f"  - iteration {row.get('step')}: {row.get('throughput/tokens_per_s', float('nan')):.0f} tokens/s/GPU, "
              f"step {row.get('time/step_s', float('nan')):.1f} s, mismatch/logprob_abs_mean "
              f"{row.get('mismatch/logprob_abs_mean', float('nan')):.3e}, reward {row.get('reward/mean', float('nan')):.3f}")
    recipe = load_recipe(str(recipe_path))
    p = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=1, gpu=GPU)
    gib = 1024 ** 3
    est = p.rollout_peak if name.endswith("_hf") else p.train_peak
    print(f"- peak memory of the trainer process {peak / gib:.2f} GiB; planner: train peak {p.train_peak / gib:.2f} "
          f"GiB, rollout peak {p.rollout_peak / gib:.2f} GiB ({'HF engine in-process' if name.endswith('_hf') else 'vLLM in its own processes: compare with the train peak'}); "
          f"measured / planned {peak / max(est, p.train_peak):.2f}")
    want = 3 if name.startswith("demo") else 2
    if rc not in (0, None) or len(rows) != want:
        print(f"failed: expected {want} iterations with exit 0")
        return 1
    if any(not (row.get("mismatch/logprob_abs_mean", float("nan")) >= 0) for row in rows):
        print("failed: mismatch/logprob_abs_mean missing or not a number")
        return 1
    if peak > p.gpu_bytes:
        print("failed: the peak exceeds the GPU")
        return 1
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ("recipe", "run") or argv[1] not in NAMES:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    cmd, name, out_dir = argv
    if cmd == "recipe":
        print(write(name, out_dir, te=True, weights=False))
        return 0
    return run(name, out_dir)


if __name__ == "__main__":
    sys.exit(main())
