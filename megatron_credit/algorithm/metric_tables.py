"""The metric tables' old home, kept for one release: ``megatron_credit.metrics.tables`` holds them now.
Importing a name from here gives the same object with a one-line DeprecationWarning (a plugin algorithm
written against the old path keeps working)."""
from __future__ import annotations


def __getattr__(name: str):
    import warnings

    from megatron_credit.metrics import tables

    if name.startswith("__") or not hasattr(tables, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"megatron_credit.algorithm.metric_tables.{name} is now megatron_credit.metrics.tables.{name}; "
                  "the old path goes in the next release", DeprecationWarning, stacklevel=2)
    return getattr(tables, name)
