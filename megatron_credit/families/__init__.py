"""Model families, one file each: config facts, megatron spec choices and the HF <-> megatron weight map.

* :mod:`.base` - :class:`Family`, :class:`Rule`, the registry keyed by HF ``model_type``, the lookups
* :mod:`.dense_rules` - the weight rules the Llama-shaped families share
* one file per family: :mod:`.qwen2`, :mod:`.qwen3`, :mod:`.llama`, :mod:`.mistral`, :mod:`.qwen3_moe`
  (Gemma is refused:
  ``docs/conversion.md``)

Importing this package needs the standard library only.
"""
from megatron_credit.families.base import (FAMILIES, REFUSED_MODEL_TYPES, Family, Kind, Rule, TPSplit,
                                           family_for_config, family_of, register_family, supported_architectures,
                                           supported_model_types)
from megatron_credit.families import base  # noqa: E402 - its __getattr__ serves the old name TPLayout
from megatron_credit.families import qwen2, qwen3, llama, mistral, qwen3_moe  # noqa: F401,E402 - register, in this order

__all__ = ["FAMILIES", "REFUSED_MODEL_TYPES", "Family", "Kind", "Rule", "TPSplit", "family_for_config",
           "family_of", "register_family", "supported_architectures", "supported_model_types"]


def __getattr__(name: str):
    """``TPLayout`` (now ``TPSplit``) for one release, with the warning of :mod:`.base`."""
    if name == "TPLayout":
        return base.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
