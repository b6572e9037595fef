"""NCCL's buffers on one GPU, counted from the process groups a layout makes (the planner's ``nccl_buffers`` term).

NCCL gives each communicator, on each of its GPUs, a buffer per channel per peer connection; the Simple
protocol's (``NCCL_BUFFSIZE``, 4 MiB by default) is the large one. The estimate per group of ``n`` ranks:

    bytes = 0                                         (n == 1: no peer, no buffer)
    bytes = NCCL_BUFFSIZE x NCCL_CHANNELS x peers     (n >= 2)

with ``peers`` 2 for a collective group (the ring links each rank to the one before it and the one after;
NCCL's trees reuse the ring's peers within a node) and for a pipeline group of more than two stages (the
stage before and the one after), 1 for a pipeline group of two stages. ``NCCL_CHANNELS`` is 16, the
order NCCL builds for collectives over the NVLink of one Hopper node (``NCCL_MAX_NCHANNELS`` caps it).
With NCCL's defaults a group of two or more ranks thus holds 128 MiB a GPU.

Which groups: megatron-core's ``initialize_model_parallel`` (0.16 - 0.19, ``parallel_state.py``) creates the
dp-cp, dp, cp, tp-pp, tp, pp, embedding, position-embedding, tp-dp-cp, tp-dp, tp-cp and expert groups on
every rank, but torch makes a group's NCCL communicator at the group's first collective, so only the groups
the trainer calls hold buffers (:func:`nccl_groups`). Not counted: the LL / LL128 protocols' smaller
buffers, NVLink SHARP's (NVLS, on NVSwitch machines, unless ``NCCL_NVLS_ENABLE=0``) and the vLLM
engine's own communicators (inside its ``gpu_memory_utilization``): the planner's allocator slack covers them.
"""
from __future__ import annotations

NCCL_BUFFSIZE = 4 << 20
"""NCCL's default ``NCCL_BUFFSIZE``: the Simple protocol's buffer per channel per peer, bytes."""
NCCL_CHANNELS = 16
"""Channels per communicator: the order NCCL builds over one Hopper node's NVLink."""


def nccl_groups(*, tp: int, pp: int, cp: int, dp: int, tied_embeddings: bool) -> dict[str, tuple[int, int]]:
    """``{group: (ranks, peers)}`` of the groups one rank's collectives reach, for a layout of TP x PP x CP x DP.

    - ``world``: the default group (barriers, the samples' all-to-all, gathered metrics);
    - ``tp``: the tensor-parallel layers' all-reduces and all-gathers;
    - ``pp``: activations and their gradients sent between neighbouring stages;
    - ``cp``: context-parallel attention and the credit scan's carries;
    - ``dp``: the step's token and sequence counts;
    - ``dp_cp``: DDP's gradient reduction (and the distributed optimizer's gathers);
    - ``tp_pp``: megatron's optimizer's gradient norm (the model-parallel group);
    - ``embedding``: the tied embedding's gradient, first and last stage (PP > 1 only).

    >>> nccl_groups(tp=8, pp=2, cp=2, dp=1, tied_embeddings=False)["pp"], nccl_groups(tp=1, pp=3, cp=1, dp=1,
    ...                                                                              tied_embeddings=True)["pp"]
    ((2, 1), (3, 2))
    """
    groups = {"world": (tp * pp * cp * dp, 2), "tp": (tp, 2), "pp": (pp, 2 if pp > 2 else 1), "cp": (cp, 2),
              "dp": (dp, 2), "dp_cp": (dp * cp, 2), "tp_pp": (tp * pp, 2)}
    if tied_embeddings and pp > 1:
        groups["embedding"] = (2, 1)
    return groups


def group_buffer_bytes(ranks: int, peers: int) -> int:
    """NCCL's buffers on one GPU of a group of ``ranks`` with ``peers`` connections (module docstring).

    >>> group_buffer_bytes(1, 2), group_buffer_bytes(8, 2) // 2 ** 20
    (0, 128)
    """
    return 0 if ranks < 2 else NCCL_BUFFSIZE * NCCL_CHANNELS * peers


def nccl_buffer_bytes(*, tp: int, pp: int, cp: int, dp: int, tied_embeddings: bool) -> tuple[int, list[str]]:
    """(bytes on one GPU, the names of the groups that hold them) for the layout.

    >>> nbytes, names = nccl_buffer_bytes(tp=8, pp=2, cp=2, dp=1, tied_embeddings=False)
    >>> nbytes // 2 ** 20, names
    (704, ['world', 'tp', 'pp', 'cp', 'dp_cp', 'tp_pp'])
    """
    groups = nccl_groups(tp=tp, pp=pp, cp=cp, dp=dp, tied_embeddings=tied_embeddings)
    held = {name: group_buffer_bytes(n, peers) for name, (n, peers) in groups.items()}
    return sum(held.values()), [name for name, b in held.items() if b]
