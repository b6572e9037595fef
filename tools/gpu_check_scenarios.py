"""Part ``scenarios`` of ``tools/gpu_check.sh``: the emulated-accelerator suite's scenarios
(``tests/trainer/test_device_placement.py``, ``tests/support/fakegpu.py``) on real CUDA with NCCL at
world size 1, each against the same scenario on the CPU of the same machine.

    python tools/gpu_check_scenarios.py all DIR        # every scenario, CPU and CUDA side by side
    python tools/gpu_check_scenarios.py fixed NAME OUT  # one fixed-batch update on this process's device

- the update on the fixed batch (two optimizer steps) for the suite's ``SCENARIOS``: GRPO, FIPO, PPO with
  a value head and with a separate critic, CompPO with the dynamic gate and with the ``position`` control;
- ``pretrain_rl.py`` with the suite's ``RUN``: warm-up, frozen reference, megatron's optimizer, the HF
  engine's weight sync, a checkpoint every iteration, then a resume.

The CPU reference runs here, in the same script, not from committed numbers: the GPU machine's torch and
megatron-core are not the CI's, so committed numbers would mix a version difference into the device one.
A CPU run hides CUDA (``CUDA_VISIBLE_DEVICES=""``) and takes gloo. fp32 with TF32 off (torch's default
``float32_matmul_precision("highest")``, set explicitly): CUDA and the CPU differ only in reduction order
and in the attention kernel (megatron's unfused attention on CUDA, ``models/cpu_attention.py`` on the CPU),
about 1e-6 relative per op. Tolerance: rel 1e-4 on the first mini-batch's metrics (no update yet), rel
1e-3 after the first Adam step (Adam's first step is ``lr * sign(g)``: a gradient at rounding level may
flip its sign), abs 1e-6 throughout. The trainer scenario draws its samples with generators on the
engine's device (CUDA's Philox stream is not the CPU's), so its RL numbers are shown side by side, not
compared; its CUDA run must keep the suite's invariants. Exit 0 passed, 1 failed, 77 skipped.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SKIP = 77
TOLERANCE = {0: 1e-4, 1: 1e-3}  # relative, per step index of the fixed batch (see the module docstring)
ABS = 1e-6
PROCESS_TIMEOUT_S = 150


def fixed(name: str, out: str) -> int:
    """One fixed-batch scenario on this process's device; its per-step metrics to ``out`` (JSON)."""
    import torch

    torch.set_float32_matmul_precision("highest")
    from tests.support.fixed_batch import _run_fixed
    from tests.trainer.test_device_placement import LOCAL, SCENARIOS

    algorithm, overrides = SCENARIOS[name]
    rows = _run_fixed({}, algorithm, overrides=overrides + LOCAL)
    Path(out).write_text(json.dumps(rows))
    return 0


def _env(device: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(cmd: list[str], device: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(device), capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)


def _fixed_pair(name: str, out: Path) -> tuple[str, list[str], bool]:
    rows, msgs = {}, []
    for device in ("cpu", "cuda"):
        path = out / f"fixed_{name.replace(':', '_')}_{device}.json"
        proc = _run([sys.executable, __file__, "fixed", name, str(path)], device)
        if proc.returncode != 0:
            return name, [f"{device} run failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-600:]}"], False
        rows[device] = json.loads(path.read_text())
    from tests.trainer.test_device_placement import KEYS

    ok, worst = len(rows["cuda"]) == len(rows["cpu"]) == 2 and all(m["changed"] for m in rows["cuda"]), {}
    for i, (a, b) in enumerate(zip(rows["cpu"], rows["cuda"])):
        for k in KEYS:
            if k in a:
                rel = abs(b[k] - a[k]) / max(abs(a[k]), 1e-30)
                worst[i] = max(worst.get(i, (0.0, k)), (rel, k))
                if abs(b[k] - a[k]) > max(ABS, TOLERANCE[i] * abs(a[k])):
                    ok = False
                    msgs.append(f"step {i} {k}: cuda {b[k]:.8g} vs cpu {a[k]:.8g}")
    summary = ", ".join(f"step {i}: worst rel diff {r:.1e} ({k}; tolerance {TOLERANCE[i]:g})"
                        for i, (r, k) in sorted(worst.items()))
    return name, [summary, *msgs], ok


def _trainer(device: str, out: Path) -> tuple[list[dict], list[str]]:
    """The suite's trainer scenario on ``device``: 1 iteration, then a resume to 2."""
    from tests.trainer.test_device_placement import RUN

    run_dir, cache = out / f"trainer_{device}", out / f"warmup_cache_{device}"
    notes = []
    for steps in (1, 2):
        cmd = [sys.executable, str(REPO / "pretrain_rl.py"), "--output-dir", str(run_dir), *RUN,
               f"warmup.cache_dir={cache}", f"train.steps={steps}"]
        proc = _run(cmd, device)
        if proc.returncode != 0:
            raise RuntimeError(f"{device} trainer (train.steps={steps}) exit {proc.returncode}: "
                               f"{(proc.stdout + proc.stderr)[-800:]}")
        if steps == 2 and "resumed from" not in proc.stdout:
            notes.append("FAILED: the second launch did not resume")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, notes


def _trainer_check(out: Path) -> tuple[list[str], bool]:
    (cpu, _), (dev, notes) = _trainer("cpu", out), _trainer("cuda", out)
    ok = not notes
    checks = {"steps 1, 2": [r["step"] for r in dev] == [1, 2],
              "actor/grad_norm > 0": all(r.get("actor/grad_norm", 0) > 0 for r in dev),
              "mismatch/logprob_abs_mean < 1e-4 (fp32: the engine got the weights)":
                  all(r.get("mismatch/logprob_abs_mean", 1.0) < 1e-4 for r in dev),
              "actor/kl_ref > 0 at step 2 (the reference pass ran)": len(dev) == 2 and dev[1].get("actor/kl_ref", 0) > 0}
    lines = list(notes)
    for what, good in checks.items():
        ok &= good
        lines.append(f"{'ok' if good else 'FAILED'}: {what}")
    for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_ref", "mismatch/logprob_abs_mean",
              "critic/value_loss", "time/step_s"):
        pairs = [f"{a.get(k, float('nan')):.4g} / {b.get(k, float('nan')):.4g}" for a, b in zip(cpu, dev)]
        lines.append(f"{k} (cpu / cuda per step, different samples): {', '.join(pairs)}")
    return lines, ok


def all_scenarios(out_dir: str) -> int:
    import torch

    if not torch.cuda.is_available():
        print("skipped: CUDA is not available to torch")
        return SKIP
    from tests.trainer.test_device_placement import SCENARIOS

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0, ok = time.perf_counter(), True
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as executor:  # 16 cores: 4 pairs of 2 threads
        trainer = executor.submit(_trainer_check, out)
        for fut in concurrent.futures.as_completed([executor.submit(_fixed_pair, n, out) for n in SCENARIOS]):
            name, lines, good = fut.result()
            ok &= good
            print(f"- fixed batch {name}: {'ok' if good else 'FAILED'} ({time.perf_counter() - t0:.0f} s): {lines[0]}")
            for line in lines[1:6]:
                print(f"  - {line}")
            sys.stdout.flush()
        try:
            lines, good = trainer.result()
        except Exception as exc:  # noqa: BLE001 - reported, the part fails
            lines, good = [f"FAILED: {str(exc)[-1000:]}"], False
        ok &= good
        print(f"- pretrain_rl.py (warm-up, reference, megatron optimizer, HF-engine sync, checkpoint, resume): "
              f"{'ok' if good else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
        for line in lines:
            print(f"  - {line}")
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "all":
        return all_scenarios(argv[1])
    if len(argv) == 3 and argv[0] == "fixed":
        return fixed(argv[1], argv[2])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
