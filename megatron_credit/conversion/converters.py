"""HF folder <-> megatron-core distributed checkpoint (torch_dist), streaming one tensor at a time.

The files of a converted checkpoint folder::

    <out>/model/                 dist_checkpointing.save of GPTModel.sharded_state_dict() (torch_dist)
    <out>/config.json            the source HF config, byte for byte
    <out>/conversion_meta.json   source architecture, family, stored dtype, source dtype, conversion
                                 version, planned TP/PP
    <out>/tokenizer*.json ...    the tokenizer files of the source

Written from a TP = PP = 1 model: torch_dist stores each tensor with its global shape and megatron
reshards on load, so the folder loads at any TP / PP (``--tp`` / ``--pp`` only validate that the planned
sizes divide the model). Peak memory: one model in the target dtype plus one HF tensor (+ one shard); a model
whose decoder layers exceed ``max_part_bytes`` is written in parts of layers (:mod:`.parts`), and the peak is
one part (plus the embedding and the output layer).

The folder's files are read and the model is built by :mod:`.model_io`; megatron's save runs through
:mod:`.mcore_save`.

Files are never lost and code never runs from a checkpoint:
* ``--out`` equal to or inside the source is refused before anything is written;
* HF -> megatron refuses a non-empty ``--out`` unless ``overwrite`` (then it replaces only the entries it
  writes: ``model/``, ``config.json``, ``conversion_meta.json``, tokenizer files), and builds everything
  in a hidden folder inside ``--out`` that is moved into place at the end (a failure removes it);
* megatron -> HF refuses a folder holding HF files no earlier export wrote unless ``overwrite``
  (``export_target``), removes only an earlier export's weight files, writes through temporary names;
* a dist checkpoint is checked by :mod:`.safe_load` before torch reads it (restricted unpickling of
  ``.metadata``, weights-only byte items, files present and long enough); ``conversion_meta.json`` must
  name a dtype the stored tensors really have.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_credit.conversion.base import ModelDims
from megatron_credit.families import family_for_config
from megatron_credit.conversion.hf_io import (DTYPES, CheckpointFormatError, SafetensorsReader,
                                              ShardedSafetensorsWriter, copy_file_atomic, copy_tokenizer_files,
                                              resolve_dtype, write_text_atomic)
from megatron_credit.conversion.live import load_hf_into_local_state
from megatron_credit.conversion.mcore_save import _save_strategy, _whole_gated_fc1
from megatron_credit.conversion.model_io import (CONVERSION_VERSION, META_NAME, MODEL_SUBDIR, build_model,
                                                 check_out_dir, load_dist_checkpoint, load_hf_config, read_meta,
                                                 single_stage_parallel_state)
from megatron_credit.conversion.safe_load import check_dist_checkpoint, stored_weight_dtypes
from megatron_credit.conversion.streaming import check_hf_keys, expand_rules, iter_hf_from_megatron

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, mininterval=1.0)


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                           ep: int = 1, dtype: str | None = None, allow_lossy_dtype: bool = False, overwrite: bool = False,
                           progress: bool = True, max_part_bytes: float = 16 * 2**30) -> dict:
    """Convert an HF safetensors folder to a megatron dist checkpoint; returns the metadata written.

    ``out_dir`` must be new or empty unless ``overwrite`` (see the module docstring); ``max_part_bytes``: the
    most bytes of decoder layers held at a time (:mod:`.parts`)."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    cfg = load_hf_config(hf_dir)
    family = family_for_config(cfg)
    check_out_dir(hf_dir, out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} exists and is not a folder")
    if out.is_dir() and not overwrite:
        present = sorted(p.name for p in out.iterdir())
        if present:
            raise FileExistsError(f"--out {str(out)!r} is not empty (holds {present[:5]}); choose a new folder or "
                                  "pass --overwrite to replace the checkpoint files in it")
    ModelDims.from_hf_config(cfg).check_parallel(tp=tp, pp=pp, ep=ep)
    reader = SafetensorsReader(hf_dir)
    check_hf_keys(reader.keys(), family, cfg)
    source = reader.dtypes(consumed_names(family, cfg))
    target = resolve_dtype(source, dtype, allow_lossy=allow_lossy_dtype)  # refuses targets outside DTYPES
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".tmp-convert-{os.getpid()}"
    try:
        meta = _write_megatron_checkpoint(reader, cfg, family, staging, hf_dir=hf_dir, target=target,
                                          source=source, tp=tp, pp=pp, progress=progress,
                                          max_part_bytes=max_part_bytes)
        (out / META_NAME).unlink(missing_ok=True)  # a half-replaced folder never passes for a checkpoint
        for entry in sorted(staging.iterdir(), key=lambda p: p.name == META_NAME):  # the metadata last
            dest = out / entry.name
            if dest.is_symlink():
                dest.unlink()  # the link, never what it points to (os.replace cannot replace it by a folder)
            elif dest.is_dir():
                shutil.rmtree(dest)  # only with overwrite: the folder was empty otherwise
            os.replace(entry, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
    return meta


def _write_megatron_checkpoint(reader: SafetensorsReader, cfg, family, out: Path, *, hf_dir: Path,
                               target: torch.dtype, source: set[torch.dtype], tp: int, pp: int,
                               progress: bool, max_part_bytes: float) -> dict:
    """The checkpoint files of :func:`convert_hf_to_megatron`, written into the new folder ``out``."""
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion.parts import layer_bytes, layers_per_part, write_in_parts

    def save(sharded_state_dict: dict, folder: Path) -> None:
        dist_checkpointing.save(_whole_gated_fc1(sharded_state_dict), str(folder), sharded_strategy=_save_strategy())

    layers = cfg.num_hidden_layers
    per_part = layers_per_part(layers, layer_bytes(reader, family, cfg, target), max_part_bytes)
    parts = 1
    with single_stage_parallel_state():
        bar = _progress(sum(len(h) for _, h, _ in expand_rules(family, cfg)), "hf -> megatron", progress)

        def get_hf(name: str) -> torch.Tensor:
            bar.update(1)
            return reader.get(name)

        if per_part >= layers:
            (out / MODEL_SUBDIR).mkdir(parents=True)
            model = build_model(cfg, params_dtype=target)
            load_hf_into_local_state(model.state_dict(keep_vars=True), get_hf, family, cfg, tp_rank=0, tp_size=1,
                                     layer_offset=0)
            save(model.sharded_state_dict(), out / MODEL_SUBDIR)
            del model
        else:
            parts = write_in_parts(out / MODEL_SUBDIR, cfg, family, get_hf=get_hf, params_dtype=target,
                                   per_part=per_part, save=save)
        bar.close()
    copy_file_atomic(hf_dir / "config.json", out / "config.json")
    tokenizer = copy_tokenizer_files(hf_dir, out)
    meta = {"conversion_version": CONVERSION_VERSION, "source_architecture": list(cfg.architectures or []),
            "family": family.name, "dtype": _DTYPE_NAMES[target], "source_dtype": _source_dtype_name(source),
            "format": "torch_dist",
            "planned_tp": tp, "planned_pp": pp, "tokenizer_files": tokenizer,
            "import_parts": parts, "layers_per_part": min(per_part, layers),
            "source_bytes": reader.total_bytes()}
    write_text_atomic(out / META_NAME, json.dumps(meta, indent=2) + "\n")
    return meta


def consumed_names(family, cfg) -> list[str]:
    """The HF tensor names the rules read (not ``rotary_emb.inv_freq`` or a tied model's ``lm_head``)."""
    return [h for _, hs, _ in expand_rules(family, cfg) for h in hs]


def _source_dtype_name(source: set[torch.dtype]) -> str:
    """"bf16" etc. for one source dtype (torch's name, e.g. "float64", outside ``DTYPES``), else
    "mixed(...)" of the sorted names (metadata only)."""
    names = sorted(_DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in source)
    return names[0] if len(names) == 1 else f"mixed({','.join(names)})"


def convert_megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                           allow_lossy_dtype: bool = False, max_shard_bytes: int = 5 * 1024**3,
                           progress: bool = True, overwrite: bool = False) -> list[str]:
    """Write HF shards, index, ``config.json``, tokenizer files (see ``export_target``); the shard names."""
    import torch.distributed as dist

    from megatron_credit.conversion.export_target import check_export_target, write_export_manifest

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    meta = read_meta(ckpt)
    check_out_dir(ckpt, out)
    check_export_target(out, overwrite=overwrite)  # also: --out must be a folder
    cfg = load_hf_config(ckpt)
    family = family_for_config(cfg)
    stored = DTYPES[meta["dtype"]]
    really = stored_weight_dtypes(check_dist_checkpoint(ckpt / MODEL_SUBDIR))
    if really != {stored}:  # a hand-edited dtype would cast the weights silently, past --allow-lossy-dtype
        raise CheckpointFormatError(ckpt / META_NAME, f"says dtype {meta['dtype']!r} ({stored}) but {MODEL_SUBDIR}/ "
                                    f"stores {sorted(map(str, really))} weights")
    target = resolve_dtype({stored}, dtype, allow_lossy=allow_lossy_dtype)
    out.mkdir(parents=True, exist_ok=True)  # earlier exports' weight files are removed by the writer
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=stored)
        load_dist_checkpoint(model, ckpt)
        state = model.state_dict()
        files: list[str] = []
        if not dist.is_initialized() or dist.get_rank() == 0:
            writer = ShardedSafetensorsWriter(out, max_shard_bytes=max_shard_bytes)
            rules = expand_rules(family, cfg)
            bar = _progress(sum(len(h) for _, h, _ in rules), "megatron -> hf", progress)
            try:
                for name, t in iter_hf_from_megatron(state.__getitem__, family, cfg):
                    writer.add(name, t.to(target))
                    bar.update(1)
            except BaseException:
                writer.abort()  # no temporary shard is left behind; earlier exports stay untouched
                raise
            bar.close()
            files = writer.close()
            _write_config(ckpt / "config.json", out / "config.json", target,
                          source_dtype=DTYPES.get(meta.get("source_dtype", meta["dtype"])))
            tokenizer = copy_tokenizer_files(ckpt, out)
            write_export_manifest(out, files, ["config.json", *tokenizer])
        del model, state
    return files


def _write_config(src: Path, dst: Path, target: torch.dtype, *, source_dtype: torch.dtype | None = None) -> None:
    """Copy config.json byte for byte when its dtype field already names ``target``, else rewrite it
    with that field set to ``target`` (the dtype of the weights written): transformers loads a model
    in the config's dtype by default, so a stale field would silently cast the exported weights.

    transformers 5 writes ``dtype``, 4.x ``torch_dtype``: whichever fields the source has are set.
    A config with neither is copied when the weights keep ``source_dtype``, else gets ``dtype``.
    """
    cfg = json.loads(src.read_text())
    name = str(target).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg]
    if not keys and target == source_dtype:
        copy_file_atomic(src, dst)
        return
    keys = keys or ["dtype"]
    if all(cfg.get(k) == name for k in keys):
        copy_file_atomic(src, dst)
        return
    for key in keys:
        cfg[key] = name
    write_text_atomic(dst, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
