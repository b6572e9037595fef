"""CPU rollout throughput of the "hf" engine on a tiny model: response tokens/s at n samples per prompt.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_cpu.py --n 8 --prompts 16 --max-new-tokens 64

Prompts come from the synthetic arithmetic task (``megatron_credit.data.synthetic``), chat-templated and
encoded with its sentencepiece tokenizer (``megatron_credit.data.tokenizer``), when those exist, and
are random tokens otherwise. No stop tokens by default, so every sample decodes exactly ``max_new_tokens``
tokens and the figure is the steady-state decode rate (``--stop-tokens K`` makes lengths vary).
``--compare-generate`` also times ``model.generate`` of `transformers` with the same sampling settings
(num_return_sequences = n, no log-probs) as a reference point.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def model_config(size: str):
    """"tiny": the project's CPU model (``config.TINY_QWEN2``, the demo's actor); "small": a 4M-parameter Qwen2."""
    from transformers import Qwen2Config

    if size == "tiny":
        from megatron_credit.recipe.config import TINY_QWEN2

        return Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k != "model_type"})
    return Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=True)


def make_prompts(num: int, vocab: int, seed: int) -> tuple[list[list[int]], str]:
    """Chat-templated arithmetic prompts in the task tokenizer's ids; random tokens if those modules are absent."""
    try:
        from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
        from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer
    except ImportError:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
                for _ in range(num)], "random tokens"
    tok = load_arith_tokenizer(ArithTokenizerConfig())
    if tok.vocab_size > vocab:
        raise ValueError(f"the task tokenizer has {tok.vocab_size} ids but the model only {vocab}")
    task = ArithmeticTask(ArithConfig(seed=seed, num_operands=3))
    prompts = [tok.apply_chat_template([{"role": "user", "content": task.problem(i).question}], tokenize=True)
               for i in range(num)]
    return prompts, f"synthetic arithmetic, task tokenizer (vocab {tok.vocab_size})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--stop-tokens", type=int, default=0,
                    help="treat token ids 0..K-1 as stop tokens (variable lengths; exercises row compaction)")
    ap.add_argument("--no-compact", action="store_true", help="keep finished rows in the batch")
    ap.add_argument("--compare-generate", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_credit.rollout import HFRolloutEngine, SamplingParams

    cfg = model_config(args.size)
    engine = HFRolloutEngine(hf_config=cfg, init_seed=0, compact_finished=not args.no_compact)
    prompts, source = make_prompts(args.prompts, cfg.vocab_size, seed=0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=args.max_new_tokens, n=args.n, seed=0,
                            stop_token_ids=tuple(range(args.stop_tokens)))
    n_params = sum(p.numel() for p in engine.model.parameters())
    print(f"model: {args.size} Qwen2, {n_params / 1e6:.2f}M params; prompts: {len(prompts)} ({source}), n={args.n}, "
          f"max_new_tokens={args.max_new_tokens}, stop tokens={args.stop_tokens}, threads={torch.get_num_threads()}")
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, n=2, seed=0))  # warm-up
    rates = []
    for r in range(args.repeats):
        batch = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": r}))
        rates.append(batch.response_tokens_per_s)
        print(f"  run {r}: {batch.num_response_tokens} response tokens in {batch.wall_s:.2f}s "
              f"= {batch.response_tokens_per_s:.0f} tokens/s")
    print(f"hf engine: median {statistics.median(rates):.0f} response tokens/s ({len(prompts) * args.n} rows)")

    if args.compare_generate:
        ids = torch.zeros((len(prompts), max(map(len, prompts))), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, ids.shape[1] - len(p):], mask[i, ids.shape[1] - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            start = time.perf_counter()
            out = engine.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, top_p=0.95, top_k=0, temperature=1.0,
                max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                num_return_sequences=args.n, pad_token_id=0)
            wall = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
        print(f"transformers generate (no log-probs): {tokens} tokens in {wall:.2f}s = {tokens / wall:.0f} tokens/s")


if __name__ == "__main__":
    main()
