"""Part ``profile`` of ``tools/gpu_check.sh``: where the GPU waits, in the trainer and in the HF engine.

    python tools/gpu_check_profile.py all DIR     # the two pieces below, in order, on one GPU

- ``trainer``: ``examples/demo_cpu.yaml`` as the ``demo`` part runs it (``tools/gpu_check_trainer.py``:
  bf16, local spec, HF engine), without its warm-up, for 3 iterations. Iteration 2 runs under
  ``torch.profiler`` (CPU + CUDA): the top kernels by CUDA time, the GPU's busy time against the
  iteration's wall time (the share it idles) and the host gaps between kernels. Iteration 3 runs under
  ``torch.cuda.set_sync_debug_mode("warn")``: every host sync, by pass (the update's and the old
  log-probs' micro-batches: ``Actor.run`` with and without gradients; the rollout; the rest) and by code
  (the innermost frame of ours, megatron-core's or transformers'; else torch's). A sync inside a backward
  pass is reported when the backward returns (autograd replays its warnings), at the ``backward`` call.
- ``decode``: the HF engine on a Qwen2.5-1.5B-shaped model (random weights, bf16), 4 prompts x 2 samples,
  1,024 new tokens without stop tokens: tokens/s and milliseconds per decode step; and the host syncs of
  one decode step (a 32-step generation's minus a 16-step one's, over 16: the set-up cancels out). It
  stops at the part's time limit (``GPU_CHECK_PART_LIMIT_S``, which ``gpu_check.sh`` sets) and then
  reports the steps it ran.

Each piece degrades to one ``skipped:`` / ``failed:`` line; exit 0 when both ran, 1 when one failed, 77
when CUDA is missing (the last line says why). The counting, the kernel summary and the report lines are
functions that run on the CPU (``tests/tools/test_gpu_check_profile.py``); what they measure exists on a
GPU only.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SKIP = 77
SYNC_MESSAGE = "called a synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` warns at each host sync (c10/cuda/CUDAFunctions.h)."""
DEMO_ITERATIONS = 3  # 1: warm (allocator, cuBLAS handles), 2: profiled, 3: syncs counted
PROFILED, SYNC_COUNTED = 2, 3
DECODE_TOKENS = 1024
DECODE_PROMPTS, DECODE_N, DECODE_PROMPT_LEN = 4, 2, 64
SYNC_STEPS = (16, 32)
TOP_KERNELS = 10
GAP_US = 100.0
"""A host gap: the GPU idle for at least this long (microseconds) inside the profiled iteration."""


# ------------------------------------------------------------------------------------------- host syncs
def sync_site(frames: list[tuple[str, int]]) -> tuple[str, str]:
    """``(owner, "path:line")`` of a sync from its stack, innermost frame first: the innermost frame of ours
    (``megatron_credit/``, ``pretrain_rl.py``), megatron-core's or transformers' (as
    ``tests/support/fakegpu.py`` counts reads), else the innermost of torch's, else ``("other", ...)``.

    >>> sync_site([("/x/torch/_tensor.py", 5), ("/r/megatron_credit/rollout/hf_engine.py", 9), ("/r/t.py", 1)])
    ('project', 'megatron_credit/rollout/hf_engine.py:9')
    >>> sync_site([("/x/torch/_tensor.py", 5), ("/r/t.py", 1)])
    ('torch', 'torch/_tensor.py:5')
    """
    torch_site = None
    for path, line in frames:
        path = path.replace("\\", "/")
        if "/megatron/core/" in path:
            return "megatron-core", path[path.index("megatron/core/"):] + f":{line}"
        if "/transformers/" in path:
            return "transformers", path[path.rindex("transformers/"):] + f":{line}"
        if "/megatron_credit/" in path:
            return "project", path[path.rindex("megatron_credit/"):] + f":{line}"
        if path.endswith("/pretrain_rl.py"):
            return "project", f"pretrain_rl.py:{line}"
        if torch_site is None and "/torch/" in path:
            torch_site = path[path.rindex("torch/"):] + f":{line}"
    if torch_site is not None:
        return "torch", torch_site
    path, line = frames[0] if frames else ("?", 0)
    return "other", f"{os.path.basename(path)}:{line}"


class SyncCounter:
    """Host syncs, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them, while :meth:`counting`:
    ``events`` holds ``(owner, site, phase)`` (:func:`sync_site`; ``phase`` the innermost label of
    :meth:`phase`, "other" outside any). Other warnings go where they went. Without CUDA nothing warns."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self._phases = ["other"]

    @contextlib.contextmanager
    def phase(self, label: str):
        self._phases.append(label)
        try:
            yield
        finally:
            self._phases.pop()

    def record(self, frames: list[tuple[str, int]]) -> None:
        owner, site = sync_site(frames)
        self.events.append((owner, site, self._phases[-1]))

    @contextlib.contextmanager
    def counting(self):
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")  # each one, not once per site
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if SYNC_MESSAGE not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                frames, f = [], sys._getframe(1)
                while f is not None:
                    if f.f_code.co_filename != warnings.__file__:
                        frames.append((f.f_code.co_filename, f.f_lineno))
                    f = f.f_back
                self.record(frames)

            warnings.showwarning = show
            cuda = torch.cuda.is_available()
            previous = torch.cuda.get_sync_debug_mode() if cuda else None
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous)

    def count(self, *, owner: str | None = None, phase: str | None = None) -> int:
        return sum(1 for o, _, p in self.events if (owner is None or o == owner) and (phase is None or p == phase))

    def sites(self, *, phase: str | None = None, top: int = 5) -> list[tuple[str, str, int]]:
        """The ``top`` most frequent ``(owner, site, count)``."""
        counts: dict[tuple[str, str], int] = {}
        for o, s, p in self.events:
            if phase is None or p == phase:
                counts[(o, s)] = counts.get((o, s), 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        return [(o, s, n) for (o, s), n in ranked]


def format_syncs(counter: SyncCounter, microbatches: dict[str, int], *, label: str) -> list[str]:
    """Report lines: syncs per micro-batch of the update and old-log-prob passes, the rollout's and the
    rest's, by owner; the most frequent sites.

    >>> c = SyncCounter(); c.events = [("project", "a.py:1", "update")] * 4 + [("megatron-core", "b.py:2", "update")] * 2
    >>> format_syncs(c, {"update": 2, "logprob": 0}, label="x")[1]
    '  - update: 2 micro-batches, 6 syncs, 3.0 per micro-batch (project 2.0, megatron-core 1.0)'
    """
    lines = [f"- host syncs ({label}, torch.cuda.set_sync_debug_mode): {len(counter.events)} in all"]
    for phase, what in (("update", "update"), ("logprob", "old log-probs")):
        n, total = microbatches.get(phase, 0), counter.count(phase=phase)
        if n == 0:
            lines.append(f"  - {what}: no micro-batch ran" + (f" ({total} syncs)" if total else ""))
            continue
        owners = sorted({o for o, _, p in counter.events if p == phase}, key=lambda o: (-counter.count(owner=o, phase=phase), o))
        split = ", ".join(f"{o} {counter.count(owner=o, phase=phase) / n:.1f}" for o in owners)
        lines.append(f"  - {what}: {n} micro-batches, {total} syncs, {total / n:.1f} per micro-batch"
                     + (f" ({split})" if split else ""))
    lines.append(f"  - rollout {counter.count(phase='rollout')}, the rest of the iteration {counter.count(phase='other')}")
    for owner, site, n in counter.sites():
        lines.append(f"  - {n} at {site} ({owner})")
    return lines


# ---------------------------------------------------------------------------------------- the profile
def profile_events(prof, *, device: str = "cuda") -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of a finished ``torch.profiler.profile``'s events on ``device`` ("cuda":
    kernels, copies and memsets; "cpu": host ops), in the profiler's clock."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    # on the GPU's timeline a record_function also appears as a span (a user annotation): not work
    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
            if e.device_type == want and not (want == DeviceType.CUDA and getattr(e, "is_user_annotation", False))]


def window_of(prof, name: str) -> tuple[float, float] | None:
    """The ``(start_us, end_us)`` of the host event ``name`` (a ``record_function``), None when absent."""
    spans = [(s, e) for n, s, e in profile_events(prof, device="cpu") if n == name]
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


def kernel_summary(events: list[tuple[str, float, float]], window: tuple[float, float], *, top: int = TOP_KERNELS,
                   gap_us: float = GAP_US) -> dict:
    """The GPU's time inside ``window`` (``(start_us, end_us)``): ``busy_us`` (the union of the events'
    intervals: overlapping kernels count once), ``wall_us``, ``idle`` (the share of the wall the GPU did
    nothing), ``gaps`` (idle stretches of at least ``gap_us``: count, total, largest), ``kernels`` (the
    ``top`` names by summed time: ``(name, calls, total_us)``) and ``count``.

    >>> s = kernel_summary([("a", 0, 10), ("b", 5, 20), ("a", 300, 310)], (0, 400))
    >>> s["busy_us"], s["idle"], s["gaps"], s["kernels"][0]
    (30.0, 0.925, {'count': 1, 'total_us': 280.0, 'largest_us': 280.0}, ('a', 2, 20.0))
    """
    lo, hi = float(window[0]), float(window[1])
    inside = sorted((max(float(s), lo), min(float(e), hi), n) for n, s, e in events if e > lo and s < hi)
    busy, gaps, cursor = 0.0, [], lo
    for s, e, _ in inside:
        if s > cursor:
            gaps.append(s - cursor)
        if e > cursor:
            busy += e - max(s, cursor)
            cursor = e
    if hi > cursor:
        gaps.append(hi - cursor)
    per: dict[str, list] = {}
    for s, e, n in inside:
        row = per.setdefault(n, [0, 0.0])
        row[0] += 1
        row[1] += e - s
    kernels = sorted(((n, c, t) for n, (c, t) in per.items()), key=lambda k: (-k[2], k[0]))[:top]
    wall = hi - lo
    long_gaps = [g for g in gaps if g >= gap_us]
    return {"busy_us": busy, "wall_us": wall, "idle": 1 - busy / wall if wall > 0 else 0.0, "count": len(inside),
            "gaps": {"count": len(long_gaps), "total_us": sum(long_gaps), "largest_us": max(gaps, default=0.0)},
            "kernels": kernels}


def host_ops(events: list[tuple[str, float, float]], window: tuple[float, float], *, top: int = 5,
             skip: tuple[str, ...] = ()) -> list[tuple[str, int, float]]:
    """The ``top`` host ops inside ``window`` by summed wall time: ``(name, calls, total_us)``; ``aten::``
    ops only (the nested record_function spans would count their children again)."""
    lo, hi = window
    per: dict[str, list] = {}
    for n, s, e in events:
        if n.startswith("aten::") and s >= lo and e <= hi and n not in skip:
            row = per.setdefault(n, [0, 0.0])
            row[0] += 1
            row[1] += e - s
    return sorted(((n, c, t) for n, (c, t) in per.items()), key=lambda k: (-k[2], k[0]))[:top]


def format_profile(summary: dict, *, label: str, host: list | None = None, width: int = 90) -> list[str]:
    """Report lines: the totals, then a table of the top kernels (CUDA ms, share of the busy time, calls, name).

    >>> lines = format_profile(kernel_summary([("gemm", 0, 1500), ("add", 2000, 2500)], (0, 4000)), label="x")
    >>> lines[0]
    '- profile (x): wall 4.0 ms, GPU busy 2.0 ms (50%), idle 50%; 2 kernels; 2 gaps >= 0.1 ms, 2.0 ms in all, the largest 1.5 ms'
    >>> lines[3]
    '  |     1.50 |  75.0% |     1 | gemm'
    """
    g = summary["gaps"]
    lines = [f"- profile ({label}): wall {summary['wall_us'] / 1e3:.1f} ms, GPU busy {summary['busy_us'] / 1e3:.1f} ms "
             f"({1 - summary['idle']:.0%}), idle {summary['idle']:.0%}; {summary['count']} kernels; {g['count']} gaps "
             f">= {GAP_US / 1e3:g} ms, {g['total_us'] / 1e3:.1f} ms in all, the largest {g['largest_us'] / 1e3:.1f} ms",
             "  |  CUDA ms | % busy | calls | kernel",
             "  |----------|--------|-------|-------"]
    busy = summary["busy_us"] or 1.0
    for name, calls, total in summary["kernels"]:
        short = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(f"  | {total / 1e3:8.2f} | {total / busy:6.1%} | {calls:5d} | {short}")
    if host:
        lines.append("  - host ops by wall time: " + ", ".join(f"{n} {t / 1e3:.1f} ms ({c})" for n, c, t in host))
    return lines


# ------------------------------------------------------------------------------------------- trainer piece
@contextlib.contextmanager
def _demo_hooks(results: dict):
    """Iteration :data:`PROFILED` under the profiler, :data:`SYNC_COUNTED` under the sync counter."""
    from unittest import mock

    import torch

    from megatron_credit.rollout.hf_engine import HFRolloutEngine
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor

    iteration, run, generate = step.rl_iteration, Actor.run, HFRolloutEngine.generate
    counter, microbatches, state = SyncCounter(), {}, {"n": 0, "counting": False}

    def labelled_run(self, mbs, *args, forward_only: bool, **kwargs):
        if not state["counting"]:
            return run(self, mbs, *args, forward_only=forward_only, **kwargs)
        label = "logprob" if forward_only else "update"
        microbatches[label] = microbatches.get(label, 0) + len(mbs)
        with counter.phase(label):
            return run(self, mbs, *args, forward_only=forward_only, **kwargs)

    def labelled_generate(self, *args, **kwargs):
        with counter.phase("rollout"):
            return generate(self, *args, **kwargs)

    def hooked(ctx, it):
        state["n"] += 1
        if state["n"] == PROFILED:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=acts) as prof:
                with torch.profiler.record_function("gpu_check/iteration"):
                    out = iteration(ctx, it)
                    torch.cuda.synchronize()  # the GPU's tail belongs to the iteration
            window = window_of(prof, "gpu_check/iteration")
            results["profile"] = kernel_summary(profile_events(prof), window)
            results["host"] = host_ops(profile_events(prof, device="cpu"), window)
            return out
        if state["n"] == SYNC_COUNTED:
            state["counting"] = True
            try:
                with counter.counting():
                    return iteration(ctx, it)
            finally:
                state["counting"] = False
                results["syncs"], results["microbatches"] = counter, microbatches
        return iteration(ctx, it)

    with mock.patch.object(step, "rl_iteration", hooked), mock.patch.object(Actor, "run", labelled_run), \
            mock.patch.object(HFRolloutEngine, "generate", labelled_generate):
        yield


def demo_recipe(out_dir: Path) -> Path:
    """The ``demo`` part's recipe for :data:`DEMO_ITERATIONS` iterations without the warm-up."""
    import yaml

    from tools.gpu_check_trainer import recipe_dict

    r = recipe_dict("demo_hf", te=False, hf_dir=str(out_dir / "hf"))
    r["train"]["steps"] = DEMO_ITERATIONS
    r["warmup"] = {"steps": 0}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def trainer_piece(out_dir: Path) -> list[str]:
    import pretrain_rl

    results: dict = {}
    path = demo_recipe(out_dir)
    t0 = time.perf_counter()
    with _demo_hooks(results):
        rc = pretrain_rl.main(["--config", str(path), "--output-dir", str(out_dir / "run"), "--resume", "none"])
    lines = [f"- demo recipe without warm-up, {DEMO_ITERATIONS} iterations: pretrain_rl.py exit {rc} in "
             f"{time.perf_counter() - t0:.0f} s"]
    if "profile" in results:
        lines += format_profile(results["profile"], label=f"demo iteration {PROFILED}, torch.profiler CPU + CUDA",
                                host=results.get("host"))
    else:
        lines.append(f"failed: iteration {PROFILED} was not profiled")
    if "syncs" in results:
        lines += format_syncs(results["syncs"], results["microbatches"], label=f"demo iteration {SYNC_COUNTED}")
    else:
        lines.append(f"failed: iteration {SYNC_COUNTED} did not run")
    return lines


# -------------------------------------------------------------------------------------------- decode piece
class _Deadline(Exception):
    pass


def decode_run(engine, *, prompts: list[list[int]], n: int, new_tokens: int, deadline: float | None = None) -> dict:
    """One timed generation: ``{"steps", "rows", "tokens", "seconds", "prefill_s", "decode_ms", "stopped"}``;
    ``stopped``: the deadline (``time.perf_counter()``) came first, the numbers are those of the steps run."""
    import torch

    from megatron_credit.rollout import SamplingParams

    marks: list[float] = []

    def between_steps():
        marks.append(time.perf_counter())
        if deadline is not None and marks[-1] > deadline:
            raise _Deadline
        return False

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.between_steps = between_steps
    sync()
    t0 = time.perf_counter()
    stopped = False
    try:
        batch = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n, seed=0))
        tokens = sum(len(s.response_ids) for s in batch.samples)
    except _Deadline:
        stopped, tokens = True, len(marks) * len(prompts) * n
    finally:
        engine.between_steps = None
    sync()
    seconds = time.perf_counter() - t0
    steps = tokens // (len(prompts) * n) if not stopped else len(marks)
    # each between_steps mark follows a step's one read of the device: the host has waited for its kernels
    decode_ms = 1e3 * (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else float("nan")
    return {"steps": steps, "rows": len(prompts) * n, "tokens": tokens, "seconds": seconds,
            "prefill_s": (marks[0] - t0) if marks else seconds, "decode_ms": decode_ms, "stopped": stopped}


def decode_syncs_per_step(engine, *, prompts: list[list[int]], steps: tuple[int, int] = SYNC_STEPS) -> dict[str, float]:
    """Host syncs of one decode step by owner: a ``steps[1]``-step generation's minus a ``steps[0]``-step
    one's, over the difference (pre-fill, set-up and the results read back cancel out)."""
    from megatron_credit.rollout import SamplingParams

    counts = []
    for k in steps:
        counter = SyncCounter()
        with counter.counting():
            engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=k, n=1, seed=0))
        counts.append(counter)
    owners = sorted({o for c in counts for o, _, _ in c.events})
    return {o: (counts[1].count(owner=o) - counts[0].count(owner=o)) / (steps[1] - steps[0]) for o in owners}


def format_decode(run: dict, syncs: dict[str, float] | None, *, label: str, target: int) -> list[str]:
    """Report lines of the decode piece.

    >>> run = {"steps": 1024, "rows": 8, "tokens": 8192, "seconds": 20.5, "prefill_s": 0.5, "decode_ms": 19.5,
    ...        "stopped": False}
    >>> format_decode(run, {"project": 1.0, "transformers": 1.0}, label="m", target=1024)[0]
    '- HF engine decode (m): 8 rows x 1024 steps in 20.5 s: 400 tokens/s, 19.5 ms per step (pre-fill and first step 0.50 s); 4,096 steps would take 80 s'
    >>> format_decode(run, {"project": 1.0, "transformers": 1.0}, label="m", target=1024)[1]
    '  - host syncs per decode step: project 1.0, transformers 1.0'
    """
    stop = f" (stopped at the part's time limit after {run['steps']} of {target} steps)" if run["stopped"] else ""
    lines = [f"- HF engine decode ({label}): {run['rows']} rows x {run['steps']} steps in {run['seconds']:.1f} s: "
             f"{run['tokens'] / run['seconds']:.0f} tokens/s, {run['decode_ms']:.1f} ms per step "
             f"(pre-fill and first step {run['prefill_s']:.2f} s); 4,096 steps would take {4096 * run['decode_ms'] / 1e3:.0f} s{stop}"]
    if syncs is not None:
        lines.append("  - host syncs per decode step: "
                     + (", ".join(f"{o} {v:.1f}" for o, v in syncs.items()) if syncs else "none"))
    return lines


def qwen15b_model(device: str, dtype):
    """Qwen2.5-1.5B's shape (``tools/gpu_check_trainer.py``'s), random weights made on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.gpu_check_trainer import _qwen25_15b_architecture

    arch = _qwen25_15b_architecture()
    fields = {k: v for k, v in arch.items() if k not in ("model_type", "dtype")}
    cfg = AutoConfig.for_model(arch["model_type"], **fields)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: 1.5B parameters on the host would take a while
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def decode_piece(*, deadline: float) -> list[str]:
    import torch

    from megatron_credit.rollout import HFRolloutEngine

    t0 = time.perf_counter()
    engine = HFRolloutEngine(model=qwen15b_model("cuda", torch.bfloat16), device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 151000, (DECODE_PROMPT_LEN,), generator=g).tolist() for _ in range(DECODE_PROMPTS)]
    built = time.perf_counter() - t0
    decode_run(engine, prompts=prompts, n=DECODE_N, new_tokens=8)  # warm: kernels chosen, allocator filled
    syncs = decode_syncs_per_step(engine, prompts=prompts[:2])
    torch.cuda.reset_peak_memory_stats()
    run = decode_run(engine, prompts=prompts, n=DECODE_N, new_tokens=DECODE_TOKENS, deadline=deadline)
    label = (f"Qwen2.5-1.5B shape, random weights, bf16, {DECODE_PROMPTS} prompts of {DECODE_PROMPT_LEN} tokens x "
             f"{DECODE_N}, built in {built:.0f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return format_decode(run, syncs, label=label, target=DECODE_TOKENS)


# ---------------------------------------------------------------------------------------------------- main
def _piece(name: str, fn, *args, **kwargs) -> bool:
    """Run one piece, print its lines; False when it raised (one ``failed:`` line) or printed a ``failed:``."""
    try:
        lines = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a piece's failure is reported, the next piece still runs
        print(f"failed: {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)
        return False
    for line in lines:
        print(line, flush=True)
    return not any(line.startswith("failed: ") for line in lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "all":
        print("usage: gpu_check_profile.py all DIR", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("skipped: CUDA is not available to torch")
        return SKIP
    start = time.perf_counter()
    limit = float(os.environ.get("GPU_CHECK_PART_LIMIT_S", "90"))
    ok = _piece("trainer", trainer_piece, Path(argv[1]) / "demo")
    ok &= _piece("decode", decode_piece, deadline=start + limit - 10)  # 10 s to report and exit
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
