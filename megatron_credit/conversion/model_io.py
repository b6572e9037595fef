"""A converted checkpoint folder and the model it loads into (the folder's files: :mod:`.converters`).

* :func:`load_hf_config`, :func:`read_meta` - ``config.json`` and ``conversion_meta.json``, checked;
* :func:`check_out_dir` - an output folder is never the source or inside it;
* :func:`single_stage_parallel_state`, :func:`build_model` - megatron at TP = PP = 1 and the
  ``GPTModel`` of an HF config;
* :func:`load_dist_checkpoint` - ``<folder>/model`` into a model at any TP / PP, checked by
  :mod:`.safe_load` before torch reads it.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_credit.conversion.hf_io import DTYPES, CheckpointFormatError, read_json
from megatron_credit.conversion.mcore_save import _whole_gated_fc1
from megatron_credit.conversion.safe_load import (check_dist_checkpoint, checkpoint_errors_unwrapped,
                                                  weights_only_byte_items)

CONVERSION_VERSION = 1
META_NAME = "conversion_meta.json"
MODEL_SUBDIR = "model"


def load_hf_config(folder: str | os.PathLike):
    """``AutoConfig`` of a folder, with a clear error when ``config.json`` is missing or not a config."""
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(folder)!r}")
    raw = read_json(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise CheckpointFormatError(path, "is not a Hugging Face model config (a JSON object with 'model_type')")
    return AutoConfig.from_pretrained(str(folder))


def check_out_dir(source: str | os.PathLike, out: str | os.PathLike, *, flag: str = "--out") -> None:
    """Refuse an output folder equal to or inside the source folder (before anything is written)."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents:
        raise ValueError(f"{flag} {str(out)!r} is {'the source folder' if dst == src else 'inside the source folder'} "
                         f"{str(source)!r}; choose a folder outside it")


@contextlib.contextmanager
def single_stage_parallel_state(*, seed: int = 0) -> Iterator[None]:
    """megatron parallel state with TP = PP = 1 for the converters.

    Joins the existing process group when there is one (all its ranks must call, as data-parallel
    replicas), else creates a one-process gloo group; both are torn down on exit.
    """
    import torch.distributed as dist

    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.distributed import destroy, initialize

    owns_group = not dist.is_initialized()
    # gloo: the converters keep every tensor in host memory (no GPU needed, none used).
    initialize(ParallelConfig(), seed=seed, backend="gloo")
    try:
        yield
    finally:
        destroy(process_group=owns_group)


def build_model(hf_config: Any, *, params_dtype: torch.dtype, tp: int = 1, pp: int = 1,
                initialize_weights: bool = False, use_transformer_engine: bool | None = False):
    """This rank's ``GPTModel`` for ``hf_config`` (megatron parallel state must match ``tp``/``pp``).

    The converters use the local spec in host memory. The dist checkpoint's weight keys do not depend
    on the spec: the TE spec's ``sharded_state_dict`` maps its fused layer-norm names
    (``linear_qkv.layer_norm_weight``) to the local ones (``input_layernorm.weight``) and its grouped experts'
    (``TEGroupedMLP``'s ``linear_fc1.weight{e}``) to ``SequentialMLP``'s. Only TE's
    ``_extra_state`` entries (FP8 metadata, no weights) differ; :func:`load_dist_checkpoint` tolerates them.
    """
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tcfg = transformer_config_from_hf(hf_config, parallel=parallel, params_dtype=params_dtype,
                                      perform_initialization=initialize_weights)
    return build_gpt_model(hf_config, tcfg, use_transformer_engine=use_transformer_engine)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    """``conversion_meta.json`` of a converted checkpoint, checked (CheckpointFormatError naming it)."""
    path = Path(ckpt_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: is {str(ckpt_dir)!r} a converted checkpoint?")
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise CheckpointFormatError(path, f"is a JSON {type(meta).__name__}, expected an object")
    for key in ("conversion_version", "dtype"):
        if key not in meta:
            raise CheckpointFormatError(path, f"has no {key!r}")
    if meta["conversion_version"] != CONVERSION_VERSION:
        raise CheckpointFormatError(path, f"conversion_version {meta['conversion_version']!r} != {CONVERSION_VERSION} "
                                    "(written by another version of the converter)")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES:
        raise CheckpointFormatError(path, f"dtype {meta['dtype']!r} is not one of {sorted(DTYPES)}")
    return meta


def load_dist_checkpoint(model, ckpt_dir: str | os.PathLike) -> None:
    """Load ``<ckpt_dir>/model`` into ``model`` (any TP / PP: megatron reshards), strictly for weights.

    Only Transformer Engine ``_extra_state`` entries (FP8 metadata, no weights) may be absent on one
    side: a TE model asks for ``core_attention._extra_state`` that a local-spec checkpoint lacks, and
    a TE-written checkpoint holds extra states a local model does not ask for. Any other missing or
    unexpected key raises.

    At TP = 1 fc1 is requested whole (see :func:`_whole_gated_fc1`): the swiglu factory would load
    the halves into new tensors and concatenate them, a second copy of every MLP input weight.
    """
    from megatron.core import dist_checkpointing

    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    check_dist_checkpoint(model_dir)  # before torch unpickles anything (see safe_load)
    request = model.sharded_state_dict()
    if model.config.tensor_model_parallel_size == 1:
        request = _whole_gated_fc1(request)
    # missing: in the checkpoint, not requested; unexpected: requested, not in the checkpoint.
    with weights_only_byte_items(str(model_dir)), checkpoint_errors_unwrapped():
        state, missing, unexpected = dist_checkpointing.load(request, str(model_dir), strict="return_all")
    _check_only_extra_state(missing, unexpected, f"dist checkpoint {str(model_dir)!r}")
    result = model.load_state_dict(state, strict=False)
    _check_only_extra_state(result.unexpected_keys, result.missing_keys, "model.load_state_dict")
    del state, request


def _check_only_extra_state(missing, unexpected, where: str) -> None:
    """Raise unless every key in ``missing`` (not requested) and ``unexpected`` (not stored) is a TE
    ``_extra_state``."""
    bad_missing = sorted(k for k in missing if not k.endswith("_extra_state"))
    bad_unexpected = sorted(k for k in unexpected if not k.endswith("_extra_state"))
    if bad_missing or bad_unexpected:
        raise ValueError(f"{where}: keys stored but not in the model: {bad_missing[:5]}; keys of the model "
                         f"not stored: {bad_unexpected[:5]} (only TE _extra_state may differ)")
