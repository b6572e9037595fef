"""Memory plan of a recipe on a cluster, before any GPU hour is spent (``megatron_credit.planning.plan``).

    python tools/plan.py --config examples/fipo_qwen25_32b.yaml [--nodes 4 --gpus-per-node 8 --gpu h100-80gb]
                         [--distributed-optimizer on|off] [--ep 8 --etp 1] [--disk-gbps 1] [key.sub=value ...]

Without ``--nodes`` / ``--gpus-per-node`` / ``--gpu`` the recipe's ``cluster`` section is used. The model's
numbers come from ``model.name_or_path``'s ``config.json`` when it is a local folder, else from the
planner's table of known architectures. ``--ep`` / ``--etp`` plan a mixture-of-experts model's expert-parallel
and expert-TP sizes (default: the recipe's ``parallel`` fields where it has them, else EP 1 and the TP size). Prints the layout, the rollout engines (world / rollout TP: every
GPU generates), one row per memory term, the KV cache per engine and per GPU, the host memory the
optimizer and gradient offload takes (per GPU and per node), the training and rollout peaks and a
verdict, then the time of one iteration (a rollout pool's generation beside the trainer's step, and which
side waits), of one save and of the whole run, the disk its checkpoints take, and the Slurm warning lead
(``megatron_credit.planning.timing``), then the preflight: the model, the data and the output folder are
there (``megatron_credit.planning.preflight``; ``--skip-preflight`` plans without them). The same report as
``pretrain_rl.py --dry-run`` (``megatron_credit.planning.report``). Exits 0 when it fits, 1 when it does
not, 2 on a user error or a failed preflight check (each one ``error: ...`` line). A layout the GPUs cannot hold
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
    p.add_argument("--output-dir", default=None,
                   help="the run folder the preflight checks (writable, room for the kept checkpoints; default: "
                        "runs/<recipe stem>, as pretrain_rl.py)")
    p.add_argument("--skip-preflight", action="store_true",
                   help="plan only: do not check that the model, the data and the output folder are there (on a "
                        "machine that plans without them)")
    p.add_argument("--json", action="store_true",
                   help="print the whole plan as one JSON object (the trainer's plan, a pool's with its balance, "
                        "the time estimate, the preflight) instead of the table; errors still go to stderr")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    import os

    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.planning.plan import resolve_hf_config
    from megatron_credit.planning.report import launch_report, preflight_lines
    from megatron_credit.planning.timing import DISK_BYTES_PER_S

    recipe = load_recipe(args.config, overrides=args.overrides)
    from megatron_credit.rollout.engine import check_engine_name

    check_engine_name(recipe.rollout.engine)
    c = recipe.cluster
    nodes, gpn, gpu = args.nodes or c.nodes, args.gpus_per_node or c.gpus_per_node, args.gpu or c.gpu
    dist_opt = None if args.distributed_optimizer is None else args.distributed_optimizer == "on"
    hf_config = resolve_hf_config(recipe.model)
    report = launch_report(recipe, hf_config, nodes=nodes, gpus_per_node=gpn, gpu=gpu, title=args.config,
                           distributed_optimizer=dist_opt, ep=args.ep, etp=args.etp,
                           disk_bytes_per_s=DISK_BYTES_PER_S if args.disk_gbps is None else args.disk_gbps * 1e9,
                           network_gbps=args.network_gbps)
    if not args.json:
        print("\n".join(report.lines))
    errors = [f"error: {p}" for p in report.problems]
    if args.skip_preflight:
        ok = ["preflight: skipped (--skip-preflight): the model, the data and the output folder were not checked"]
    else:
        run_dir = args.output_dir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
        ok, failed = preflight_lines(recipe, run_dir=run_dir, estimate=report.estimate)
        errors += failed
    if args.json:
        import json

        print(json.dumps({"recipe": args.config, **report.as_dict(), "lines": report.lines,
                          "preflight": {"ok": ok, "errors": errors}}, indent=1), flush=True)
    else:
        print("\n".join(ok), flush=True)
    if errors:
        sys.stdout.flush()
        print("\n".join(errors), file=sys.stderr)
        return 2
    return 0 if report.fits else 1


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
