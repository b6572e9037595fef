"""Seeds and RNG states: every generator seeded alike on every rank (python, numpy, torch, megatron's RNG
tracker, whose streams shim 1 of ``cpu_shims`` provides on the CPU), and the states a checkpoint's rank file
keeps so that a resumed run draws what the uninterrupted one would have."""
from __future__ import annotations

import random
from typing import Any

import torch

from megatron_credit.distributed.cpu_shims import CpuRNGStatesTracker

# Seed offsets follow megatron's model_parallel_cuda_manual_seed (tensor_parallel/random.py), so CPU
# and GPU runs draw dropout masks from the same seeds.
_TP_SEED_OFFSET = 2718
_EP_SEED_OFFSET = 1024


def set_seed(seed: int, *, on_cpu: bool) -> None:
    """Seed python, numpy and torch, and megatron's RNG tracker (TP-rank-dependent dropout seeds).

    Every rank gets the same default seed, so ``use_cpu_initialization`` builds the same full weights
    on every rank before slicing them (TP/PP shards of one model).
    """
    from megatron.core import parallel_state, tensor_parallel

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a dependency; this only keeps seeding usable without it
        pass
    torch.manual_seed(seed)
    if not on_cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    for name, stream_seed in cpu_rng_stream_seeds(
            seed, tp_rank=parallel_state.get_tensor_model_parallel_rank()).items():
        tracker.add(name, stream_seed)
    # Shim 1: tensor_parallel/random.py initialize_rng_tracker() returns early once
    # _CUDA_RNG_STATE_TRACKER_INITIALIZED is set, so get_cuda_rng_tracker() hands out this tracker
    # (unchanged 0.16.1 - 0.19.2; 0.19 adds GTP-remat streams only when that axis is > 1, never here).
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if mrandom.get_cuda_rng_tracker() is not tracker:
        raise RuntimeError("megatron-core's tensor_parallel.random.get_cuda_rng_tracker() no longer "
                           "returns _CUDA_RNG_STATE_TRACKER once _CUDA_RNG_STATE_TRACKER_INITIALIZED "
                           "is set: the CPU RNG shim (megatron_credit/distributed/seeds.py) needs updating")


def cpu_rng_stream_seeds(seed: int, *, tp_rank: int) -> dict[str, int]:
    """The named RNG streams of shim 1 and their seeds: those of megatron's
    ``model_parallel_cuda_manual_seed`` without expert parallelism (ep_rank 0, and the expert-TP rank
    equals the TP rank because ``expert_tensor_parallel_size`` defaults to the TP size)."""
    from megatron.core.tensor_parallel import random as mrandom

    return {mrandom._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + _TP_SEED_OFFSET + tp_rank,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + _EP_SEED_OFFSET + tp_rank}


def rng_state() -> dict[str, Any]:
    """This rank's RNG states (torch, python, megatron's RNG tracker, CUDA when present): what a
    checkpoint's rank file keeps, so a resumed run draws what the uninterrupted one would have."""
    from megatron.core.tensor_parallel import random as mrandom

    state = {"torch": torch.get_rng_state(), "python": list(_py_state()),
             "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _py_state():
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
