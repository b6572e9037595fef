"""Memory plan of a recipe on a cluster, before any GPU hour is spent (``megatron_credit.planning.plan``).

    python tools/plan.py --config examples/fipo_qwen25_32b.yaml [--nodes 4 --gpus-per-node 8 --gpu h100-80gb]
                         [--distributed-optimizer on|off] [--ep 8 --etp 1] [--disk-gbps 1] [key.sub=value ...]

Without ``--nodes`` / ``--gpus-per-node`` / ``--gpu`` the recipe's ``cluster`` section is used. The model's
numbers come from ``model.name_or_path``'s ``config.json`` when it is a local folder, else from the
planner's table of known architectures. ``--ep`` / ``--etp`` plan a mixture-of-experts model's expert-parallel
and expert-TP sizes (default: the recipe's ``parallel`` fields where it has them, else EP 1 and the TP size). Prints the layout, the rollout engines (world / rollout TP: every
GPU generates), one row per memory term, the KV cache per engine and per GPU, the host memory the
optimizer and gradient offload takes (per GPU and per node), the training and rollout peaks and a
verdict, then the time of one iteration and one save and the Slurm warning lead they imply
(``megatron_credit.planning.timing``); exits 0 when it fits, 1 when it does not, 2 on a user error. A layout the GPUs cannot hold
(TP x PP x CP not dividing them) is a user error, refused before any table with the arithmetic and a
layout that would fit (``megatron_credit.planning.layouts``).
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    from megatron_credit.cli import positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes (default: cluster.nodes)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default: cluster.gpus_per_node)")
    p.add_argument("--gpu", default=None, help="GPU kind, e.g. h100-80gb (default: cluster.gpu)")
    p.add_argument("--distributed-optimizer", choices=["on", "off"], default=None,
                   help="plan with / without the distributed optimizer (default: cluster.distributed_optimizer)")
    p.add_argument("--ep", type=positive_int, default=None,
                   help="expert-parallel size of an MoE model (default: parallel.expert_model_parallel_size, or 1)")
    p.add_argument("--etp", type=positive_int, default=None,
                   help="expert tensor-parallel size (default: parallel.expert_tensor_parallel_size, or the TP size)")
    p.add_argument("--disk-gbps", type=positive_float, default=None,
                   help="checkpoint write bandwidth of one node in GB/s, for the save time and the Slurm warning "
                        "lead (default: 1)")
    p.add_argument("--network-gbps", type=positive_float, default=None,
                   help="network bandwidth per GPU in Gbit/s for a rollout pool's weight update (default 400)")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.planning.plan import GPUS, format_plan, plan, resolve_hf_config
    from megatron_credit.planning.layouts import layout_refusal

    recipe = load_recipe(args.config, overrides=args.overrides)
    c = recipe.cluster
    nodes, gpn, gpu = args.nodes or c.nodes, args.gpus_per_node or c.gpus_per_node, args.gpu or c.gpu
    dist_opt = None if args.distributed_optimizer is None else args.distributed_optimizer == "on"
    hf_config = resolve_hf_config(recipe.model)
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPUS)}")
    experts = dict(ep=args.ep, etp=args.etp)
    pool = None
    if recipe.rollout.ranks:  # the last rollout.ranks GPUs are the pool's: the trainer is planned on the rest
        from megatron_credit.planning.pool import NETWORK_GBPS, plan_pool, trainer_gpus

        pool = plan_pool(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu,
                         network_gbps=args.network_gbps or NETWORK_GBPS)
        if pool.problems:
            raise ValueError(pool.refusal())
        nodes, gpn = trainer_gpus(recipe, nodes=nodes, gpus_per_node=gpn)
    refusal = layout_refusal(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu,
                             distributed_optimizer=dist_opt, **experts)
    if refusal is not None:  # no table for a layout that cannot exist
        raise ValueError(refusal)
    result = plan(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu, distributed_optimizer=dist_opt,
                  **experts)
    print(format_plan(result, title=f"{args.config}: {recipe.algorithm.name}, {nodes} node(s) x {gpn} {gpu}"
                                    + (" (the trainer's)" if pool else "")))
    if pool is not None:
        print("\n".join(pool.lines()))
    from megatron_credit.planning.timing import DISK_BYTES_PER_S, iteration_estimate

    disk = DISK_BYTES_PER_S if args.disk_gbps is None else args.disk_gbps * 1e9
    print("\n".join(iteration_estimate(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu,
                                       disk_bytes_per_s=disk).lines()))
    if pool is not None:
        print("(the iteration estimate is sync's on the trainer's GPUs: the pool's generation and its overlap with "
              "training are not modelled yet)")
    return 0 if result.fits and (pool is None or pool.fits) else 1


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
