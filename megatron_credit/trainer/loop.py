"""The trainer: build everything once, then iterate (``pretrain_rl.py`` calls :func:`train`).

Per iteration: :func:`megatron_credit.trainer.step.rl_iteration`, then metrics (``metrics.jsonl``,
TensorBoard, wandb, the progress bar), validation and checkpoints. ``--resume auto`` loads the newest
complete checkpoint (model, optimizer, RNG states, data cursors, step) and continues exactly where it
stopped: sampling seeds are functions of the iteration, so N + resume + N steps equal 2N steps.
An exit signal (``checkpoint.exit_signals``: SIGTERM, a scheduler's pre-emption, and SIGUSR1, Slurm's
warning ahead of the time limit) finishes the current iteration on every rank, saves it, and returns
(``trainer/stop.py``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_credit.algorithm.knobs import base_knobs
from megatron_credit.trainer import checkpoint as ckpt
from megatron_credit.trainer.context import Context, PhaseTimer  # noqa: F401  (Context: re-exported)
from megatron_credit.data.setup import build_data, hf_tokenizer  # noqa: F401  (hf_tokenizer: re-exported)
from megatron_credit.metrics.writer import MetricsWriter
from megatron_credit.trainer.plots import plot_metrics
from megatron_credit.trainer.stop import ExitSignals


def seq_multiple(parallel) -> int:
    """Micro-batch lengths are multiples of this: 2 x CP (x TP with sequence parallelism), 1 without."""
    from megatron_credit.batch.context_parallel import required_multiple

    if parallel.context_parallel_size == 1 and not parallel.sequence_parallel:
        return 1
    return required_multiple(parallel.context_parallel_size, parallel.tensor_model_parallel_size,
                             parallel.sequence_parallel)


def _dp_ranks_and_node(dp_rank: int, local_rank: int | None = None) -> tuple[list[int], int, int]:
    """(the data-parallel rank of every rank, this rank's local rank, the ranks of its node): gathered once,
    for the engine placement (``rollout.placement``) and the routing of samples. ``local_rank``: the launcher's
    (``LOCAL_RANK``, the device ``distributed.initialize`` took), read at the entry point; without it, the
    rank's place among the ranks of its host (torchrun numbers ranks node by node)."""
    import socket

    mine = (dp_rank, socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    # NCCL: the pickled tuples travel on torch.cuda.current_device(), set by distributed.initialize
    dist.all_gather_object(everyone, mine)
    node = [r for r, (_, host) in enumerate(everyone) if host == mine[1]]
    return [d for d, _ in everyone], node.index(dist.get_rank()) if local_rank is None else local_rank, len(node)


def check_recipe(recipe, hf_config, *, world_size: int) -> dict[str, int]:
    """Cross-section checks that need the world size (``Recipe.validate``); returns the layout. Raises
    ValueError."""
    return recipe.validate(world_size=world_size, arch=hf_config)


@dataclasses.dataclass
class Run:
    """What :func:`build` makes for one launch: the iteration's context and what the loop saves with it."""

    ctx: Context
    """Actor, critic, rollouts, knobs, controls (``step.py``'s input)."""
    prompts: Any
    """The training prompt stream (its cursor is checkpointed)."""
    task: Any
    """The synthetic task (the warm-up's), or None."""
    tokenizer: Any
    """The tokenizer of the prompts and the engine."""
    layout: dict[str, int]
    """``{"tp", "pp", "cp", "dp"}`` of this launch."""
    checkpoint: str | None
    """The checkpoint this launch resumes from (every file checked), or None."""


def actor_settings(recipe) -> dict:
    """The recipe's sections and values an :class:`~megatron_credit.trainer.actor.Actor` (and a separate
    critic) reads: ``model``, ``parallel``, ``optim``, the run's seed, the sampling temperature and the
    ``train`` fields of the forward pass (``packed_sequences``: ``recipe.packing``) and ``moe``."""
    return {"model": recipe.model, "parallel": recipe.parallel, "optim": recipe.optim, "seed": recipe.seed,
            "temperature": recipe.rollout.temperature, "recompute": recipe.train.recompute,
            "logprob_chunk_size": recipe.train.logprob_chunk_size, "packed_sequences": recipe.packing,
            "moe": recipe.moe}


def off_policy_algorithm(recipe):
    """The recipe's ``algorithm`` section as the update reads it: with samples that may be stale
    (``rollout.staleness_bound`` > 0) and ``tis_cap`` unset, the decoupled objective's importance weights
    are truncated at ``OFF_POLICY_TIS_CAP``."""
    from megatron_credit.recipe.sections import OFF_POLICY_TIS_CAP

    alg = recipe.algorithm
    if recipe.rollout.staleness_bound > 0 and alg.tis_cap is None:
        return dataclasses.replace(alg, tis_cap=OFF_POLICY_TIS_CAP)
    return alg


def context_settings(recipe) -> dict:
    """The recipe's sections and values a :class:`Context` reads besides the models and the algorithm:
    ``train``, the ``algorithm`` section (:func:`off_policy_algorithm`), Dr.GRPO's length, the seed, and the
    recipe's own knobs."""
    return {"train": recipe.train, "algorithm_section": off_policy_algorithm(recipe),
            "norm_length": recipe.response_budget,
            "seed": recipe.seed,
            "base_knobs": base_knobs(kl_coef=recipe.algorithm.kl_coef,
                                     clip_grad=recipe.optim.clip_grad, epochs=recipe.train.epochs)}


def credit_maps(recipe, *, run_dir: str, tokenizer):
    """The credit-map writer of ``logging.credit_map_every`` (None: with validation), or None when off."""
    every = recipe.logging.credit_map_every
    every = recipe.train.val_every if every is None else every
    if not every:
        return None
    from megatron_credit.credit_maps.writer import CreditMaps

    return CreditMaps(run_dir, every=every, samples=recipe.logging.credit_map_samples, tokenizer=tokenizer,
                      algorithm=recipe.algorithm.name)


def build(recipe, hf_config, *, run_dir: str, device: torch.device, resume: str, log,
          local_rank: int | None = None) -> Run:
    """Check the recipe, the run directory and the checkpoint to resume (before anything is built or
    written), then build the data, the actor, a separate critic and the rollout source. The one place
    that unpacks the recipe: each component gets its own section (or explicit values). ``local_rank``: the
    launcher's (``distributed.LaunchEnv``), None where it sets none."""
    from megatron_credit.distributed import data_parallel_rank
    from megatron_credit.trainer.offload import GenerationOffload
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.critic_model import build_separate_critic
    from megatron_credit.sources import ROLLOUT_SOURCES, SourceInputs

    rank0 = dist.get_rank() == 0
    layout = check_recipe(recipe, hf_config, world_size=dist.get_world_size())
    # the run directory and the checkpoint are checked before anything is built or written
    from megatron_credit.trainer.checkpoint_check import check_fresh_run_dir

    if resume == "none":
        check_fresh_run_dir(run_dir)  # never mixes two runs in one directory
    path = ckpt.resolve(run_dir, resume, log=log if rank0 else (lambda *_: None))  # every file checked
    if rank0:
        os.makedirs(run_dir, exist_ok=True)
    algorithm = recipe.algorithm.build()
    t = recipe.train
    tokenizer, prompts, val_prompts, task = build_data(
        recipe.data, seed=recipe.seed, model_path=recipe.model.name_or_path, val_every=t.val_every,
        val_prompts=t.val_prompts, log=log if rank0 else (lambda *_: None))
    if tokenizer.vocab_size > hf_config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but model vocab_size is "
                         f"{hf_config.vocab_size}")
    settings = actor_settings(recipe)
    actor = Actor(hf_config=hf_config, device=device, with_reference=recipe.algorithm.kl_coef > 0, **settings,
                  **algorithm.actor_options(hf_config, dtype=recipe.model.torch_dtype(),
                                            pp_size=recipe.parallel.pipeline_model_parallel_size))
    critic = build_separate_critic(hf_config, algorithm, device=device, **settings)
    dp_of_rank, local_rank, node_ranks = _dp_ranks_and_node(data_parallel_rank(), local_rank)
    r = recipe.rollout
    rollouts = ROLLOUT_SOURCES.get(r.mode).build(SourceInputs(
        recipe=recipe, hf_config=hf_config, tokenizer=tokenizer, prompts=prompts, val_prompts=val_prompts,
        device=actor.device, dp_group=actor.dp_group, dp_of_rank=dp_of_rank, local_rank=local_rank,
        node_ranks=node_ranks, offload=GenerationOffload([actor, critic]), log=log))
    if rank0 and r.staleness_bound > 0 and recipe.algorithm.tis_cap is None:
        log(f"rollout.mode={r.mode}: samples up to {r.staleness_bound} versions old; the update is the "
            f"decoupled objective, importance weights capped at {off_policy_algorithm(recipe).tis_cap:g} "
            "(algorithm.tis_cap)")
    ctx = Context(algorithm=algorithm, actor=actor, rollouts=rollouts, critic=critic,
                  pad_id=tokenizer.pad_token_id, seq_multiple=seq_multiple(recipe.parallel),
                  credit_maps=credit_maps(recipe, run_dir=run_dir, tokenizer=tokenizer), **context_settings(recipe))
    return Run(ctx=ctx, prompts=prompts, task=task, tokenizer=tokenizer, layout=layout, checkpoint=path)


def restore(run: Run, recipe, *, log, timings: dict[str, float]) -> int:
    """The weights RL starts from: the checkpoint's (resharded when the layout changed), or the initial
    weights after the supervised warm-up (``recipe.warmup``); a separate critic starts from them. Returns
    the iteration the checkpoint ended (0 for a fresh run)."""
    from megatron_credit.trainer.critic_model import init_critic_from
    from megatron_credit.trainer.warmup import run_warmup

    ctx, prompts, layout, path = run.ctx, run.prompts, run.layout, run.checkpoint
    actor, critic = ctx.actor, ctx.critic
    rank0 = dist.get_rank() == 0
    source = actor.load_initial_weights(seed=recipe.seed)
    start = 0
    if path is None:  # resumed: the checkpoint's weights replace these, and the log says "resumed from"
        log(f"actor weights: {source}")
    if path is not None:
        start, extras, meta = ckpt.load(path, actor, layout=layout, critic=critic)
        old_dp = meta["layout"]["dp"]
        prompts.load_state_dict(_job_stream_state((extras or ckpt.rank0_extras(path))["prompts"], saved_dp=old_dp))
        if extras is not None:
            # the algorithm's state (checkpoints before it was saved whole kept its parts at the top level)
            ctx.load_algorithm_state(extras.get("algorithm", extras))
            ckpt.set_rng_state(extras["rng"])
            if actor.has_reference:
                ckpt.load_reference(actor, extras["reference"], path=path)
            log(f"resumed from {path} (iteration {start})")
        else:
            # Another layout: the weights and optimizer resharded exactly; the prompt stream is the job's
            # (the same on every rank and layout), so its cursor carries over as it is.
            old = meta["layout"]
            if actor.reference is not None:  # (a LoRA run's adapters-off reference is its base: unchanged)
                log("note: the reference model restarts from the loaded policy (layout changed)")
                actor.reset_reference()
            log(f"resumed from {path} (iteration {start}), resharded from {old} to {layout}")
    elif recipe.warmup.steps:
        t0 = time.perf_counter()
        cached = run_warmup(actor, run.task, run.tokenizer, w=recipe.warmup, model=recipe.model,
                            parallel=recipe.parallel, data=recipe.data, seed=recipe.seed, dp_rank=actor.dp_rank,
                            dp_size=layout["dp"], seq_multiple=ctx.seq_multiple, env=recipe.env,
                            log=log if rank0 else (lambda *_: None))
        actor.reset_reference()
        timings["warmup_s"] = time.perf_counter() - t0
        log(f"warm-up: {'loaded from cache' if cached else f'{recipe.warmup.steps} steps'} "
            f"({time.perf_counter() - t0:.1f}s)")
    if critic is not None and path is None:
        init_critic_from(critic, actor)  # the value model starts from the policy RL starts from
        log("critic: a separate value model, initialised from the actor's weights")
    return start  # the engines get these weights when they first wake (SyncSource.generating)


def _job_stream_state(state: dict, *, saved_dp: int) -> dict:
    """The job's prompt-stream state from a checkpoint: as saved, or, from a checkpoint whose ranks each
    had a share of the stream (every ``saved_dp``-th prompt, a cursor per rank, no ``scope``), the prompts
    the whole job had consumed.

    >>> _job_stream_state({"cursor": 24, "scope": "job"}, saved_dp=4), _job_stream_state({"cursor": 6}, saved_dp=4)
    ({'cursor': 24, 'scope': 'job'}, {'cursor': 24, 'scope': 'job'})
    """
    if state.get("scope") == "job":
        return state
    return {"cursor": int(state["cursor"]) * saved_dp, "scope": "job"}


def open_metrics(recipe, *, run_dir: str, start: int, resumed: bool, recipe_file: str | None, log):
    """Rank 0: the resolved recipe as ``run_dir/config.yaml`` and the metrics writer; None on other ranks."""
    if dist.get_rank() != 0:
        return None
    import yaml

    from megatron_credit.recipe.config import recipe_to_dict

    # The resolved recipe of this launch, written once the checkpoint (if any) was accepted: a refused
    # resume leaves the previous launch's config.yaml as it was. The user's own recipe file is never
    # rewritten (--config D/config.yaml --output-dir D).
    resolved = os.path.join(run_dir, "config.yaml")
    if recipe_file is not None and os.path.exists(resolved) and os.path.samefile(recipe_file, resolved):
        log(f"note: {resolved} is this launch's --config: left as it is (not replaced by the resolved recipe)")
    else:
        with open(resolved, "w", encoding="utf-8") as f:
            yaml.safe_dump(recipe_to_dict(recipe), f, sort_keys=False)
    return MetricsWriter(run_dir, resume_step=start if resumed else None,
                         tensorboard=recipe.logging.tensorboard, wandb_project=recipe.logging.wandb,
                         config=recipe_to_dict(recipe), log=log)


def iteration_metrics(run: Run, step: int) -> dict[str, float]:
    """One RL iteration (``step.rl_iteration``), validation when due, the algorithm's state, timings."""
    from megatron_credit.trainer.step import rl_iteration

    ctx = run.ctx
    ctx.timer = PhaseTimer()
    t0 = time.perf_counter()
    metrics = rl_iteration(ctx, step)
    metrics["actor/lr"] = ctx.actor.last_lr  # the policy's lr of the iteration's last step
    metrics["data/dropped_prompts"] = float(run.prompts.dropped_prompts)  # dropped at load
    if ctx.critic is not None:
        metrics["critic/lr"] = ctx.critic.last_lr
    if ctx.train.val_every and step % ctx.train.val_every == 0:
        with ctx.timer("validation"):
            metrics.update(ctx.rollouts.validate(step, weights=ctx.weights(step)))
    metrics.update(ctx.after_iteration(metrics))
    dt = time.perf_counter() - t0
    metrics["time/step_s"] = dt
    metrics["throughput/tokens_per_s"] = metrics.pop("rollout/tokens") / dt
    metrics.update({f"time/{k}_s": v for k, v in ctx.timer.seconds.items()})
    return metrics


def train(recipe, hf_config, *, run_dir: str, device: torch.device, resume: str = "auto",
          log=print, recipe_file: str | None = None,
          timings: dict[str, float] | None = None, local_rank: int | None = None) -> list[dict[str, float]]:
    """Run the recipe's iterations (after ``distributed.initialize``, whose device is ``device``: the
    models, micro-batches and collectives' tensors are put there); returns rank 0's metric rows.
    ``recipe_file``: the launch's ``--config`` (never rewritten when it is ``run_dir/config.yaml``).
    ``timings``, when given, receives ``warmup_s`` (absent without a warm-up) and ``rl_s`` (the loop:
    iterations, validation, checkpoints). ``local_rank``: the launcher's ``LOCAL_RANK`` (None: not set)."""
    timings = {} if timings is None else timings
    rank0 = dist.get_rank() == 0
    # caught from the start: a signal during the build or the warm-up stops the run after its first iteration
    with ExitSignals(recipe.checkpoint.exit_signals) as signals:
        run = build(recipe, hf_config, run_dir=run_dir, device=device, resume=resume, log=log,
                    local_rank=local_rank)
        try:
            start = restore(run, recipe, log=log, timings=timings)
            writer = open_metrics(recipe, run_dir=run_dir, start=start, resumed=run.checkpoint is not None,
                                  recipe_file=recipe_file, log=log)
            rows = _loop(run, recipe, start=start, writer=writer, signals=signals, run_dir=run_dir, device=device,
                         log=log, timings=timings)
        finally:
            run.ctx.rollouts.close()
    if rank0 and recipe.logging.plots:
        _plot(run_dir, log)
    return rows


def _loop(run: Run, recipe, *, start: int, writer, signals: ExitSignals, run_dir: str, device, log,
          timings: dict[str, float]) -> list[dict[str, float]]:
    """Iterations ``start + 1 ..`` with their metrics, checkpoints and the stop on an exit signal (every rank
    agrees on the iteration to stop after, which is saved); rank 0's metric rows."""
    from megatron_credit.trainer.divergence import DivergenceGuard, EnvironmentGuard, stop_if_any_rank_diverged

    rank0 = dist.get_rank() == 0
    bar = _progress(recipe.logging, recipe.train.steps, start, rank0)
    rows: list[dict[str, float]] = []
    step = start
    guard = DivergenceGuard(max_skipped_steps=recipe.train.max_skipped_steps,
                            vocab_size=run.ctx.actor.hf_config.vocab_size,
                            steps_per_iteration=recipe.train.num_minibatches * recipe.train.epochs)
    env_guard = EnvironmentGuard(name=recipe.env.name, max_failed_iterations=recipe.env.max_failed_iterations)
    every, keep = recipe.checkpoint.every, recipe.checkpoint.keep
    t_rl = time.perf_counter()
    try:
        for step in _iterations(recipe.train, start, log if rank0 else (lambda *_: None), device=device):
            metrics = iteration_metrics(run, step)
            if writer is not None:
                writer.write(step, metrics)
                rows.append({"step": step, **metrics})
                _show(bar, metrics, log)
            if rank0:
                for line in env_guard.lines(step, metrics):
                    log(line)
            stops = [m for m in (guard.check(step, metrics), env_guard.check(step, metrics)) if m is not None]
            stop_if_any_rank_diverged(stops[0] if stops else None, device=device)  # before it is saved
            stop = signals.agreed(device)
            if stop is not None:
                log(f"{stop.name}: stopping after iteration {step}; saving it")
            if stop is not None or (every and step % every == 0):
                _save(run_dir, step, run, keep=keep)
            if stop is not None:
                log(f"{stop.name}: saved iteration {step}, exiting")
                break
        else:
            if recipe.checkpoint.save_at_end and (not every or step % every) and step > start:
                _save(run_dir, step, run, keep=keep)
    finally:
        timings["rl_s"] = time.perf_counter() - t_rl
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
    return rows


def _plot(run_dir: str, log) -> None:
    """The run's plots (``plots/*.png``), or one line when matplotlib is missing."""
    try:
        plot_metrics(run_dir)
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")


def _save(run_dir, step, run: Run, *, keep: int) -> None:
    """Iteration ``step`` as a checkpoint of ``run_dir`` (``checkpoint.keep``: how many are kept)."""
    ctx, actor = run.ctx, run.ctx.actor
    extras = {"prompts": run.prompts.state_dict(), "rng": ckpt.rng_state()}
    if actor.has_reference:
        extras["reference"] = ckpt.reference_extras(actor)
    extras["algorithm"] = ctx.algorithm.state_dict()
    ckpt.save(run_dir, step, actor, extras, layout=run.layout, keep=keep, critic=ctx.critic)


def _iterations(train, start: int, log, *, device: torch.device):
    """Iterations ``start + 1 .. train.steps``, ending early once ``train.max_wall_s`` seconds have passed
    since the first began (checked between iterations, the same decision on every rank); the loop then
    ends as after its last step (``checkpoint.save_at_end`` applies)."""
    wall, t0 = train.max_wall_s, time.perf_counter()
    for step in range(start + 1, train.steps + 1):
        if wall is not None and step > start + 1:
            over = torch.tensor([1.0 if time.perf_counter() - t0 >= wall else 0.0]).to(device)
            dist.all_reduce(over)  # clocks differ per rank: stop when any rank is over
            if float(over) > 0:
                log(f"train.max_wall_s={wall} reached after iteration {step - 1}, stopping")
                return
        yield step


def _progress(logging, steps: int, start: int, rank0: bool):
    if not (rank0 and logging.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=steps, initial=start, desc="RL", dynamic_ncols=True)


def _show(bar, m: dict[str, float], log) -> None:
    line = (f"reward {m.get('reward/mean', math.nan):+.3f} acc {m.get('accuracy/mean', math.nan):.3f} "
            f"len {m.get('response_length/mean', math.nan):.1f} {m.get('time/step_s', math.nan):.1f}s/step")
    if "val/accuracy" in m:
        line += f" val {m['val/accuracy']:.3f}"
    if bar is not None:
        bar.set_postfix_str(line)
        bar.update(1)
    else:
        log(line)
