"""A training run's checkpoint -> a Hugging Face folder (``tools/export_run_to_hf.py``, ``tools/evaluate.py``).

The trainer writes ``<run>/checkpoints/iter_N/model_optim`` (a ``torch_dist`` checkpoint of the model
*and* its AdamW moments, see ``megatron_credit.trainer.checkpoint``) and ``<run>/config.yaml`` (the
resolved recipe). This builds the recipe's model at TP = PP = 1 in host memory, loads only the model's
tensors (megatron reshards any training layout; the optimizer moments and a critic head are left on
disk), and writes HF safetensors with the same streaming writer as ``convert_megatron_to_hf``, plus
``config.json`` and, when ``model.name_or_path`` is a folder, its tokenizer files.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

_MODEL_OPTIM = "model_optim"


def newest_checkpoint(run_dir: str | os.PathLike) -> str:
    """The newest complete ``iter_N`` checkpoint of a run directory (FileNotFoundError when none)."""
    from megatron_credit.run_layout import complete_checkpoints

    done = complete_checkpoints(str(run_dir))
    if not done:
        raise FileNotFoundError(f"no complete checkpoint under {os.path.join(str(run_dir), 'checkpoints')!r}")
    return done[-1][1]


def export_run_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *,
                          run_dir: Optional[str | os.PathLike] = None,
                          max_shard_bytes: int = 5 * 1024 ** 3, overwrite: bool = False) -> list[str]:
    """Write checkpoint ``<run>/checkpoints/iter_N`` as an HF folder ``out_dir``; returns the shard names.

    ``run_dir`` (default: two levels above ``checkpoint``) holds the ``config.yaml`` naming the model.
    Files of ``out_dir`` that no earlier export wrote are never replaced unless ``overwrite``."""
    from megatron.core import dist_checkpointing

    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.families import family_for_config
    from megatron_credit.conversion.hf_io import ShardedSafetensorsWriter, copy_tokenizer_files
    from megatron_credit.conversion.mcore_save import _whole_gated_fc1
    from megatron_credit.conversion.model_io import (_check_only_extra_state, build_model, check_out_dir,
                                                     single_stage_parallel_state)
    from megatron_credit.conversion.safe_load import (check_dist_checkpoint, checkpoint_errors_unwrapped,
                                                      stored_weight_dtypes, weights_only_byte_items)
    from megatron_credit.conversion.streaming import iter_hf_from_megatron

    ckpt = Path(checkpoint)
    run = Path(run_dir) if run_dir is not None else ckpt.parent.parent
    if not (ckpt / "meta.json").is_file():
        raise FileNotFoundError(f"{str(ckpt)!r} is not a complete run checkpoint (no meta.json)")
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in the run directory {str(run)!r}")
    out = Path(out_dir)
    check_out_dir(ckpt, out)
    from megatron_credit.conversion.export_target import check_export_target, write_export_manifest

    check_export_target(out, overwrite=overwrite)
    recipe = load_recipe(str(run / "config.yaml"))
    cfg = recipe.model.hf_config()
    family = family_for_config(cfg)
    model_dir = ckpt / _MODEL_OPTIM
    metadata = check_dist_checkpoint(model_dir)  # before torch unpickles anything
    dtype = _model_dtype(metadata, model_dir)
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=dtype)
        request = _whole_gated_fc1(model.sharded_state_dict())
        # Only the model's own tensors decide: the optimizer's fp32 moments and master weights, and a
        # value head, are stored next to a bf16 model's weights.
        dtypes = stored_weight_dtypes(metadata, keys=_requested_keys(request))
        if dtypes != {dtype}:
            raise ValueError(f"{str(model_dir)!r} stores tensors of several dtypes {sorted(map(str, dtypes))}")
        out.mkdir(parents=True, exist_ok=True)
        with weights_only_byte_items(str(model_dir)), checkpoint_errors_unwrapped():
            state, _, unexpected = dist_checkpointing.load(request, str(model_dir), strict="return_all")
        # Keys stored but not requested (optimizer moments, a value head) are expected; a requested
        # weight that is not stored is not.
        _check_only_extra_state((), unexpected, f"run checkpoint {str(model_dir)!r}")
        model.load_state_dict(state, strict=False)
        weights = model.state_dict()
        writer = ShardedSafetensorsWriter(out, max_shard_bytes=max_shard_bytes)
        try:
            for name, t in iter_hf_from_megatron(weights.__getitem__, family, cfg):
                writer.add(name, t.to(dtype))
        except BaseException:
            writer.abort()
            raise
        files = writer.close()
        del model, weights, state
    for field in ("dtype", "torch_dtype"):  # transformers 5.x / 4.x name of the weights' dtype
        if field in cfg.to_dict():
            setattr(cfg, field, str(dtype).removeprefix("torch."))
    if not getattr(cfg, "architectures", None):  # an inline model.architecture: convert_megatron_to_hf needs it
        cfg.architectures = [family.architectures[0]]  # the family's transformers class
    cfg.to_json_file(str(out / "config.json"))
    source = recipe.model.name_or_path
    tokenizer = copy_tokenizer_files(Path(source), out) if source and os.path.isdir(source) else []
    write_export_manifest(out, files, ["config.json", *tokenizer])
    return files


_EMBEDDING = "embedding.word_embeddings.weight"


def _model_dtype(metadata, model_dir: Path):
    """The dtype the run stored its model in: that of the word embedding (every GPT checkpoint has it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_credit.conversion.hf_io import CheckpointFormatError

    entry = metadata.state_dict_metadata.get(_EMBEDDING)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointFormatError(model_dir, f"stores no {_EMBEDDING!r} tensor: not a GPT model checkpoint")
    return entry.properties.dtype


def _requested_keys(request) -> set[str]:
    """The checkpoint keys of a (nested) sharded state dict request."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {v.key for v in nested_values(request) if isinstance(v, ShardedBase)}
