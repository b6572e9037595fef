"""Workarounds on megatron-core's private torch_dist save machinery (checked on 0.16.1 - 0.19.2).

Every torch_dist save of ours runs through here (the converters, :mod:`.converters`, and the trainer's
checkpoints, ``megatron_credit.trainer.checkpoint``), and so do the TP = 1 loads of
:func:`.model_io.load_dist_checkpoint` and :mod:`.run_export`. Both pieces lean on megatron internals
that are no public API; they are named here so that an upgrade knows what to re-check:

* :func:`_whole_gated_fc1` relies on the structure of ``apply_swiglu_sharded_factory``'s
  ``ShardedTensorFactory`` (two chunks of one key; ``build()``'s ShardedTensors with their
  ``prepend_axis_num``, ``global_offset`` and ``axis_fragmentations``). Why: the torch_dist writer
  clones every CPU view (``FileSystemWriterAsync.prepare_write_data._clone_if_needed``) and the swiglu
  factory loads the halves into new tensors and concatenates them: either way a second copy of every
  MLP gate / up weight.
* :func:`_save_strategy` subclasses ``TorchDistSaveShardedStrategy`` and runs its ``async_save``
  request in this process. It reads the ``AsyncRequest`` fields ``async_fn`` / ``async_fn_args`` /
  ``preload_fn`` / ``finalize_fns``, the ``FileSystemWriterAsync`` writer functions
  ``write_preloaded_data_multiproc`` (0.16) and ``write_preloaded_data_multithread`` (0.17 - 0.19), the
  parameters of ``FileSystemWriterAsync.write_preloaded_data``, the ``async_strategy="mcore"`` keyword
  (0.17+) and the module global ``filesystem_async._results_queue``. Why: 0.16's writer forks a process
  per bucket that reports through a spawn ``Manager`` queue; on our CPU runs the child died without
  reporting and the parent waited forever (the details are in its docstring).
* :func:`_checked_write_fn` refuses any other request shape with "unsupported megatron-core version" (naming
  this file) rather than an opaque unpacking error.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _whole_gated_fc1(sharded_state_dict: dict) -> dict:
    """Save (or load) each TP = 1 ``linear_fc1`` as one tensor instead of megatron's gate / up halves.

    ``apply_swiglu_sharded_factory`` saves fc1 as two chunks of one key (rows [0, F) and [F, 2F) of the
    global [2F, H] tensor). Those chunks are views of the parameter, and the torch_dist writer clones
    every CPU view up front (``FileSystemWriterAsync.prepare_write_data._clone_if_needed``), holding
    all MLP gate / up weights twice until the file is written (+0.8 GiB for a 1B model). One chunk
    covering the whole key is the same global tensor, which torch_dist reshards on load into the
    halves any TP asks for (the parity tests load it at TP = 2 and PP = 2).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for k, v in sharded_state_dict.items():
        if isinstance(v, dict):
            v = _whole_gated_fc1(v)
        elif isinstance(v, ShardedTensorFactory) and ".mlp.linear_fc1." in v.key:
            half = v.build()[0]
            n = half.prepend_axis_num  # the layer axis megatron prepends ("decoder.layers.mlp...")
            assert tuple(half.global_shape[n:]) == tuple(v.data.shape), (v.key, half.global_shape)  # TP = 1
            layer_offsets = [(a, half.global_offset[a], half.axis_fragmentations[a]) for a in range(n)]
            v = ShardedTensor.from_rank_offsets(v.key, v.data, *layer_offsets, replica_id=v.replica_id,
                                                prepend_axis_num=n)
            assert v.global_shape == half.global_shape, (v.key, v.global_shape, half.global_shape)
        out[k] = v
    return out


def _save_strategy():
    """megatron's torch_dist save strategy, with the shard files written in this process.

    ``TorchDistSaveShardedStrategy.save`` runs ``AsyncRequest.execute_sync``: its ``preload_fn``
    (``FileSystemWriterAsync.preload_tensors(non_blocking=True)``) calls ``torch.cuda.synchronize()``,
    and in megatron-core 0.16 its writer forks a process per bucket (``write_preloaded_data_multiproc``)
    that reports through queues: on our CPU runs the child died without reporting (psutil was missing)
    and the parent waited forever, and forking a process that runs gloo threads is fragile anyway. The
    tensors of a converter are in host memory already, so here the preload runs only when CUDA exists
    and the writing happens in this process:

    * 0.16 (``write_preloaded_data_multiproc``): our :func:`_write_buckets_in_process` runs the same
      ``FileSystemWriterAsync.write_preloaded_data`` bucket by bucket; the files written are the same.
    * 0.17 - 0.19 (``write_preloaded_data_multithread``): megatron writes with threads, no fork, so our
      in-process writer is not needed; megatron's own function is called directly (after
      ``async_save(..., async_strategy="mcore")``, as megatron's sync ``save`` does there).

    Anything else (other function names or argument counts: private megatron internals) fails with
    "unsupported megatron-core version" rather than an opaque unpacking error.

    megatron's results queue is by default a *spawn* ``Manager`` (a server process re-importing
    ``__main__``, ~2 s and ~270 MB, impossible in a daemonic process); the writers run in this process
    here, so each save gets a thread queue instead (:func:`_thread_results_queue`).
    """
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class _InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            # On CPU, state_dict_saver's CUDA device requests (its finalize flag tensor) are served
            # by megatron_credit.distributed's CPU shims, installed by initialize() before any save.
            import inspect

            # 0.17+: async_save defaults to nvidia-resiliency-ext ("nvrx"); megatron's own sync save
            # asks for its built-in "mcore" implementation, as we do. 0.19 deprecates "mcore" (a one-time
            # "MCore's async save is deprecated" warning) in favour of "nvrx", which needs the
            # nvidia-resiliency-ext package and does not exist in 0.16.1: "mcore" stays (README: Status).
            kwargs = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(self.async_save).parameters \
                else {}
            with _thread_results_queue():
                request = self.async_save(sharded_state_dict, checkpoint_dir, **kwargs)
            write = _checked_write_fn(request)
            if write is not None:
                fn_name, writer_args, (rank, buckets, results) = write
                if request.preload_fn is not None and torch.cuda.is_available():
                    buckets = request.preload_fn()  # device tensors -> host, as execute_sync does
                if fn_name == "write_preloaded_data_multithread":
                    request.async_fn(rank, buckets, results)
                else:
                    _write_buckets_in_process(*writer_args, rank, buckets, results)
            torch.distributed.barrier()
            for fn in request.finalize_fns:
                fn()

    return _InProcessTorchDistSave("torch_dist", 1, thread_count=1)


@contextlib.contextmanager
def _thread_results_queue() -> Iterator[None]:
    """megatron's results queue as a ``queue.Queue`` while a save request is built (see :func:`_save_strategy`).

    The writer keeps the queue it was given, so the global is restored once the request exists."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    saved, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


_WRITE_FNS = ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
_WRITE_ITEM_PARAMS = ("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue",
                      "use_fsync")


def _unsupported(detail: str) -> RuntimeError:
    from megatron.core import package_info

    return RuntimeError(f"unsupported megatron-core version {package_info.__version__} for the in-process "
                        f"checkpoint writer (megatron_credit/conversion/mcore_save.py; checked on 0.16.1 - "
                        f"0.19.2): {detail}")


def _checked_write_fn(request) -> tuple[str, tuple, tuple] | None:
    """``(function name, (transform_list, use_msc), (rank, write_buckets, results_queue))`` of megatron's
    async save request, or None when this rank writes nothing; raises on an unknown request shape."""
    import functools
    import inspect

    for attr in ("async_fn", "async_fn_args", "preload_fn", "finalize_fns"):
        if not hasattr(request, attr):
            raise _unsupported(f"the async save request {type(request).__name__} has no {attr!r}")
    fn = request.async_fn
    if fn is None:
        return None
    if not isinstance(fn, functools.partial):
        raise _unsupported(f"async_fn is a {type(fn).__name__}, expected functools.partial")
    name = getattr(fn.func, "__name__", repr(fn.func))
    if name not in _WRITE_FNS:
        raise _unsupported(f"async_fn wraps {name!r}, expected one of {_WRITE_FNS}")
    if len(fn.args) != 2 or fn.keywords:
        raise _unsupported(f"{name} is bound to {len(fn.args)} positional / {sorted(fn.keywords)} keyword "
                           "arguments, expected (transform_list, use_msc)")
    args = tuple(request.async_fn_args)
    if len(args) != 3:
        raise _unsupported(f"async_fn_args has {len(args)} entries, expected (rank, write_buckets, results_queue)")
    if name == "write_preloaded_data_multiproc":
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        params = tuple(inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters)
        if params[:len(_WRITE_ITEM_PARAMS)] != _WRITE_ITEM_PARAMS:
            raise _unsupported(f"FileSystemWriterAsync.write_preloaded_data takes {params}, expected "
                               f"{_WRITE_ITEM_PARAMS} first")
    return name, tuple(fn.args), args


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``write_preloaded_data_multiproc`` without the worker processes (same results protocol)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
        idx, out = local.get()
        if isinstance(out, Exception):
            global_results_queue.put(out)
            return
        results[idx] = out
    global_results_queue.put(results)
