"""Entry point: ``torchrun [...] pretrain_rl.py [--config R.yaml] [--output-dir D] [--resume auto|none|PATH]
[--dry-run] [--plugin FILE.py|MODULE ...] [key.sub=value ...]`` (also installed as ``megatron-credit-train``).

The launcher's environment and argv are read here and nowhere else; the trainer is
``megatron_credit.trainer.loop.train``. Without ``--config`` the embedded default is
``examples/demo_cpu.yaml`` (what ``make demo`` runs). ``--dry-run`` also prints the memory planner's
table (``megatron_credit.planning.plan``) for the launch's world size and ``cluster.gpu``, and exits 1 when
it does not fit. User errors (a bad recipe, a layout that does not fit the model or the world size)
print one ``error: ...`` line and exit 2; ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "demo_cpu.yaml")


def build_parser() -> argparse.ArgumentParser:
    """The options (:func:`parse_args` parses with it; the tests walk its actions)."""
    from megatron_credit.cli import positive_int

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML recipe (default: examples/demo_cpu.yaml)")
    parser.add_argument("--output-dir", default=None, help="run directory (default: runs/<recipe stem>)")
    parser.add_argument("--resume", default="auto",
                        help="auto (newest complete checkpoint of the run directory), none, or a path")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe against the world size and the model, print the layout, the "
                             "memory and time plan and the preflight of the model, data and output folder (exit 1 "
                             "when it does not fit, 2 when a check fails)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="with --dry-run: plan a launch of this many nodes of cluster.gpus_per_node GPUs (default: "
                             "WORLD_SIZE, which counts the rollout pool's ranks as torchrun does)")
    parser.add_argument("--skip-preflight", action="store_true",
                        help="with --dry-run: do not check that the model, the data and the output folder are there")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                        help="import this file or module before the recipe is read, e.g. one that registers "
                             "an algorithm (repeatable; examples/plugins/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 (before or after "
                                                     "the options)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    # intermixed: `seed=7 --output-dir D logging.progress=false` (plain parse_args refuses the last one)
    return build_parser().parse_intermixed_args(argv)


def _describe(recipe, hf_config, layout: dict[str, int]) -> str:
    n_params = _param_count(hf_config)
    r, t = recipe.rollout, recipe.train
    return (f"model {hf_config.model_type} {n_params / 1e6:.2f}M params, layers {hf_config.num_hidden_layers}, "
            f"hidden {hf_config.hidden_size}\n"
            f"layout TP={layout['tp']} PP={layout['pp']} CP={layout['cp']} DP={layout['dp']} "
            f"(sequence parallel {recipe.parallel.sequence_parallel})\n"
            f"algorithm {recipe.algorithm.name}: {r.prompts_per_step} prompts x {r.n} samples per iteration, "
            f"{t.num_minibatches} mini-batches x {t.epochs} epochs, {t.steps} iterations\n"
            f"trains: {_what_trains(recipe, hf_config, n_params)}")


def _what_trains(recipe, hf_config, n_params: int) -> str:
    """Every parameter, or LoRA's adapters (counted by the planner) with the base frozen."""
    lora = recipe.model.lora
    if not lora.enabled:
        return "every parameter" + (" and the critic" if _has_critic(recipe) else "")
    from megatron_credit.planning.architecture import lora_layer_param_count
    from megatron_credit.planning.plan import Architecture

    a = Architecture.from_hf(hf_config)
    adapters = a.num_layers * lora_layer_param_count(a, rank=lora.rank, targets=lora.targets)
    critic = ", and the critic in full" if _has_critic(recipe) else ""
    return (f"LoRA adapters (rank {lora.rank}, alpha {lora.scale_alpha:g}) on {', '.join(lora.targets)}: "
            f"{_count(adapters)} fp32 parameters, {100 * adapters / n_params:.2g}% of the base's "
            f"{_count(n_params)}, which stay frozen{critic}"
            + ("; the KL reference is the adapters off" if recipe.algorithm.kl_coef > 0 else ""))


def _count(n: int) -> str:
    """``2.03M``, or ``3,328`` below a million."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _has_critic(recipe) -> bool:
    return recipe.algorithm.build().critic_kind is not None


def _param_count(c) -> int:
    """The model's parameters, counted by the planner (the one count; tested against megatron's numel)."""
    from megatron_credit.planning.plan import Architecture, total_param_count

    return total_param_count(Architecture.from_hf(c))


def done_line(rows: list[dict], timings: dict[str, float], *, total_s: float, run_dir: str) -> str:
    """The last line of a run: iterations, the time of RL apart from the warm-up's (and the rest: model
    build, checkpoints, plots), accuracy from the first to the last iteration, the last validation."""
    nan = float("nan")
    first, last = rows[0], rows[-1]
    warm, rl = timings.get("warmup_s", 0.0), timings.get("rl_s", nan)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return (f"done: {len(rows)} iterations (to {last['step']}) in {rl:.0f}s of RL + {warm:.0f}s of warm-up "
            f"({total_s:.0f}s in all); sampled accuracy {first.get('accuracy/mean', nan):.3f} -> "
            f"{last.get('accuracy/mean', nan):.3f}" + (f", validation {val[-1]:.3f}" if val else "")
            + f"; metrics in {os.path.join(run_dir, 'metrics.jsonl')}, plots in {os.path.join(run_dir, 'plots')}")


def finished_line(run_dir: str, recipe) -> Optional[str]:
    """One line when ``run_dir``'s newest complete checkpoint is already at ``train.steps`` (``--resume
    auto`` would do nothing): where it ended, where the results are, how to start again. None otherwise."""
    import json

    from megatron_credit.run_dir import complete_checkpoints

    done = complete_checkpoints(run_dir)
    if not done or done[-1][0] < recipe.train.steps:
        return None
    step, metrics = done[-1][0], os.path.join(run_dir, "metrics.jsonl")
    result = ""
    try:
        with open(metrics, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        last = [r for r in rows if r.get("step", 0) <= step][-1]
        val = [r["val/accuracy"] for r in rows if "val/accuracy" in r and r.get("step", 0) <= step]
        result = f", sampled accuracy {last['accuracy/mean']:.3f}" + (f", validation {val[-1]:.3f}" if val else "")
    except (OSError, ValueError, KeyError, IndexError):
        pass  # the checkpoint is what counts; a missing or cut metrics file only shortens the line
    return (f"already finished: {run_dir} is at iteration {step} of train.steps={recipe.train.steps}{result}; "
            f"results in {metrics} and {os.path.join(run_dir, 'plots')}; to start again, remove {run_dir} "
            f"or pass --output-dir <new dir> (train.steps=N > {step} continues it)")


def refuse_another_algorithm(run_dir: str, recipe) -> None:
    """``--resume auto`` into a run folder whose checkpoints another algorithm saved (its ``config.yaml``
    names it): a ``ValueError`` naming both, instead of resuming or reporting the other run as finished
    (``make demo`` then ``algorithm.name=grpo`` without ``--output-dir`` reuses ``runs/demo_cpu``)."""
    import yaml

    from megatron_credit.run_dir import complete_checkpoints

    saved = os.path.join(run_dir, "config.yaml")
    if not complete_checkpoints(run_dir) or not os.path.isfile(saved):
        return
    try:
        with open(saved, encoding="utf-8") as f:
            name = (yaml.safe_load(f) or {}).get("algorithm", {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        return  # a folder this check cannot read: the resume's own checks decide
    if isinstance(name, str) and name != recipe.algorithm.name:
        raise ValueError(f"{run_dir} holds a {name} run ({saved}); algorithm.name={recipe.algorithm.name} would "
                         f"resume it as another algorithm: pass --output-dir <new dir> for a new run (or --resume "
                         "PATH to resume a checkpoint on purpose)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """User errors (a bad recipe, a layout that does not fit): one ``error: ...`` line and exit code 2
    (``--debug``: the traceback); see ``megatron_credit.cli``."""
    from megatron_credit.cli import run_main

    return run_main(lambda args: _main(parse_args(args), list(args)), list(sys.argv[1:]) if argv is None else list(argv))


def start_pool_ranks(argv: Sequence[str], ranks: int):
    """Without a launcher: start the rollout pool's ``ranks`` processes (this command again, as ranks
    ``1 .. ranks`` of a launch of ``1 + ranks`` on this machine; on a GPU, local devices ``1 .. ranks``)
    and return this process's place in that launch (rank 0, the one trainer rank)."""
    import subprocess

    from megatron_credit import distributed
    from megatron_credit.sources.pool import PARENT_ENV, SPAWNED

    port = distributed.free_port()
    world = 1 + ranks
    for rank in range(1, world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), PARENT_ENV: str(os.getpid())}
        SPAWNED.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return distributed.LaunchEnv(rank=0, world_size=world, local_rank=0, master_port=port)


def dry_run_launch(recipe, *, nodes: Optional[int], launch) -> tuple[int, int]:
    """(nodes, GPUs per node) of the launch a dry run plans: ``--nodes`` x ``cluster.gpus_per_node``, else the
    world size torchrun would have (``WORLD_SIZE``, the rollout pool's ranks included, as torchrun counts them;
    without it, this process and the pool ranks it would start), in nodes of ``cluster.gpus_per_node``."""
    gpn = recipe.cluster.gpus_per_node
    if nodes is not None:
        if "WORLD_SIZE" in os.environ and launch.world_size != nodes * gpn:
            raise ValueError(f"--nodes {nodes} x cluster.gpus_per_node={gpn} = {nodes * gpn} GPUs, but "
                             f"WORLD_SIZE={launch.world_size}: pass one of them")
        return nodes, gpn
    world = launch.world_size if "WORLD_SIZE" in os.environ else 1 + recipe.rollout.ranks
    if recipe.rollout.ranks and world <= recipe.rollout.ranks:
        raise ValueError(f"WORLD_SIZE={world} leaves no trainer rank beside rollout.ranks={recipe.rollout.ranks}: "
                         f"WORLD_SIZE counts every rank of the launch, the pool's included (e.g. "
                         f"{recipe.cluster.nodes * gpn} for the recipe's cluster)")
    return (world // gpn, gpn) if world % gpn == 0 else (1, world)


def dry_run(recipe, args, *, run_dir: str, launch) -> int:
    """``--dry-run``: the recipe against the launch's world size, the plan and time of ``tools/plan.py``
    (``planning.report``: one report for both), and the preflight. Exit 0 when it fits, 1 when it does not,
    2 when a preflight check fails (each one ``error:`` line)."""
    from megatron_credit.planning.plan import resolve_hf_config
    from megatron_credit.planning.report import launch_report, preflight_lines

    hf_config = resolve_hf_config(recipe.model)  # planning needs no checkpoint: known architectures come from a table
    nodes, gpn = dry_run_launch(recipe, nodes=args.nodes, launch=launch)
    gpu = recipe.cluster.gpu
    report = launch_report(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu,
                           title=f"plan of {nodes * gpn} rank(s)")  # refuses an impossible layout in one line
    layout = recipe.validate(world_size=report.trainer_nodes * report.trainer_gpus_per_node, arch=hf_config)
    if launch.rank != 0:
        return 0 if report.fits else 1
    print(_describe(recipe, hf_config, layout))
    print("\n".join(report.lines))
    errors = [f"error: {p}" for p in report.problems]
    if args.skip_preflight:
        print("preflight: skipped (--skip-preflight): the model, the data and the output folder were not checked")
    else:
        ok, failed = preflight_lines(recipe, run_dir=run_dir, estimate=report.estimate)
        print("\n".join(ok))
        errors += failed
    if errors:
        print(f"dry run: {len(errors)} check(s) failed (exit 2); nothing was built", flush=True)
        print("\n".join(errors), file=sys.stderr, flush=True)
        return 2
    print("dry run: the recipe is valid for this world size; nothing was built" if report.fits else
          "dry run: the layout is valid for this world size but its memory plan does not fit (exit 1); "
          "nothing was built", flush=True)
    return 0 if report.fits else 1


def _main(args, argv: Sequence[str] = ()) -> int:
    import torch

    from megatron_credit import distributed
    from megatron_credit.recipe.config import load_recipe

    from megatron_credit.plugins import load_plugins

    load_plugins(args.plugin)  # before the recipe: its algorithm.name may be a plugin's
    config = args.config or DEFAULT_RECIPE
    recipe = load_recipe(config, overrides=args.overrides)
    from megatron_credit.rollout.engine import check_engine_name

    check_engine_name(recipe.rollout.engine)  # the recipe is a leaf: the registry is checked here
    launch = distributed.LaunchEnv.from_environ(os.environ)
    pool = recipe.rollout.ranks  # the last `pool` ranks of the launch are the rollout pool
    launched = "RANK" in os.environ  # by torchrun (or a pool rank this command started)
    run_dir = args.output_dir or os.path.join("runs", os.path.splitext(os.path.basename(config))[0])
    if args.dry_run:
        return dry_run(recipe, args, run_dir=run_dir, launch=launch)
    if args.nodes is not None:
        raise ValueError("--nodes plans a launch: it goes with --dry-run (torchrun sets the world size of a run)")
    trainer_world = launch.world_size - pool if launched else launch.world_size
    if pool and launched:
        from megatron_credit.sources.bridge import PoolRanks

        PoolRanks(world=launch.world_size, pool=pool, rollout_tp=recipe.rollout.tensor_parallel_size)  # one line
    from megatron_credit.planning.preflight import check_data, check_model, refuse


    refuse([check_model(recipe), check_data(recipe)])  # a missing model or data file: one line, before anything
    hf_config = recipe.model.hf_config()
    from megatron_credit.planning.preflight import check_output
    from megatron_credit.planning.timing import checkpoint_size

    refuse([check_output(run_dir, checkpoint_bytes=checkpoint_size(recipe, hf_config), keep=recipe.checkpoint.keep)])
    # Refuse impossible layouts before any process group or model exists.
    layout = recipe.validate(world_size=trainer_world, arch=hf_config)
    rank0 = launch.rank == 0
    from megatron_credit.recipe.device_fields import check_device_fields

    check_device_fields(recipe)  # TE, bf16, CUDA fields this machine cannot honour: one line naming the field
    if args.resume == "auto":
        refuse_another_algorithm(run_dir, recipe)
    finished = finished_line(run_dir, recipe) if args.resume == "auto" else None
    if finished is not None:  # a second `make demo`: say so in one line, build nothing
        if rank0:
            print(finished, flush=True)
        return 0
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    from megatron_credit.lifetime import start_guard

    start_guard(log=print if rank0 else None)  # every process this rank starts ends with it, however it ends
    if pool and not launched:
        launch = start_pool_ranks(argv, pool)
    if pool and launch.rank >= launch.world_size - pool:  # a rollout pool rank: engines, not the trainer
        import datetime

        from megatron_credit.sources.pool import serve

        job = distributed.join_job(launch, pool_ranks=pool,
                                   timeout=datetime.timedelta(seconds=recipe.distributed.timeout_s))
        local = launch.local_rank or 0
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        code = serve(recipe, hf_config, job=job, device=device, local_rank=local)
        # Leave without the interpreter's teardown: the pool runs up to the staleness bound ahead, so sends of
        # batches the stopped trainer never asks for can still sit in gloo's worker threads, and destroying
        # their process groups at exit aborts the process ("terminate called without an active exception",
        # SIGABRT), which the launcher reports as the job's failure. Nothing of a pool rank's is left to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    device = distributed.initialize(recipe.parallel, seed=recipe.seed, launch=launch, pool_ranks=pool,
                                    timeout_s=recipe.distributed.timeout_s)
    try:
        if rank0:
            os.makedirs(run_dir, exist_ok=True)  # config.yaml: written by train() once a resume is accepted
            print(_describe(recipe, hf_config, layout), flush=True)
        torch.distributed.barrier()
        from megatron_credit.trainer.loop import train

        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        rows = train(recipe, hf_config, run_dir=run_dir, device=device, resume=args.resume, recipe_file=config,
                     timings=timings, local_rank=launch.local_rank,
                     log=(lambda *a: print(*a, flush=True)) if rank0 else (lambda *_: None))
        if rank0 and rows:
            print(done_line(rows, timings, total_s=time.perf_counter() - t0, run_dir=run_dir), flush=True)
    finally:
        distributed.destroy(process_group=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
