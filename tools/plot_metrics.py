"""PNG plots of a run's ``metrics.jsonl``: ``python tools/plot_metrics.py RUN_DIR`` -> ``RUN_DIR/plots/``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    args = ap.parse_args(argv)
    from megatron_credit.trainer.plots import plot_metrics

    try:
        written = plot_metrics(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
