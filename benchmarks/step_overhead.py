"""What a credit method costs in a training step, as ratios to its baseline on the same batch and model.

Pairs (``--pairs``, default both):
- ``fipo/dapo``: FIPO adds the Future-KL scan over the log-ratio inside the loss (goal: under 1.02);
- ``comppo/ppo``: CompPO adds the final layer's attention statistics (concentration and top-K keys,
  computed in the behaviour pass from that layer's own q/k) and the transport-aligned critic, over PPO
  with a value head (goal: under 1.10).

Each method runs the trainer's own parts in this process, alternating, after a warm-up round: the
behaviour pass (old log-probs, values, gates), the advantages, and one optimizer step
(``update_minibatch``: forward, log-probs from hidden states, loss, backward, gradient reduction, AdamW).
Printed: median seconds of the update and of the whole step for each, and their ratios (these machines
are noisy: compare ratios, not seconds).

    python benchmarks/step_overhead.py [--pairs fipo/dapo,comppo/ppo] [--rows 16] [--seq 1024] [--hidden 256]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="fipo/dapo,comppo/ppo")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.batch.train_batch import TrainBatch
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple
    from megatron_credit.metrics.sums import StatSums

    arch = dict(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=args.seq, rope_theta=1e4, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
    pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
    names = sorted({n for p in pairs for n in p})
    ctxs = {}
    for name in names:
        recipe = recipe_from_dict({"model": {"architecture": arch}, "algorithm": {"name": name},
                                   "rollout": {"prompts_per_step": args.rows // 4, "n": 4,
                                               "max_response_len": args.seq},
                                   "train": {"num_minibatches": 1, "max_tokens_per_microbatch": 1 << 30}})
        if not ctxs:
            device = distributed.initialize(recipe.parallel, seed=0)
        algorithm = recipe.algorithm.build()
        actor = Actor(hf_config=recipe.model.hf_config(), **actor_settings(recipe), device=device,
                      with_reference=False,
                      **algorithm.actor_options(recipe.model.hf_config(), dtype=torch.float32))
        actor.load_initial_weights(seed=0)
        ctxs[name] = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None, pad_id=0,
                             seq_multiple=seq_multiple(recipe.parallel))
    g = torch.Generator().manual_seed(0)
    b, t = args.rows, args.seq

    def fresh_batch():
        g.manual_seed(0)
        ids = torch.randint(1, args.vocab, (b, t), generator=g)
        mask = torch.arange(t)[None].expand(b, -1) >= t // 8
        return TrainBatch(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=mask & (torch.arange(t) < t - 1),
                          rollout_logp=torch.zeros(b, t), seq_lens=torch.full((b,), t),
                          group_ids=torch.arange(b) // 4, rewards=torch.randn(b, generator=g).sign(),
                          correct=torch.zeros(b, dtype=torch.bool))

    update_s = {k: [] for k in ctxs}
    step_s = {k: [] for k in ctxs}
    for rep in range(args.repeats + 1):
        for name, ctx in ctxs.items():
            batch = fresh_batch()
            t0 = time.perf_counter()
            plan = step.plan_microbatches(ctx, batch)
            step.behaviour_pass(ctx, batch, plan)
            step.compute_advantages(ctx, batch, 2)
            # A policy that has moved: old log-probs shifted so that FIPO's weights are not all 1.
            batch.old_logp = batch.old_logp - 0.05 * torch.rand(b, t, generator=g)
            t1 = time.perf_counter()
            step.update_minibatch(ctx, batch, plan[0], StatSums())
            t2 = time.perf_counter()
            if rep:  # the first round warms up
                update_s[name].append(t2 - t1)
                step_s[name].append(t2 - t0)
    med = lambda d, k: statistics.median(d[k])  # noqa: E731
    print(f"{b} x {t} tokens, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"median of {args.repeats}")
    for new, base in pairs:
        print(f"{new}/{base}: update {med(update_s, new):.3f}s / {med(update_s, base):.3f}s = "
              f"{med(update_s, new) / med(update_s, base):.3f}; whole step {med(step_s, new):.3f}s / "
              f"{med(step_s, base):.3f}s = {med(step_s, new) / med(step_s, base):.3f}")
    distributed.destroy(process_group=True)


if __name__ == "__main__":
    main()
