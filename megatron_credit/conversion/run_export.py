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
    from megatron_credit.run_dir import complete_checkpoints

    done = complete_checkpoints(str(run_dir))
    if not done:
        raise FileNotFoundError(f"no complete checkpoint under {os.path.join(str(run_dir), 'checkpoints')!r}")
    return done[-1][1]


def export_run_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *,
                          run_dir: Optional[str | os.PathLike] = None,
                          max_shard_bytes: int = 5 * 1024 ** 3, overwrite: bool = False,
                          adapter: bool = False) -> list[str]:
    """Write checkpoint ``<run>/checkpoints/iter_N`` as an HF folder ``out_dir``; returns the shard names.

    ``run_dir`` (default: two levels above ``checkpoint``) holds the ``config.yaml`` naming the model.
    Files of ``out_dir`` that no earlier export wrote are never replaced unless ``overwrite``. A LoRA run
    (``lora`` in the checkpoint's ``meta.json``) is exported as its merged model, or with ``adapter`` as a
    PEFT adapter (:func:`_export_lora`)."""
    from megatron.core import dist_checkpointing

    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.families import family_for_config
    from megatron_credit.conversion.mcore_save import _whole_gated_fc1
    from megatron_credit.conversion.model_io import (_check_only_extra_state, build_model, check_out_dir,
                                                     single_stage_parallel_state)
    from megatron_credit.conversion.safe_load import (check_dist_checkpoint, checkpoint_errors_unwrapped,
                                                      stored_weight_dtypes, weights_only_byte_items)

    ckpt = Path(checkpoint)
    run = Path(run_dir) if run_dir is not None else ckpt.parent.parent
    if not (ckpt / "meta.json").is_file():
        raise FileNotFoundError(f"{str(ckpt)!r} is not a complete run checkpoint (no meta.json)")
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in the run directory {str(run)!r}")
    out = Path(out_dir)
    check_out_dir(ckpt, out)
    from megatron_credit.conversion.export_target import check_export_target

    check_export_target(out, overwrite=overwrite)
    recipe = load_recipe(str(run / "config.yaml"))
    cfg = recipe.model.hf_config()
    family = family_for_config(cfg)
    model_dir = ckpt / _MODEL_OPTIM
    lora = _read_meta(ckpt).get("lora")
    if adapter and not lora:
        raise ValueError(f"{str(ckpt)!r}: --adapter: this run trained every weight (its meta.json names no LoRA "
                         "adapters, model.lora.rank 0); export the model without --adapter")
    if lora:
        return _export_lora(ckpt, out, recipe, cfg, family, lora, adapter=adapter, max_shard_bytes=max_shard_bytes)
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
        files = _write_hf(out, model.state_dict(), family, cfg, dtype, max_shard_bytes)
        del model, state
    _write_config_and_tokenizer(out, files, cfg, family, dtype, recipe.model.name_or_path)
    return files


def _write_hf(out: Path, weights, family, cfg, dtype, max_shard_bytes: int) -> list[str]:
    """``weights`` (a megatron state-dict mapping at TP = PP = 1) as HF safetensors shards in ``out``."""
    from megatron_credit.conversion.hf_io import ShardedSafetensorsWriter
    from megatron_credit.conversion.streaming import iter_hf_from_megatron

    writer = ShardedSafetensorsWriter(out, max_shard_bytes=max_shard_bytes)
    try:
        for name, t in iter_hf_from_megatron(weights.__getitem__, family, cfg):
            writer.add(name, t.to(dtype))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _write_config_and_tokenizer(out: Path, files: list[str], cfg, family, dtype, source: Optional[str]) -> None:
    """``config.json`` (its dtype field the exported one), the tokenizer files of the run's model folder,
    and the manifest of what the export wrote."""
    from megatron_credit.conversion.export_target import write_export_manifest
    from megatron_credit.conversion.hf_io import copy_tokenizer_files

    for field in ("dtype", "torch_dtype"):  # transformers 5.x / 4.x name of the weights' dtype
        if field in cfg.to_dict():
            setattr(cfg, field, str(dtype).removeprefix("torch."))
    if not getattr(cfg, "architectures", None):  # an inline model.architecture: convert_megatron_to_hf needs it
        cfg.architectures = [family.architectures[0]]  # the family's transformers class
    cfg.to_json_file(str(out / "config.json"))
    tokenizer = copy_tokenizer_files(Path(source), out) if source and os.path.isdir(source) else []
    write_export_manifest(out, files, ["config.json", *tokenizer])


def _read_meta(ckpt: Path) -> dict:
    """A run checkpoint's ``meta.json`` (CheckpointFormatError naming it when it is not a JSON object)."""
    from megatron_credit.conversion.hf_io import CheckpointFormatError, read_json

    meta = read_json(ckpt / "meta.json")
    if not isinstance(meta, dict):
        raise CheckpointFormatError(ckpt / "meta.json", f"is a JSON {type(meta).__name__}, expected an object")
    return meta


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _export_lora(ckpt: Path, out: Path, recipe, cfg, family, lora: dict, *, adapter: bool,
                 max_shard_bytes: int) -> list[str]:
    """A LoRA run's checkpoint holds its adapters (and optimizer), not the frozen base, which ``meta.json``
    names (``lora.base``). The base is read from there, the adapters from the checkpoint (at TP = PP = 1,
    whatever the run's layout), and either the merged model ``W + B A * alpha / rank`` is written as HF
    safetensors, or (``adapter``) the adapters alone as a PEFT LoRA adapter (:func:`peft_adapter`)."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion import load_hf_into_local_state
    from megatron_credit.conversion.hf_io import SafetensorsReader
    from megatron_credit.conversion.model_io import build_model, single_stage_parallel_state
    from megatron_credit.conversion.safe_load import (check_dist_checkpoint, checkpoint_errors_unwrapped,
                                                      weights_only_byte_items)
    from megatron_credit.models import lora as L

    base = lora.get("base")
    if not base:
        raise ValueError(f"{str(ckpt)!r}: the adapters' base was a random initialisation (model.name_or_path held "
                         "no HF weights), so there is no base to merge them into or to name")
    if not os.path.isdir(base) or not any(f.endswith(".safetensors") for f in os.listdir(base)):
        raise FileNotFoundError(f"{str(ckpt)!r}: the adapters' base {base!r} (meta.json: lora.base) holds no "
                                "safetensors weights; the export needs the base the run was trained on")
    dtype = getattr(torch, lora.get("base_dtype") or "float32")
    model_dir = ckpt / _MODEL_OPTIM
    check_dist_checkpoint(model_dir)  # before torch unpickles anything
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=dtype)
        L.attach(model, rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=0.0, targets=lora["targets"],
                 seed=0, layer_offset=0, tp_size=1, tp_rank=0, tp_group=None, sequence_parallel=False)
        load_hf_into_local_state(L.base_state(model, keep_vars=True), SafetensorsReader(base).get, family, cfg,
                                 tp_rank=0, tp_size=1, layer_offset=0)
        request = {k: v for k, v in model.sharded_state_dict().items() if L.is_adapter_name(k)}
        with weights_only_byte_items(str(model_dir)), checkpoint_errors_unwrapped():
            # (megatron's order: keys stored and not requested, then requested and not stored)
            state, _, not_stored = dist_checkpointing.load(request, str(model_dir), strict="return_all")
        if not_stored:  # stored but not requested (optimizer moments, a value head) is expected; this is not
            raise ValueError(f"{str(model_dir)!r} lacks adapters of model.lora.targets {lora['targets']}: "
                             f"{sorted(not_stored)[:3]}")
        result = model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        out.mkdir(parents=True, exist_ok=True)
        if adapter:
            return _write_peft(out, *peft_adapter(model, family, cfg, lora, base=base,
                                                  dropout=recipe.model.lora.dropout))
        files = _write_hf(out, L.MergedState(model), family, cfg, dtype, max_shard_bytes)  # merged when read
        del model
    _write_config_and_tokenizer(out, files, cfg, family, dtype, recipe.model.name_or_path)
    return files


def _write_peft(out: Path, tensors: dict, config: dict) -> list[str]:
    import json

    from safetensors.torch import save_file

    from megatron_credit.conversion.export_target import write_export_manifest

    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_export_manifest(out, [ADAPTER_WEIGHTS], [ADAPTER_CONFIG])
    return [ADAPTER_WEIGHTS]


def peft_adapter(model, family, cfg, lora: dict, *, base: str, dropout: float = 0.0) -> tuple[dict, dict]:
    """``(tensors, adapter_config)`` of a PEFT LoRA adapter equal to ``model``'s adapters (TP = PP = 1).

    PEFT puts one adapter on each HF linear; megatron's fused ones map to several: ``linear_qkv`` to
    ``q_proj`` / ``k_proj`` / ``v_proj``, a gated ``linear_fc1`` to ``gate_proj`` / ``up_proj``. Their shared
    input factor ``A`` is the same for each (``x A^T`` is computed once per linear here, once per HF linear
    there), and the output factor ``B`` is split by rows exactly as the base weight is (the converters'
    own rule: ``B`` is ``[out, r]`` as the weight is ``[out, in]``). A row-parallel linear maps to one HF
    linear whose input columns are megatron's. PEFT's scale is ``lora_alpha / r``, the same as ours."""
    from megatron_credit.conversion.streaming import expand_rules, rule_to_hf
    from megatron_credit.conversion.base import ModelDims
    from megatron_credit.models import lora as L

    adapted = {f"{name}.weight": a for name, a in L.adapters(model)}
    dims = ModelDims.from_hf_config(cfg)
    tensors, modules, others = {}, [], set()
    for name, hf_names, rule in expand_rules(family, cfg):
        a = adapted.pop(name, None)
        if a is None:
            others.update(h.removesuffix(".weight") for h in hf_names if h.endswith(".weight"))
            continue
        bs = rule_to_hf(rule, a.b.detach().float(), dims, name=name)
        for hf_name, b in zip(hf_names, bs, strict=True):
            module = hf_name.removesuffix(".weight")
            modules.append(module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.a.detach().float().clone()  # one per HF linear
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    if adapted:
        raise ValueError(f"LoRA adapters with no HF weight to export onto: {sorted(adapted)[:3]}")
    alpha = float(lora["alpha"])
    return tensors, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": int(lora["rank"]), "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": float(dropout), "target_modules": _target_modules(modules, others),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def _target_modules(modules: list[str], others: set[str]):
    """PEFT's ``target_modules`` for exactly ``modules``: their last names (``q_proj``, ...) when no other
    linear of the model has one of those names, else a regular expression PEFT full-matches against each
    module's name (a routed expert's ``gate_proj``, left frozen, must not get an adapter)."""
    import re

    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if not any(o.rsplit(".", 1)[-1] in short for o in others):
        return short
    patterns = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules})
    return "^(" + "|".join(patterns) + ")$"


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
