"""Entry point: ``torchrun [...] pretrain_rl.py --config examples/<recipe>.yaml key.sub=value ...``.

The launcher's environment and argv are read here and nowhere else. Until the RL trainer lands this
runs the actor smoke job: it builds the actor of the recipe under its TP / PP / CP / DP layout,
takes ``smoke.steps`` real optimizer steps (megatron forward-backward schedule, token-mean
next-token loss over the global batch, AdamW) on a synthetic learnable token pattern, prints the
loss of every step, and exits non-zero unless the loss went down.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import torch


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML recipe")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    return parser.parse_args(argv)


def synthetic_tokens(*, batch: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len + 1]`` tokens of a learnable pattern: each row counts up by a fixed stride
    from a random start, so the next token is a function of the current one.

    >>> synthetic_tokens(batch=1, seq_len=3, vocab=10, seed=0).shape
    torch.Size([1, 4])
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + 3 * torch.arange(seq_len + 1)) % vocab


def run_actor_smoke(recipe, hf_config, *, log=print) -> list[float]:
    """Train the actor for ``recipe.smoke.steps`` steps; return the global loss of each step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_credit import distributed
    from megatron_credit.data.context_parallel import split_for_cp
    from megatron_credit.losses.logprob import logprobs_and_entropy
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from megatron_credit.models.cpu_attention import load_balanced_positions

    smoke, parallel = recipe.smoke, recipe.parallel
    # Loss scale: loss_func returns -sum(logp) / global_tokens over this rank's tokens, where
    # global_tokens counts the tokens of every DP x CP rank; finalize_gradients sums gradients over
    # DP x CP, so the result is the gradient of the global token mean. calculate_per_token_loss=True
    # stops megatron's schedule (forward_step) from dividing it again by the token count loss_func
    # returns and by num_microbatches.
    config = transformer_config_from_hf(hf_config, parallel=parallel,
                                        params_dtype=recipe.model.torch_dtype(),
                                        calculate_per_token_loss=True)
    model = build_gpt_model(hf_config, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=smoke.lr, weight_decay=0.0)
    tp_group = ps.get_tensor_model_parallel_group()
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    dp, cp = ps.get_data_parallel_world_size(), parallel.context_parallel_size
    if smoke.seq_length % (2 * cp):
        raise ValueError(f"smoke.seq_length={smoke.seq_length} must be divisible by 2 x "
                         f"parallel.context_parallel_size={cp}")
    cp_rank = ps.get_context_parallel_rank()
    pos = load_balanced_positions(smoke.seq_length // cp, cp_rank=cp_rank, cp_size=cp)
    global_tokens = smoke.micro_batch_size * dp * smoke.seq_length
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    losses = []
    for step in range(smoke.steps):
        # Each DP rank draws its own rows; CP ranks of one DP rank share them and keep their chunks.
        tokens = synthetic_tokens(batch=smoke.micro_batch_size, seq_len=smoke.seq_length,
                                  vocab=hf_config.vocab_size,
                                  seed=recipe.seed + 1000 * step + ps.get_data_parallel_rank())
        # Shift before the CP split: a chunk's last label is the next chunk's first token.
        ids, labels = (split_for_cp(t, cp_size=cp, cp_rank=cp_rank)
                       for t in (tokens[:, :-1], tokens[:, 1:]))

        def loss_func(logits):
            logp, _ = logprobs_and_entropy(logits, labels, tp_group=tp_group)
            loss = -logp.sum() / global_tokens
            return loss, torch.tensor(labels.numel(), dtype=torch.int), {"loss": loss.detach()}

        def forward_step(data_iterator, model_chunk):
            return model_chunk(next(data_iterator), pos.expand(ids.shape[0], -1), None), loss_func

        optimizer.zero_grad(set_to_none=True)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model],
            # The global length: megatron's get_tensor_shapes divides it by the CP size itself.
            num_microbatches=1, seq_length=smoke.seq_length, micro_batch_size=ids.shape[0],
            forward_only=False)
        distributed.finalize_gradients(
            model, dp_cp_group=dp_cp_group, tp_group=tp_group,
            embedding_group=ps.get_embedding_group() if ps.is_rank_in_embedding_group() else None)
        optimizer.step()
        loss = out[0]["loss"] if last_stage else torch.zeros(())
        dist.all_reduce(loss, group=dp_cp_group)
        # Only last-stage ranks hold a loss; MAX over the world hands it to every rank.
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        losses.append(float(loss))
        log(f"step {step + 1}/{smoke.steps} loss {losses[-1]:.4f}")
    return losses


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from megatron_credit import distributed
    from megatron_credit.config import load_recipe
    from megatron_credit.models import check_parallel_fits_model

    recipe = load_recipe(args.config, overrides=args.overrides)
    launch = distributed.LaunchEnv.from_environ(os.environ)
    hf_config = recipe.model.hf_config()
    # Refuse impossible layouts before any process group or model exists.
    check_parallel_fits_model(hf_config, recipe.parallel, world_size=launch.world_size)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    distributed.initialize(recipe.parallel, seed=recipe.seed, launch=launch)
    rank0 = launch.rank == 0
    t0 = time.perf_counter()
    losses = run_actor_smoke(recipe, hf_config, log=print if rank0 else (lambda *_: None))
    distributed.destroy(process_group=True)
    ok = losses[-1] < losses[0]
    if rank0:
        print(f"actor smoke run: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps, "
              f"{time.perf_counter() - t0:.1f}s: "
              f"{'loss went down' if ok else 'FAILED: loss did not go down'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
