"""megatron-core version differences (supported: ``>=0.16.1,<0.20``), in one place.

- 0.18+: ``import megatron.core`` imports triton (``__init__`` -> ``distributed/finalize_model_grads``
  -> ``pipeline_parallel/schedules.py:27`` -> ``transformer/moe/paged_stash.py``), which megatron-core
  does not declare and CPU torch wheels do not bring: setup.py declares it for Python >= 3.12 (the
  only Pythons 0.17+ install on), and :func:`import_megatron_core` names the cause when it is missing.
- 0.18+: ``utils.get_batch_on_this_cp_rank`` takes a required ``is_hybrid_cp`` before ``cp_group``:
  call :func:`get_batch_on_this_cp_rank` here instead.
"""
from __future__ import annotations

import inspect


def import_megatron_core():
    """``import megatron.core``, naming the cause when it fails for want of triton (0.18+).

    megatron-core 0.18.0+ imports triton at module scope on the unconditional import path
    (``pipeline_parallel/schedules.py:27`` -> ``transformer/moe/paged_stash.py``; NVIDIA/Megatron-LM
    PR #6891 proposes a guard) without declaring it; CUDA torch wheels bring triton, CPU ones do not.
    """
    try:
        import megatron.core
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ImportError(
            "megatron-core >= 0.18 imports triton (pipeline_parallel/schedules.py -> "
            "transformer/moe/paged_stash.py) but does not declare it, and CPU torch wheels do not "
            "bring it: `pip install triton` (it imports without a GPU)") from e
    return megatron.core


def get_batch_on_this_cp_rank(batch: dict, *, cp_group=None) -> dict:
    """megatron's ``utils.get_batch_on_this_cp_rank`` (load-balanced CP split) on every version.

    megatron-core 0.18.0 inserted a required positional ``is_hybrid_cp`` before ``cp_group``
    (``utils.py``: ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None,
    hybrid_cp_group_func=None)``); 0.16 / 0.17 take ``(batch, cp_group=None)``. Plain (not hybrid)
    CP is what we run, so ``is_hybrid_cp=False`` where the parameter exists.
    """
    from megatron.core import utils as mutils

    fn = mutils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(fn).parameters:  # megatron-core >= 0.18
        return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
    return fn(batch, cp_group=cp_group)  # megatron-core 0.16 / 0.17
