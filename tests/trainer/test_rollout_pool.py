"""The rollout pool's channels (``sources/bridge.py``) between a trainer rank and a pool rank, on
gloo, and a pool rank killed under torchrun.

- weights: each version's HF-named buckets arrive whole and equal, in every dtype;
- samples: the groups an engine sends its replica heads arrive once, equal, with the bytes counted;
- waits end on silence, not on time: a wait longer than ``rollout.wait_timeout_s`` that keeps getting
  progress beats is not stopped; one that gets none is, in one line; a pool rank that stops living is named,
  in a wait or in the middle of a weight send or a sample exchange (as under SIGSTOP);
- a pool rank killed (SIGKILL) mid-run under torchrun ends the launch with a line naming it, and
  ``--resume auto`` continues with no iteration lost or repeated.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.support.distributed_harness import _free_port, module_pool
from tests.support.paths import ROOT
from tests.support.runs import metrics_rows, subprocess_env, tiny_recipe_file

pytestmark = pytest.mark.dist
pool2 = module_pool(2)


def _bridge(port: int, name: str, **kwargs):
    """Rank 0 a trainer rank, rank 1 a pool rank (one engine), over a store of their own."""
    import torch.distributed as dist

    from megatron_credit.distributed import Job
    from megatron_credit.sources.bridge import Bridge

    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    job = Job(store=dist.PrefixStore(name, store), rank=rank, world_size=2, pool_ranks=1)
    return Bridge(job, rollout_tp=1, device=torch.device("cpu"), timeout_s=60, **kwargs)


def _weights_and_samples(port: int):
    import torch.distributed as dist

    from megatron_credit.rollout.types import FinishStatus, RolloutSample
    from megatron_credit.rollout.wire import encode, payload_bytes

    b = _bridge(port, "ws")
    g = torch.Generator().manual_seed(0)
    buckets = [[("model.embed_tokens.weight", torch.randn(7, 5, generator=g))],
               [("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
                ("model.norm.weight", torch.randn(5, generator=g))]]

    def group(k):
        samples = [RolloutSample(prompt_ids=[1, 2, k], response_ids=[3, 4], logprobs=torch.tensor([-0.5, -0.25 * k]),
                                 status=FinishStatus.STOPPED, group_id=k, sample_index=i, logprobs_mode="raw")
                   for i in range(2)]
        return samples, torch.tensor([1.0, 0.0]), torch.tensor([True, False])

    if dist.get_rank() == 0:
        sent = [b.send_weights(v, iter(buckets)) for v in (3, 4)]
        got, nbytes = b.receive_groups(7)
        out = {"sent": sent, "keys": [k for k, _ in got], "nbytes": nbytes, "payload": payload_bytes(got),
               "message": encode(got).numel(),
               "lp": [s.logprobs.tolist() for _, (ss, _, _) in got for s in ss]}
    else:
        versions = [b.receive_weights(lambda: False) for _ in range(2)]
        b.send_groups(7, {0: [(1, group(1)), (0, group(0))]})
        b.wait_sent()
        with b.ring.take() as (staged, got):  # the newest version (3 was dropped when 4 came whole)
            out = {"versions": versions, "staged": staged,
                   "equal": all(torch.equal(x, y) and x.dtype == y.dtype and n == m
                                for gb, wb in zip(got, buckets, strict=True) for (n, x), (m, y) in zip(gb, wb))}
    dist.barrier()
    b.close()
    return out


def test_weights_and_samples_cross_once_and_whole(pool2):
    trainer, engine = pool2.run(_weights_and_samples, _free_port())
    assert engine == {"versions": [3, 4], "staged": 4, "equal": True}
    nbytes = 144 + 32 + 32  # 140, 30 and 20 bytes, each tensor at a multiple of 16 bytes
    assert trainer["sent"] == [nbytes, nbytes]  # one engine, one version each time
    assert trainer["keys"] == [0, 1]  # in the order of the batch, whatever order they were sent in
    assert trainer["lp"] == [[-0.5, 0.0], [-0.5, 0.0], [-0.5, -0.25], [-0.5, -0.25]]
    # one message: the wire encoding of the two groups, nothing else (its size against the payload at real
    # lengths: tests/rollout/test_wire.py)
    assert trainer["nbytes"] == trainer["message"] > trainer["payload"] > 0


PINNED_BUCKET = 200_000
"""bytes: a tiny Qwen2's version in 3 buckets: the embedding with layers 0 and 1 (layer 1 joins because its
first tensor, the input norm, still fits), layers 2 and 3, the final norm with the output layer."""


def _tiny_version(order, v: int):
    """Version ``v`` of a tiny model's weights (float32, drawn from ``v``) bucketed as the trainer buckets them:
    its HF tensors in conversion's order (``order``: names and shapes), grouped by ``group_buckets``."""
    from megatron_credit.rollout.weight_sync import group_buckets

    g = torch.Generator().manual_seed(v)
    return list(group_buckets([(n, torch.randn(shape, generator=g)) for n, shape in order],
                              bucket_bytes=PINNED_BUCKET))


def _pinned_versions(port: int, order):
    """The trainer sends versions 1-4 of a tiny model; the pool rank receives 1 and 2 (1 staged, then dropped),
    3 while 2 loads, and 4, which waits for that load to end; then loads 4. Returns the ring's pinned bytes
    after each version, whether 4 waited, and whether each loaded version was the one sent."""
    import threading

    import torch.distributed as dist

    b = _bridge(port, "pinned")
    out = None
    if dist.get_rank() == 0:
        for v in (1, 2, 3, 4):
            b.send_weights(v, iter(_tiny_version(order, v)))
    else:
        pinned, loaded = [], {}

        def receive():
            b.receive_weights(lambda: False)
            pinned.append(b.ring.pinned_bytes)

        def load(version, buckets):
            loaded[version] = all(n == m and torch.equal(x, y) for got, sent in
                                  zip(buckets, _tiny_version(order, version), strict=True)
                                  for (n, x), (m, y) in zip(got, sent, strict=True))

        receive()
        receive()
        with b.ring.take() as staged:
            receive()  # 3, into the bank 1 left
            fourth = threading.Thread(target=receive)
            fourth.start()
            time.sleep(0.2)
            waited = len(pinned) == 3 and b.ring.staged_version == 3  # 2 loading, 3 staged: no bank for 4
            load(*staged)  # 2, untouched by 3's receipt
        fourth.join(timeout=30)
        with b.ring.take() as staged:
            load(*staged)
        out = {"pinned": pinned, "waited": waited, "loaded": loaded}
    dist.barrier()
    b.close()
    return out


def test_a_pool_rank_pins_what_the_planner_says_and_no_more_with_versions(pool2):
    from megatron_credit.conversion import family_for_config
    from megatron_credit.conversion.streaming import expand_rules
    from megatron_credit.conversion.testing import hf_parameter_shapes, tiny_hf_config
    from megatron_credit.planning.architecture import Architecture
    from megatron_credit.planning.pool import host_block_bytes, staging_host_bytes, weight_buckets
    from megatron_credit.sources.bucket_bytes import pack

    cfg = tiny_hf_config("qwen2")
    shapes = hf_parameter_shapes(cfg)
    order = [(h, shapes[h]) for _, names, _ in expand_rules(family_for_config(cfg), cfg, fused_norms=False)
             for h in names]
    planned = weight_buckets(Architecture.from_hf(cfg), dtype_bytes=4, bucket_bytes=PINNED_BUCKET)
    # the planner's buckets are the trainer's, byte for byte
    assert [pack(bucket, torch.device("cpu"))[1].numel() for bucket in _tiny_version(order, 1)] == planned
    assert planned == [281_344, 247_808, 33_792]
    figure = staging_host_bytes(planned)
    assert figure == 2 * sum(map(host_block_bytes, planned)) == 2 * (2 ** 19 + 2 ** 18 + 2 ** 16)
    _, engine = pool2.run(_pinned_versions, _free_port(), order)
    # one bank for version 1, both from version 2 on (1 was staged when 2 came), and never more
    assert engine["pinned"] == [figure // 2, figure, figure, figure]
    assert engine["waited"] and engine["loaded"] == {2: True, 4: True}


def _closed(port: int):
    import gc
    import threading
    import weakref

    import torch.distributed as dist

    b = _bridge(port, "closed")
    b.start_alive()
    time.sleep(0.1)
    beats = b.count(f"alive/{dist.get_rank()}")
    ref = weakref.ref(b)
    had = (b.samples is not None, sorted(b.weights))
    b.close()
    released = (b.samples, b.pool, b.weights)  # shut down, then let go: nothing of them outlives the bridge
    alive = [t.name for t in threading.enumerate() if t.name == "pool-alive"]
    gc.disable()  # freed by its last reference, in this thread, not by a collection
    del b
    freed = ref() is None
    gc.enable()
    dist.barrier()
    return beats, alive, freed, had, released


def test_close_ends_the_life_beat_and_the_bridge_dies_in_the_closing_thread(pool2):
    # A daemon thread inside a torch call that released the GIL when the interpreter finalizes aborts the
    # process after a finished run (SIGABRT): the beat thread is joined, and it never holds the bridge, whose
    # process groups are shut down and released at close (an NCCL communicator is destroyed there).
    for beats, alive, freed, had, released in pool2.run(_closed, _free_port()):
        assert beats >= 1 and alive == [] and freed
        assert had == (True, [0]) and released == (None, None, {})  # the samples and the weights groups


def _silence(port: int, beat_for_s: float, gone: bool):
    import torch.distributed as dist

    from megatron_credit.cli import RunStopped
    from megatron_credit.sources import bridge as br

    br.GONE_S = 3.0
    b = _bridge(port, f"s{beat_for_s}{gone}")
    out = None
    if dist.get_rank() == 1:
        b.count("alive/1", 1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < beat_for_s and not b.store.check(["done"]):  # progress every 0.5 s, and life
            b.count("hb/0", 1)
            if not gone:
                b.count("alive/1", 1)
            time.sleep(0.5)
        if not gone:
            b.put("batch/1", {"ok": 1})
        b.store.wait(["done"])
    else:
        t0 = time.monotonic()
        try:
            out = ("value", b.wait_for("batch/1", what="iteration 1 waited for its batch", silence_s=2.0))
        except RunStopped as exc:
            out = ("stopped", str(exc))
        out = (*out, time.monotonic() - t0)
        b.store.set("done", "1")
    dist.barrier()
    return out


def test_a_wait_longer_than_the_timeout_that_gets_progress_is_not_stopped(pool2):
    kind, value, waited = pool2.run(_silence, _free_port(), 6.0, False)[0]
    assert (kind, value) == ("value", {"ok": 1}) and waited > 5.0  # 3x the 2 s silence timeout


def test_a_pool_rank_that_stops_living_is_named_in_one_line(pool2):
    kind, line, waited = pool2.run(_silence, _free_port(), 60.0, True)[0]  # beats progress, but not life
    assert kind == "stopped" and waited < 10
    assert line == ("rollout pool rank 1 (engine 0's leader) is gone: no sign of life for 3 s while iteration 1 "
                    "waited for its batch (killed, stopped by a signal, or its machine lost)")


def _stalled_exchange(port: int, exchange: str):
    """Rank 1, an engine's leader, lives for 1 s, then stops beating and never takes part in ``exchange``
    (as under SIGSTOP); rank 0 sends a version's weights (64 MiB: more than the sockets hold) or waits for a
    batch's samples."""
    import torch.distributed as dist

    from megatron_credit.cli import RunStopped
    from megatron_credit.sources import bridge as br

    br.GONE_S = 30.0  # its default (the workers are shared with tests that shorten it)
    b = _bridge(port, f"stalled-{exchange}", wait_timeout_s=6.0)
    out = None
    if dist.get_rank() == 0:
        t0 = time.monotonic()
        try:
            if exchange == "weights":
                b.send_weights(1, iter([[("model.embed_tokens.weight", torch.zeros(16 << 20))]]))
            else:
                b.receive_groups(1)
            out = ("done", "")
        except RunStopped as exc:
            out = ("stopped", str(exc))
        out = (*out, time.monotonic() - t0, b.wedged)
        t1 = time.monotonic()
        b.close()  # the exchange left in flight: its groups are kept, not destroyed (which would wait)
        out = (*out, time.monotonic() - t1)
        b.store.set("done", "1")
    else:
        for _ in range(4):
            b.count("alive/1", 1)
            time.sleep(0.25)
        b.store.wait(["done"])
    dist.barrier()
    return out


@pytest.mark.parametrize("exchange,what", [("weights", "sending version 1's weights"),
                                           ("samples", "receiving iteration 1's samples")])
def test_an_exchange_with_a_pool_rank_that_stops_living_ends_in_one_line(pool2, exchange, what):
    kind, line, waited, wedged, closing = pool2.run(_stalled_exchange, _free_port(), exchange)[0]
    # rollout.wait_timeout_s = 6 s: life_s is 6 s (not the 30 s of GONE_S), counted from the trainer's first look
    assert (kind, wedged) == ("stopped", True) and 6.0 < waited < 9.0 and closing < 1.0
    assert line == (f"rollout pool rank 1 (engine 0's leader) is gone: no sign of life for 6 s while {what} "
                    "(killed, stopped by a signal, or its machine lost)")


def _silent(port: int):
    import torch.distributed as dist

    from megatron_credit.cli import RunStopped

    b = _bridge(port, "quiet")
    out = None
    if dist.get_rank() == 0:
        t0 = time.monotonic()
        try:
            b.wait_for("batch/1", what="iteration 1 waited for its batch", silence_s=2.0)
        except RunStopped as exc:
            out = (str(exc), time.monotonic() - t0)
        b.store.set("done", "1")
    else:
        b.count("hb/0", 1)
        b.store.wait(["done"])
    dist.barrier()
    return out


def test_a_pool_that_makes_no_progress_stops_the_wait_in_one_line(pool2):
    line, waited = pool2.run(_silent, _free_port())[0]
    assert 2.0 <= waited < 6.0
    assert line == ("iteration 1 waited for its batch: the rollout pool made no progress for 2 s "
                    "(rollout.wait_timeout_s; a draw or a few decode steps count)")


def _trainer_gone(port: int):
    import torch.distributed as dist

    from megatron_credit.sources import bridge as br

    br.GONE_S = 2.0
    b = _bridge(port, "tg")
    out = None
    if dist.get_rank() == 0:  # trainer rank 0 lives for 3 s, then stops beating (as if killed)
        for _ in range(6):
            b.count("alive/0", 1)
            time.sleep(0.5)
        b.store.wait(["seen"])
    else:
        t0, states = time.monotonic(), []
        while time.monotonic() - t0 < 12 and not (states and states[-1]):
            states.append(b.gone(0))
            time.sleep(0.25)
        out = (states[-1], any(states[:8]), time.monotonic() - t0)
        b.store.set("seen", "1")
    dist.barrier()
    return out


def test_a_pool_rank_sees_trainer_rank_0_stop_living(pool2):
    gone, early, waited = pool2.run(_trainer_gone, _free_port())[1]
    assert gone and not early and 4.0 < waited < 8.0  # alive for 3 s, then gone 2 s after its last beat


# ------------------------------------------------------------------------------------ under torchrun
def _recipe(tmp_path, **sections) -> str:
    return tiny_recipe_file(tmp_path, "pool-warmup-cache", **sections)


def _torchrun(n: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
            str(_free_port()), os.path.join(ROOT, "pretrain_rl.py"), *map(str, args)]


def _pool_rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the worker of global rank ``rank`` under ``launcher`` (torchrun's worker environment)."""
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    for pid in map(int, out.stdout.split()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except FileNotFoundError:
            continue
        if env.get(b"RANK") == str(rank).encode():
            return pid
    raise AssertionError(f"no worker of rank {rank}")


def test_a_pool_rank_killed_under_torchrun_ends_the_launch_and_resume_is_exact(tmp_path):
    from megatron_credit.trainer import checkpoint as ckpt

    recipe = _recipe(tmp_path, train={"steps": 6, "val_every": 0}, checkpoint={"every": 1, "keep": 10})
    common = ["rollout.mode=one_step_off", "rollout.ranks=2", "logging.progress=false"]
    whole = subprocess.run(_torchrun(4, "--config", recipe, "--output-dir", tmp_path / "whole", *common),
                           capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = tmp_path / "split"
    launcher = subprocess.Popen(_torchrun(4, "--config", recipe, "--output-dir", run, *common), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=subprocess_env())
    t0 = time.time()
    while not (run / "metrics.jsonl").exists() or len(metrics_rows(run)) < 2:  # while the pool sends batch 3
        assert launcher.poll() is None and time.time() - t0 < 300, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(_pool_rank_pid(launcher, 3), signal.SIGKILL)  # the second engine
    t_kill = time.time()
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and time.time() - t_kill < 60
    assert "rank: 3" in err and "Signal 9" in err, err[-3000:]  # torchrun's summary names the rank and the signal
    again = subprocess.run(_torchrun(4, "--config", recipe, "--output-dir", run, *common, "--resume", "auto"),
                           capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [r["step"] for r in metrics_rows(run)]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6] and steps[-1] == 6
    cursor = lambda d, s: ckpt.rank0_extras(os.path.join(d, "checkpoints", f"iter_{s:07d}"))["prompts"]["cursor"]  # noqa: E731
    assert cursor(run, 6) == cursor(tmp_path / "whole", 6) == 8 * 6  # every iteration's prompts once


def test_an_exit_signal_to_the_whole_job_saves_the_iteration_and_the_pool_ends_with_it(tmp_path):
    # SIGTERM to every process of the job (a scheduler's pre-emption): the trainer finishes the iteration in
    # flight, saves it and exits 0; the pool rank ignores the signal and exits when the trainer says stop.
    from megatron_credit.run_dir import complete_checkpoints
    from tests.support.leftovers import marked_env, wait_until_none_left

    run = tmp_path / "run"
    env, mark = marked_env(subprocess_env())
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", _recipe(tmp_path),
                             "--output-dir", str(run), "train.steps=500", "train.val_every=0", "checkpoint.every=0",
                             "checkpoint.save_at_end=false", "rollout.mode=one_step_off", "rollout.ranks=1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    t0 = time.time()
    while not (run / "metrics.jsonl").exists() or len(metrics_rows(run)) < 2:
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    saved = complete_checkpoints(str(run))
    assert len(saved) == 1 and f"SIGTERM: saved iteration {saved[0][0]}, exiting" in out
    assert [r["step"] for r in metrics_rows(run)] == list(range(1, saved[0][0] + 1))
    assert wait_until_none_left(mark) == []  # the pool rank ended with the trainer
