"""Device-to-host reads of a training step and of the HF engine's decode step, counted on the emulated
accelerator (``tests/support/fakegpu.py``: ``.item()``, ``float()`` / ``bool()`` of a device tensor,
``.tolist()``, ``.cpu()``, ``torch.equal``, and the ops whose output shape depends on the data: ``nonzero``,
boolean indexing, ``masked_select``, ``unique``...). Each read makes the host wait for the device to drain its
queue: inside a micro-batch loop it leaves the GPU idle while the host catches up.

Per algorithm (``tests/support/host_syncs.py``: the fixed batch's behaviour pass, advantages and two
mini-batches of several micro-batches each): the project's own reads per micro-batch of the update and of the
log-prob pass, and in the whole iteration; megatron-core's own reads are counted apart, by call site. The HF
engine: the project's reads per decode step (``tests/support/decode_syncs.py``).

    python benchmarks/host_syncs.py [--json] [--algorithms grpo,fipo]

``--json`` prints one object: ``{"algorithms": {name: {"update_microbatch", "logprob_microbatch", "iteration",
"megatron_core": {...}}}, "hf_decode_step": {"max", "mean"}, "transformers_decode_step": {"max", "mean"}}``.
Counts, not times: the same on every machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _decode() -> dict:
    from tests.support.decode_syncs import count_decode_reads

    return count_decode_reads()


def measure(algorithms=None) -> dict:
    from tests.support.distributed_harness import DistributedPool
    from tests.support.host_syncs import count_update_reads

    with DistributedPool(world_size=1) as pool:  # a fresh process: the emulated backend is process-wide
        update = pool.run(count_update_reads, algorithms)[0]
    with DistributedPool(world_size=1) as pool:
        decode = pool.run(_decode)[0]
    out = {"algorithms": {name: {k: r[k] for k in ("update_microbatch", "logprob_microbatch", "iteration",
                                                   "microbatches")}
                          | {"megatron_core": {k: v for k, v in r["megatron_core"].items() if k != "sites"}}
                          for name, r in update.items()}}
    if decode:
        out["hf_decode_step"] = decode["hf_decode_step"]
        out["transformers_decode_step"] = decode["transformers_decode_step"]
    out["sites"] = {name: {"project": r["project_sites"], "megatron_core": r["megatron_core"]["sites"]}
                    for name, r in update.items()}
    return out


def table(result: dict) -> list[str]:
    lines = [f"{'algorithm':<10}{'update/mb':>11}{'logprob/mb':>12}{'iteration':>11}   megatron-core: "
             f"{'update/mb':>9}{'logprob/mb':>11}"]
    for name, r in result["algorithms"].items():
        core = r["megatron_core"]
        lines.append(f"{name:<10}{r['update_microbatch']:>11.2f}{r['logprob_microbatch']:>12.2f}{r['iteration']:>11d}"
                     f"   {'':15}{core['update_microbatch']:>9.2f}{core['logprob_microbatch']:>11.2f}")
    decode = result.get("hf_decode_step")
    if decode is not None:
        lines.append(f"HF engine, reads per decode step: project max {decode['max']} mean {decode['mean']:.2f}; "
                     f"transformers' own max {result['transformers_decode_step']['max']}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--algorithms", default=None, help="comma-separated (default: every built-in)")
    args = ap.parse_args(argv)
    result = measure(args.algorithms.split(",") if args.algorithms else None)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "sites"}, indent=1))
    else:
        print("\n".join(table(result)))
        for name, s in result["sites"].items():
            print(f"{name}: project {s['project']}")
        first = next(iter(result["sites"].values()))
        print(f"megatron-core's own reads (by call site): {first['megatron_core']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
