"""The rollout-engine protocol and the registry of engines by name.

An engine turns token-id prompts into a :class:`RolloutBatch`, receives new weights from the actor as
HF-named tensors in size-bounded buckets (what ``megatron_credit.conversion`` streams out of the live
megatron model), and can release its accelerator memory while the actor trains (``sleep``/``wake_up``).

Engines register themselves under a name in :data:`ROLLOUT_ENGINES` ("hf", "vllm"); the trainer
resolves the name once at start-up with :func:`build_rollout_engine`.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from megatron_credit.registry import Registry
from megatron_credit.rollout.types import RolloutBatch, SamplingParams

WeightBuckets = Iterable[list[tuple[str, torch.Tensor]]]
"""Buckets of (HF parameter name, tensor) pairs, e.g. ``[[("model.embed_tokens.weight", t), ...], ...]``."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, group_ids: Sequence[int] | None = None
    ) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt.

        prompts: token ids, one list per prompt (no padding). group_ids: one id per prompt (default
        0..len-1); sample j of prompt i gets ``group_ids[i]`` and ``sample_index = j``. The batch is
        ordered prompt-major.
        """
        ...

    def update_weights(self, buckets: WeightBuckets) -> None:
        """Overwrite the engine's weights in memory with HF-named tensors (no disk round trip). The engine
        copies them: once it returns, the caller may reuse their memory (a pool rank's ring of host chunks,
        ``sources/staging.py``, receives the next version into it)."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) until ``wake_up``."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` among ("weights", "kv_cache"), both by default. The
        trainer wakes the weights, syncs them (``update_weights`` refuses sleeping weights), then wakes the
        KV cache: the cache is allocated after the sync's buffers are gone."""
        ...

    def close(self) -> None:
        """Free every resource; the engine is unusable afterwards."""
        ...


ROLLOUT_ENGINES: Registry[Any] = Registry("rollout engine")
"""Engine name -> constructor (a class or factory taking keyword arguments)."""


def build_trainer_engine(rollout, model, *, seed: int, hf_config, device, gpus: tuple[int, ...]) -> RolloutEngine:
    """The engine the recipe's ``rollout`` section names (``rollout.engine``, with its
    ``rollout.engine_options``), built by the engine's ``from_config`` for the recipe's ``model`` section
    (the actor's dtype, path, context / RoPE overrides) and ``hf_config``; ``seed``: the run's;
    ``device``: this rank's (``distributed.initialize``'s), where an in-process engine runs; ``gpus``: the
    local device indices the engine owns, ``device``'s first (``rollout.placement.EnginePlacement.gpus``)."""
    import megatron_credit.rollout  # noqa: F401  (registers the built-in engines)

    return ROLLOUT_ENGINES.get(rollout.engine).from_config(rollout, model, seed=seed, hf_config=hf_config,
                                                           device=device, gpus=tuple(gpus))


def build_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Construct the engine registered under ``name`` (the engine modules are imported on first use)."""
    import megatron_credit.rollout  # noqa: F401  (registers the built-in engines)

    return ROLLOUT_ENGINES.get(name)(**kwargs)


def resolve_group_ids(num_prompts: int, group_ids: Sequence[int] | None) -> list[int]:
    """Default group ids are 0..num_prompts-1; a given sequence must have one id per prompt."""
    if group_ids is None:
        return list(range(num_prompts))
    if len(group_ids) != num_prompts:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {num_prompts} prompts")
    return [int(g) for g in group_ids]


def empty_cache(device: torch.device | str) -> None:
    """Give the caching allocator's free blocks of ``device``'s kind back to the device (CUDA, or an
    accelerator module with ``empty_cache``), so that an engine waking next finds the memory the trainer
    freed; nothing on the CPU. Engines call it after they sleep, the trainer after it offloads."""
    device = torch.device(device)
    if device.type == "cpu" or (device.type == "cuda" and not torch.cuda.is_available()):
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "empty_cache"):
        module.empty_cache()


def check_engine_name(name: str) -> None:
    """``rollout.engine`` names a registered engine: one ``ValueError`` naming the field and the valid names
    otherwise. The entry points call it once at start-up (the recipe, a leaf, imports no engine)."""
    try:
        ROLLOUT_ENGINES.get(name)
    except ValueError as exc:
        raise ValueError(f"rollout.engine: {exc}") from None
