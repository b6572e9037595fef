"""megatron_credit.distributed: launch environment, CPU RNG tracker, megatron groups on gloo, the entry point."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_credit.distributed import LaunchEnv
from megatron_credit.distributed.cpu_shims import CpuRNGStatesTracker
from tests.support.distributed_harness import module_pool
from tests.support.paths import ROOT


def test_launch_env_from_torchrun_variables():
    env = LaunchEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                  "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == \
        (3, 8, 1, "node0", 29500)
    assert LaunchEnv.from_environ({}) == LaunchEnv()


def test_cpu_rng_tracker_forks_streams_and_restores_the_default():
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 5)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("b", 5)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    expected = torch.rand(6, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat([first, second]), expected)  # the stream continues across forks
    with pytest.raises(RuntimeError, match="not added"):
        with tracker.fork("missing"):
            pass


pool = module_pool(2)


def _groups_and_seeds(tp, cp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    distributed.initialize(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp),
                           seed=7)
    default = torch.rand(2)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(2)
    out = dict(tp=ps.get_tensor_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
               dp=ps.get_data_parallel_world_size(), default=default, mp=model_parallel)
    distributed.destroy()
    dist.barrier()
    return out


def _refuse_bad_world():
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    try:
        distributed.initialize(ParallelConfig(pipeline_model_parallel_size=4), seed=0)
    except ValueError as e:
        return str(e), ps.model_parallel_is_initialized()
    return None, ps.model_parallel_is_initialized()


class _TwoLayers(torch.nn.Module):
    """``b`` is used only when ``use_b``: one rank of the test leaves its grad None."""

    def __init__(self):
        super().__init__()
        from megatron.core.transformer import TransformerConfig

        self.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                                        calculate_per_token_loss=True)
        self.a = torch.nn.Parameter(torch.ones(3))
        self.b = torch.nn.Parameter(torch.ones(2))
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x, *, use_b):
        return (self.a * x).sum() + ((self.b * x[:2]).sum() if use_b else 0.0)


def _finalize_with_a_param_unused_on_rank_1():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit import distributed
    from megatron_credit.distributed.grads import finalize, grad_of, wrap_ddp

    distributed.initialize(ParallelConfig(), seed=1)  # DP = 2: megatron DDP reduces over its group
    try:
        rank = dist.get_rank()
        model = _TwoLayers()
        ddp = wrap_ddp(model)
        out = []
        for step in range(2):  # the second step after zero_grad_buffer: nothing left from the first
            x = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1) * (step + 1)
            ddp(x, use_b=rank == 0).backward()
            finalize(ddp)
            out.append((grad_of(model.a).clone(), grad_of(model.b).clone()))
            ddp.zero_grad_buffer()
        return out, grad_of(model.frozen), ps.get_data_parallel_world_size()
    finally:
        distributed.destroy()


@pytest.mark.dist
def test_megatron_ddp_sums_gradients_with_a_param_unused_on_one_rank(pool):
    for steps, frozen, dp in pool.run(_finalize_with_a_param_unused_on_rank_1):
        assert dp == 2 and frozen is None  # frozen params get no gradient buffer
        for k, (a, b) in enumerate(steps, start=1):
            # d/da sum_r (a . x_r) = x_0 + x_1 = 3 k x; b is used on rank 0 only: k x_0[:2] on both ranks.
            torch.testing.assert_close(a, k * torch.tensor([3.0, 6.0, 9.0]), rtol=0, atol=0)
            torch.testing.assert_close(b, k * torch.tensor([1.0, 2.0]), rtol=0, atol=0)


@pytest.mark.dist
def test_megatron_groups_and_seeds_on_gloo(pool):
    a, b = pool.run(_groups_and_seeds, 2, 1)
    assert (a["tp"], a["cp"], a["dp"]) == (2, 1, 1)
    assert torch.equal(a["default"], b["default"])  # same default seed: same CPU-initialised weights
    assert not torch.equal(a["mp"], b["mp"])  # TP ranks draw different dropout masks
    a, b = pool.run(_groups_and_seeds, 1, 2)
    assert (a["tp"], a["cp"], a["dp"]) == (1, 2, 1)
    assert torch.equal(a["mp"], b["mp"])  # same TP rank: same model-parallel stream
    a, _ = pool.run(_groups_and_seeds, 1, 1)
    assert a["dp"] == 2


def _threads_after_init_destroy_cycles(n):
    import os

    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    counts = []
    for _ in range(n):
        distributed.initialize(ParallelConfig(tensor_model_parallel_size=2), seed=1)
        distributed.destroy()
        dist.barrier()
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
@pytest.mark.dist
def test_destroy_frees_the_gloo_threads_of_megatrons_groups(pool):
    # Each gloo group holds three threads until destroyed; before the fix every initialize/destroy cycle
    # left ~51 of them behind (the counts went 60, 111, 162, ...), and a test pool worker reached 1,500.
    for counts in pool.run(_threads_after_init_destroy_cycles, 4):
        assert counts[1:] == counts[:-1], counts


@pytest.mark.dist
def test_sizes_not_fitting_the_world_are_refused_before_any_group(pool):
    for message, initialised in pool.run(_refuse_bad_world):
        assert "world_size 2 is not divisible" in message and "pipeline_model_parallel_size (4)" in message
        assert not initialised


@pytest.mark.dist
def test_entry_point_refuses_a_bad_override():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config",
         os.path.join(ROOT, "examples", "demo_cpu.yaml"), "parallel.tensor_model_parallel_size=3"],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT,
        timeout=300)
    assert proc.returncode != 0
    assert "tensor_model_parallel_size=3 does not divide num_attention_heads" in proc.stderr


def test_the_launchers_local_rank_selects_the_device(monkeypatch):
    # LOCAL_RANK is read at the entry point (LaunchEnv) and wins over counting the ranks on this host: a
    # launcher may place ranks round-robin over nodes, or order them on a node as it likes.
    import socket

    import torch.distributed as dist

    from megatron_credit.trainer import loop

    assert LaunchEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4"}).local_rank is None
    hosts = ["a", "b", "a", "b"]  # rank 3 is the second rank of host b
    monkeypatch.setattr(socket, "gethostname", lambda: "b")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)

    def gather(out, mine, group=None):
        out[:] = [(r // 2, host) for r, host in enumerate(hosts)]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    assert loop._dp_ranks_and_node(1) == ([0, 0, 1, 1], 1, 2)  # no LOCAL_RANK: its place on its host
    assert loop._dp_ranks_and_node(1, local_rank=0) == ([0, 0, 1, 1], 0, 2)  # the launcher's word


def test_an_nccl_group_is_joined_with_its_device_named(monkeypatch):
    """On a GPU the default group is created with ``device_id`` = this rank's local GPU, so NCCL binds its
    communicator to it instead of guessing from the global rank. The CUDA calls are stood in for (no GPU
    here); the call stops at ``init_process_group``, whose keyword arguments are the subject."""
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    class Joined(Exception):
        pass

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Joined

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set_device", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    launch = LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(Joined):
        distributed.initialize(ParallelConfig(), seed=0, launch=launch, backend="nccl")
    assert seen["backend"] == "nccl" and seen["set_device"] == 1
    assert seen["device_id"] == torch.device("cuda", 1) and seen["rank"] == 5
    seen.clear()
    with pytest.raises(Joined):
        distributed.initialize(ParallelConfig(), seed=0, launch=launch, backend="gloo")
    assert "device_id" not in seen  # gloo on the CPU: no device to bind
