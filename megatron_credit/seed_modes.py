"""The names of ``rollout.seed_mode``: a word shared by the recipe, which checks it, and the engines, which
seed by it (``rollout/sampling.py``); standard library only."""

SEED_MODES = ("per_sample", "per_call")
"""How an engine seeds its sampling (``rollout.seed_mode``; ``docs/vllm_engine.md``, "Seeds"): ``per_sample``, each
sample its own generator seeded by ``rollout.sampling.row_seed`` (the same samples whatever the batch and the engine
count); ``per_call``, one generator per ``generate`` call seeded by ``rollout.sampling.call_seed`` (vLLM's batched
sampler; the samples then depend on the call's batch)."""
