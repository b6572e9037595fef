"""FIPO's cost in a training step, as a ratio to DAPO's (goal: under 1.02).

Both run the trainer's own ``update_minibatch`` (forward, log-probs from hidden states, loss, backward,
gradient reduction, AdamW) on the same batch and model in this process, alternating, after a warm-up;
FIPO adds the Future-KL scan over the log-ratio inside the loss. Printed: the median seconds of each and
their ratio (these machines are noisy: compare ratios, not seconds).

    python benchmarks/step_overhead.py [--rows 16] [--seq 1024] [--hidden 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from megatron_credit import distributed
    from megatron_credit.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.batch import TrainBatch
    from megatron_credit.trainer.loop import Context, seq_multiple
    from megatron_credit.trainer.metrics import StatSums

    arch = dict(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=args.seq, rope_theta=1e4, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
    ctxs = {}
    for name in ("dapo", "fipo"):
        recipe = recipe_from_dict({"model": {"architecture": arch}, "algorithm": {"name": name},
                                   "rollout": {"prompts_per_step": args.rows // 4, "n": 4,
                                               "max_response_len": args.seq},
                                   "train": {"num_minibatches": 1, "max_tokens_per_microbatch": 1 << 30}})
        if not ctxs:
            distributed.initialize(recipe.parallel, seed=0)
        spec, params = recipe.algorithm.spec_and_params()
        actor = Actor(hf_config=recipe.model.hf_config(), recipe=recipe, with_critic=False, with_reference=False)
        actor.load_initial_weights(seed=0)
        ctxs[name] = Context(recipe=recipe, spec=spec, params=params, actor=actor, rollouts=None, pad_id=0,
                             seq_multiple=seq_multiple(recipe.parallel))
    g = torch.Generator().manual_seed(0)
    b, t = args.rows, args.seq
    ids = torch.randint(1, args.vocab, (b, t), generator=g)
    mask = torch.arange(t)[None].expand(b, -1) >= t // 8
    batch = TrainBatch(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=mask, rollout_logp=torch.zeros(b, t),
                       seq_lens=torch.full((b,), t), group_ids=torch.arange(b) // 4,
                       rewards=torch.randn(b, generator=g).sign(), correct=torch.zeros(b, dtype=torch.bool))
    plan = step.plan_microbatches(ctxs["dapo"], batch)
    step.behaviour_pass(ctxs["dapo"], batch, plan)
    step.compute_advantages(ctxs["dapo"], batch)
    # A policy that has moved: old log-probs shifted so that FIPO's weights are not all 1.
    batch.old_logp = batch.old_logp - 0.05 * torch.randn(b, t, generator=g).abs()
    times = {k: [] for k in ctxs}
    for rep in range(args.repeats + 1):
        for name, ctx in ctxs.items():
            t0 = time.perf_counter()
            step.update_minibatch(ctx, batch, plan[0], StatSums())
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"update step, {b} x {t} tokens, hidden {args.hidden}, vocab {args.vocab}: "
          f"dapo {med['dapo']:.3f}s  fipo {med['fipo']:.3f}s  fipo/dapo = {med['fipo'] / med['dapo']:.3f} "
          f"(goal < 1.02)")
    distributed.destroy(process_group=True)


if __name__ == "__main__":
    main()
