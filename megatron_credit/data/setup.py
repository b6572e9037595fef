"""The data a run trains and validates on: the tokenizer, the training prompt stream, the validation
prompts and the synthetic task, from the recipe's ``data`` section (``trainer.loop.build`` calls
:func:`build_data` once per launch).
"""
from __future__ import annotations

from megatron_credit.data.source_base import hf_tokenizer  # noqa: F401  (re-exported: trainer/loop.py)


def build_data(d, *, seed: int, model_path: str | None, val_every: int, val_prompts: int, log=lambda *_: None):
    """(tokenizer, train prompt stream, validation prompts or None, the synthetic task or None) of the
    recipe's ``data`` section ``d``; ``seed``: the run's; ``model_path`` (``model.name_or_path``): where the
    tokenizer comes from when ``data.tokenizer_path`` is unset; ``val_every`` / ``val_prompts``
    (``train.*``): validation prompts are built when ``val_every`` is set.

    The stream and the validation prompts are the job's, the same on every rank: each iteration takes
    ``rollout.prompts_per_step`` prompts, which the engines split (``rollout.placement``), so what is
    sampled does not depend on the number of ranks or engines, and the cursor resumes on any layout.

    ``data.source`` names the source in ``data.sources.PROMPT_SOURCES`` that builds them (a plug-in's
    counts); the result is a ``data.sources.PromptData``."""
    from megatron_credit.data.sources import source_of

    return source_of(d).build(seed=seed, model_path=model_path, val_every=val_every, val_prompts=val_prompts, log=log)
