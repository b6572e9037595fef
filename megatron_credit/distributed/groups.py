"""Process groups: the launch a process is part of, the default group (NCCL on GPU, gloo on CPU), megatron's
``parallel_state`` groups and their timeouts, and their teardown. :func:`initialize` is called once per
process by the entry point; the launcher's environment (torchrun's ``RANK`` etc.) is read by
``LaunchEnv.from_environ`` at the entry point only and passed in."""
from __future__ import annotations

import dataclasses
import datetime
import socket
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_credit.distributed.cpu_shims import define_missing_te_names, install_cpu_shims
from megatron_credit.distributed.megatron_compat import import_megatron_core
from megatron_credit.distributed.seeds import set_seed


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as a launcher (torchrun, Slurm wrapper) describes it."""

    rank: int = 0
    """Global rank."""
    world_size: int = 1
    """Number of processes."""
    local_rank: Optional[int] = None
    """Rank on this node as the launcher sets it (``LOCAL_RANK``; selects the GPU); None when it does not say:
    device 0 for one process, and the trainer counts the ranks on its host (``trainer/loop.py``)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host."""
    master_port: Optional[int] = None
    """Rendezvous port; None picks a free local port (single process only)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "LaunchEnv":
        """Read torchrun's variables; without them, a single process.

        >>> LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                         "MASTER_ADDR": "h", "MASTER_PORT": "29500"}).rank
        1
        >>> LaunchEnv.from_environ({}).world_size, LaunchEnv.from_environ({}).local_rank
        (1, None)
        """
        port, local = environ.get("MASTER_PORT"), environ.get("LOCAL_RANK")
        return cls(rank=int(environ.get("RANK", 0)), world_size=int(environ.get("WORLD_SIZE", 1)),
                   local_rank=int(local) if local is not None else None,
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(port) if port else None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclasses.dataclass(frozen=True)
class Job:
    """The whole launch when some of its ranks are a rollout pool (``rollout.ranks``): the launcher's
    rendezvous store (every rank of the world reaches it), this rank and the sizes. The trainer's default
    process group (and megatron's groups in it) holds the first ``world_size - pool_ranks`` ranks only; the
    pool's channels are built from :attr:`store` (``sources/bridge.py``)."""

    store: Any
    rank: int
    world_size: int
    pool_ranks: int


_JOB: Optional[Job] = None


def join_job(launch: LaunchEnv, *, pool_ranks: int, timeout: datetime.timedelta) -> Job:
    """Reach the launch's rendezvous store as rank ``launch.rank`` of ``launch.world_size`` (torchrun's agent
    store under torchrun; else rank 0 hosts it at ``MASTER_ADDR:MASTER_PORT``); once per process."""
    global _JOB
    if _JOB is None:
        if launch.master_port is None:
            raise ValueError("a rollout pool (rollout.ranks) needs MASTER_ADDR / MASTER_PORT: launch with torchrun")
        url = f"tcp://{launch.master_addr}:{launch.master_port}?rank={launch.rank}&world_size={launch.world_size}"
        store, _, _ = next(dist.rendezvous(url, timeout=timeout))
        _JOB = Job(store=store, rank=launch.rank, world_size=launch.world_size, pool_ranks=pool_ranks)
    return _JOB


def job() -> Optional[Job]:
    """The launch of :func:`join_job` (None without a rollout pool)."""
    return _JOB


def initialize(parallel, *, seed: int, launch: Optional[LaunchEnv] = None,
               backend: Optional[str] = None, timeout_s: Optional[float] = None, pool_ranks: int = 0) -> torch.device:
    """Join the process group, build megatron's parallel groups, seed; return this rank's device.

    ``parallel``: a ``megatron_credit.recipe.config.ParallelConfig``. If ``torch.distributed`` is already
    initialised (tests, an embedding application) its group and backend are used as they are; else a
    group is created from ``launch`` (default: one process). ``timeout_s`` (the recipe's
    ``distributed.timeout_s``, passed by the entry point; None: ``torch.distributed``'s default of 30
    minutes, for short programs and tests) is the timeout of the default group (set on it also
    when it already exists) and of every megatron group: ranks wait in them while the engines generate.
    Raises ``ValueError`` before creating any megatron group if the sizes do not fit the world size.
    ``pool_ranks`` (``rollout.ranks``): the last ranks of the launch are a rollout pool; this rank is one of
    the first ``world_size - pool_ranks``, whose default group and megatron groups hold only them.
    """
    timeout_s = dist.default_pg_timeout.total_seconds() if timeout_s is None else float(timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    import_megatron_core()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        launch = launch or LaunchEnv()
        world = launch.world_size - pool_ranks
        parallel.validate(world_size=world)
        backend = backend or default_backend()
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, and this machine has none (torch.cuda.is_available() is "
                             "False): use gloo (the default without CUDA)")
        bound = {}
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank or 0)
            # The group's device, named: NCCL binds its communicator to it at once instead of guessing from the
            # current device at the first collective ("Guessing device ID based on global rank").
            bound = {"device_id": torch.device("cuda", launch.local_rank or 0)}
        if pool_ranks:  # the trainer's world is a prefix of the launch's, in a store namespace of its own
            store = join_job(launch, pool_ranks=pool_ranks, timeout=timeout).store
            dist.init_process_group(backend, store=dist.PrefixStore("trainer", store), rank=launch.rank,
                                    world_size=world, timeout=timeout, **bound)
        else:
            port = launch.master_port or free_port()
            dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{port}",
                                    rank=launch.rank, world_size=launch.world_size, timeout=timeout, **bound)
    else:
        set_group_timeout(None, timeout)
    backend = dist.get_backend()
    parallel.validate(world_size=dist.get_world_size())
    on_cpu = backend == "gloo" and not torch.cuda.is_available()
    if on_cpu:
        install_cpu_shims()
    define_missing_te_names()  # megatron's MoE router without Transformer Engine, whatever the device
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=getattr(parallel, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(parallel, "expert_tensor_parallel_size", None),
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    # megatron creates some groups without its timeout (EXPERT_DATA_PARALLEL_GROUP_GLOO: 30 minutes)
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        set_group_timeout(group, timeout)
    set_seed(seed, on_cpu=on_cpu)
    return device


def set_group_timeout(group, timeout: datetime.timedelta) -> None:
    """Set the timeout of an existing process group (None: the default group) on each of its backends."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


def group_timeouts() -> dict[str, float]:
    """The timeout in seconds of every live process group, by group name, read from each group's backends
    (the smallest where they differ): what a test checks against ``distributed.timeout_s``."""
    from torch.distributed import distributed_c10d

    out: dict[str, float] = {}
    for group in list(distributed_c10d._world.pg_map):
        name = distributed_c10d._get_process_group_name(group)
        seconds = []
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except RuntimeError:
                continue
            seconds.append(backend.options._timeout.total_seconds())
        out[name] = min(seconds)
    return out


def data_parallel_rank() -> int:
    """This rank's data-parallel rank (megatron's groups, after :func:`initialize`)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def destroy(*, process_group: bool = False) -> None:
    """Tear down megatron's groups (and the default process group when ``process_group``).

    ``destroy_model_parallel`` only forgets megatron's groups; each gloo group keeps three threads
    (two ``pt_gloo_runloop``, one ``gloo_tcp_loop``) until it is destroyed. A process that initializes
    again (a test pool's worker, a resumed run in the same process) gained ~50 threads per cycle, and
    with hundreds of them the machine's run queue filled. So every group but the default one is
    destroyed here; destroying a subgroup is local (no collective).
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        from torch.distributed import distributed_c10d

        default = distributed_c10d._get_default_group()
        for group in list(distributed_c10d._world.pg_map):
            if group is not default:
                dist.destroy_process_group(group)
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
