"""Checks the keys of an inline ``model.architecture`` against the family's Hugging Face config fields.

``transformers`` config classes accept any keyword and store unknown ones as attributes, so a typo
(``hidden_sizee: 32``) used to build the default-sized model without a word. Valid keys are those the
family's config class takes or writes (its ``__init__`` parameters, ``to_dict()`` keys and public
attributes, ``attribute_map`` aliases) plus the transformers 4.x spellings this project still reads
(:data:`LEGACY_KEYS`). The error names every unknown key with the closest valid name.

>>> check_architecture_keys({"model_type": "qwen2", "hidden_size": 32, "rope_theta": 1e6})
>>> check_architecture_keys({"model_type": "qwen2", "hidden_sizee": 32})
Traceback (most recent call last):
...
ValueError: model.architecture: unknown key for model_type 'qwen2': 'hidden_sizee' (did you mean 'hidden_size'?)
"""
from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Mapping

from megatron_credit.models.hf_config import SUPPORTED_MODEL_TYPES

LEGACY_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "head_dim"})
"""transformers 4.x config fields (5.x folds them into ``rope_parameters`` / ``dtype``) that
``hf_config.py`` still reads; ``head_dim`` is read for every family (``models.head_dim``)."""


@functools.lru_cache(maxsize=None)
def valid_architecture_keys(model_type: str) -> frozenset[str]:
    """The config fields of ``model_type``'s ``transformers`` config class (see the module docstring)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    instance = cls()
    keys = set(inspect.signature(cls.__init__).parameters) | set(instance.to_dict()) | set(vars(instance))
    keys |= set(getattr(cls, "attribute_map", {}) or {})
    return frozenset(k for k in keys if not k.startswith("_") and k not in ("self", "kwargs")) | LEGACY_KEYS


def check_architecture_keys(architecture: Mapping[str, Any], *, where: str = "model.architecture") -> None:
    """Raise ``ValueError`` naming each unknown key of ``architecture`` (with the closest valid name),
    or an unsupported ``model_type``."""
    model_type = architecture.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}.model_type {model_type!r} is not supported; valid: {list(SUPPORTED_MODEL_TYPES)}")
    valid = valid_architecture_keys(model_type)
    unknown = sorted(k for k in architecture if k not in valid)
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(valid), n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    noun = "key" if len(unknown) == 1 else "keys"
    raise ValueError(f"{where}: unknown {noun} for model_type {model_type!r}: {', '.join(parts)}")
