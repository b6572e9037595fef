"""torch.distributed and megatron's ``parallel_state``: process groups, seeds, megatron-core's versions.

- :mod:`~megatron_credit.distributed.groups`: the launch, the default group and megatron's TP / PP / CP /
  DP / EP groups (``initialize``, ``destroy``), their timeouts;
- :mod:`~megatron_credit.distributed.seeds`: seeds and the RNG states a checkpoint keeps;
- :mod:`~megatron_credit.distributed.megatron_compat`: megatron-core's version differences;
- :mod:`~megatron_credit.distributed.cpu_shims`: the CPU shims megatron-core needs (and only they);
- :mod:`~megatron_credit.distributed.grads`: gradient reduction over DP x CP, TP and the embedding group.

The names callers use are handed on here (``from megatron_credit import distributed``).
"""
from megatron_credit.distributed.groups import (Job, LaunchEnv, data_parallel_rank, default_backend, destroy, free_port,
                                                group_timeouts, initialize, job, join_job, set_group_timeout)
from megatron_credit.distributed.megatron_compat import get_batch_on_this_cp_rank, import_megatron_core
from megatron_credit.distributed.seeds import cpu_rng_stream_seeds, rng_state, set_rng_state, set_seed

__all__ = ["Job", "LaunchEnv", "cpu_rng_stream_seeds", "data_parallel_rank", "default_backend", "destroy", "free_port",
           "get_batch_on_this_cp_rank", "group_timeouts", "import_megatron_core", "initialize", "job", "join_job",
           "rng_state", "set_group_timeout", "set_rng_state", "set_seed"]
