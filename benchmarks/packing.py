"""Packed against padded micro-batches on a FIPO-like length mix: tokens computed per useful token and the
update's time, at PP = 1 and PP = 2 (CPU, gloo), as ratios measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py [--cap 2048] [--samples 32] [--repeats 2]

The batch: ``--samples`` responses of lengths log-uniform between ``cap / 40`` and ``cap`` (FIPO's runs
span about that range under a 20K cap), each after a prompt of about 300 tokens, on a 4-layer model
(hidden 128) small enough for 2 cores. One mini-batch, ``max_tokens_per_microbatch`` = 4 x ``cap``. The
trainer's own parts run it (``trainer/step.py``: the behaviour pass, then the update of one mini-batch),
once with ``train.packing=false`` (rows padded to the longest of each micro-batch; under PP every
micro-batch padded to the largest row count and length of the mini-batch, the one shape megatron's
pipeline sends) and once packed (first-fit decreasing, no padding rows; under PP each micro-batch's own
shape goes first). It prints, per PP size: computed / useful tokens of each form (padded, packed), the packed padding
fraction, and the update time (best of ``--repeats``) with the ratio padded / packed.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARCH = dict(model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def length_mix(samples: int, cap: int, *, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt lengths about 300, response lengths log-uniform in ``[cap / 40, cap]``) of ``samples``.

    >>> p, r = length_mix(4, 2048)
    >>> all(250 <= n <= 350 for n in p), all(51 <= n <= 2048 for n in r)
    (True, True)
    """
    import random

    rng = random.Random(seed)
    prompts = [rng.randint(250, 350) for _ in range(samples)]
    lo, hi = math.log(cap / 40), math.log(cap)
    return prompts, [int(round(math.exp(rng.uniform(lo, hi)))) for _ in range(samples)]


def _batch(prompts, responses, vocab: int):
    import torch

    from megatron_credit.batch.train_batch import TrainBatch

    b = len(prompts)
    lens = torch.tensor(prompts) + torch.tensor(responses)
    t = int(lens.max())
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(t)
    ids = torch.where(pos[None] < lens[:, None], torch.randint(1, vocab, (b, t), generator=g), 0)
    labels = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=torch.long)], dim=1)
    prompt = torch.tensor(prompts)
    mask = (pos[None] >= prompt[:, None] - 1) & (pos[None] < lens[:, None] - 1)
    correct = torch.arange(b) % 2 == 0
    return TrainBatch(input_ids=ids, labels=labels, loss_mask=mask, rollout_logp=torch.zeros(b, t), seq_lens=lens,
                      group_ids=torch.arange(b) // 4, rewards=correct.float() * 2 - 1, correct=correct)


def _worker(rank: int, world: int, port: int, packing: bool, args, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple
    from megatron_credit.metrics.sums import StatSums

    recipe = recipe_from_dict({
        "model": {"architecture": ARCH}, "parallel": {"pipeline_model_parallel_size": world},
        "algorithm": {"name": "fipo"}, "rollout": {"prompts_per_step": args.samples // 4, "n": 4,
                                                   "max_response_len": args.cap},
        "train": {"num_minibatches": 1, "max_tokens_per_microbatch": 4 * args.cap,
                  "packing": packing}})
    device = distributed.initialize(recipe.parallel, seed=0, launch=distributed.LaunchEnv(
        rank=rank, world_size=world, master_port=port))
    try:
        algorithm = recipe.algorithm.build()
        hf = recipe.model.hf_config()
        actor = Actor(hf_config=hf, **actor_settings(recipe), device=device, with_reference=False,
                      **algorithm.actor_options(hf, dtype=torch.float32, pp_size=world))
        actor.load_initial_weights(seed=0)
        ctx = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None,
                      pad_id=0, seq_multiple=seq_multiple(recipe.parallel))
        batch = _batch(*length_mix(args.samples, args.cap), ARCH["vocab_size"])
        plan = step.plan_microbatches(ctx, batch)
        step.behaviour_pass(ctx, batch, plan)
        step.compute_advantages(ctx, batch)
        times = []
        for _ in range(args.repeats):
            stats = StatSums()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step.update_minibatch(ctx, batch, plan[0], stats)
            torch.distributed.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            v = stats.values
            results.put({"seconds": min(times), "computed": float(v["sum:computed_tokens"]),
                         "padding": float(v["sum:padding_tokens"]), "microbatches": len(plan[0])})
    finally:
        distributed.destroy(process_group=True)


def measure(world: int, packing: bool, args) -> dict:
    from benchmarks.step_time import spawn_world

    return spawn_world(_worker, world, packing, args, timeout=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=2048, help="the response-length cap")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    prompts, responses = length_mix(args.samples, args.cap)
    useful = sum(prompts) + sum(responses)
    print(f"{args.samples} samples, responses {min(responses)}-{max(responses)} tokens (cap {args.cap}), "
          f"prompts {min(prompts)}-{max(prompts)}: {useful} useful tokens; budget {4 * args.cap} tokens per micro-batch")
    for pp in args.pp:
        padded, packed = measure(pp, False, args), measure(pp, True, args)
        print(f"PP={pp}: tokens computed per useful token: padded {padded['computed'] / useful:.2f} "
              f"({padded['microbatches']} micro-batches), packed {packed['computed'] / useful:.2f} "
              f"({packed['microbatches']} micro-batches); packed padding {packed['padding'] / packed['computed']:.1%}")
        print(f"PP={pp}: update time: padded {padded['seconds']:.2f} s, packed {packed['seconds']:.2f} s, "
              f"ratio padded / packed = {padded['seconds'] / packed['seconds']:.2f}")


if __name__ == "__main__":
    main()
