"""HF folder <-> megatron-core distributed checkpoint (torch_dist), streaming one tensor at a time.

Layout of a converted checkpoint folder::

    <out>/model/                 dist_checkpointing.save of GPTModel.sharded_state_dict() (torch_dist)
    <out>/config.json            the source HF config, byte for byte
    <out>/conversion_meta.json   source architecture, family, stored dtype, source dtype, conversion
                                 version, planned TP/PP
    <out>/tokenizer*.json ...    the tokenizer files of the source

Written from a TP = PP = 1 model: torch_dist stores each tensor with its global shape and megatron
reshards on load, so the folder loads at any TP / PP (``--tp`` / ``--pp`` only validate that the planned
sizes divide the model). Peak memory: one model in the target dtype plus one HF tensor (+ one shard).

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

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_credit.conversion.base import ModelDims, family_for_config
from megatron_credit.conversion.hf_io import (DTYPES, CheckpointFormatError, SafetensorsReader,
                                              ShardedSafetensorsWriter, copy_file_atomic, copy_tokenizer_files,
                                              resolve_dtype, write_text_atomic)
from megatron_credit.conversion.live import load_hf_into_local_state
from megatron_credit.conversion.safe_load import (check_dist_checkpoint, checkpoint_errors_unwrapped,
                                                  stored_weight_dtypes, weights_only_byte_items)
from megatron_credit.conversion.streaming import check_hf_keys, expand_rules, iter_hf_from_megatron

CONVERSION_VERSION = 1
META_NAME = "conversion_meta.json"
MODEL_SUBDIR = "model"
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def load_hf_config(folder: str | os.PathLike):
    """``AutoConfig`` of a folder, with a clear error when ``config.json`` is missing or not a config."""
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(folder)!r}")
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(path, f"is not valid JSON ({exc})") from None
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

    from megatron_credit.config import ParallelConfig
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
    (``linear_qkv.layer_norm_weight``) to the local ones (``input_layernorm.weight``). Only TE's
    ``_extra_state`` entries (FP8 metadata, no weights) differ; :func:`load_dist_checkpoint` tolerates them.
    """
    from megatron_credit.config import ParallelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tcfg = transformer_config_from_hf(hf_config, parallel=parallel, params_dtype=params_dtype,
                                      perform_initialization=initialize_weights)
    return build_gpt_model(hf_config, tcfg, use_transformer_engine=use_transformer_engine)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, mininterval=1.0)


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                           dtype: str | None = None, allow_lossy_dtype: bool = False, overwrite: bool = False,
                           progress: bool = True) -> dict:
    """Convert an HF safetensors folder to a megatron dist checkpoint; returns the metadata written.

    ``out_dir`` must be new or empty unless ``overwrite`` (see the module docstring)."""
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
    ModelDims.from_hf_config(cfg).check_parallel(tp=tp, pp=pp)
    reader = SafetensorsReader(hf_dir)
    check_hf_keys(reader.keys(), family, cfg)
    source = reader.dtypes(consumed_names(family, cfg))
    target = resolve_dtype(source, dtype, allow_lossy=allow_lossy_dtype)  # refuses targets outside DTYPES
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".tmp-convert-{os.getpid()}"
    try:
        meta = _write_megatron_checkpoint(reader, cfg, family, staging, hf_dir=hf_dir, target=target,
                                          source=source, tp=tp, pp=pp, progress=progress)
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
                               progress: bool) -> dict:
    """The checkpoint files of :func:`convert_hf_to_megatron`, written into the new folder ``out``."""
    from megatron.core import dist_checkpointing

    (out / MODEL_SUBDIR).mkdir(parents=True)
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=target)
        state = model.state_dict(keep_vars=True)
        bar = _progress(sum(len(h) for _, h, _ in expand_rules(family, cfg)), "hf -> megatron", progress)

        def get_hf(name: str) -> torch.Tensor:
            bar.update(1)
            return reader.get(name)

        load_hf_into_local_state(state, get_hf, family, cfg, tp_rank=0, tp_size=1, layer_offset=0)
        bar.close()
        dist_checkpointing.save(_whole_gated_fc1(model.sharded_state_dict()), str(out / MODEL_SUBDIR),
                                sharded_strategy=_save_strategy())
        del model, state
    copy_file_atomic(hf_dir / "config.json", out / "config.json")
    tokenizer = copy_tokenizer_files(hf_dir, out)
    meta = {"conversion_version": CONVERSION_VERSION, "source_architecture": list(cfg.architectures or []),
            "family": family.name, "dtype": _DTYPE_NAMES[target], "source_dtype": _source_dtype_name(source),
            "format": "torch_dist",
            "planned_tp": tp, "planned_pp": pp, "tokenizer_files": tokenizer,
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


def _whole_gated_fc1(sharded_state_dict: dict) -> dict:
    """Save (or load) each TP = 1 ``linear_fc1`` as one tensor instead of megatron's gate / up halves.

    ``apply_swiglu_sharded_factory`` saves fc1 as two chunks of one key (rows [0, F) and [F, 2F) of the
    global [2F, H] tensor). Those chunks are views of the parameter, and the torch_dist writer clones
    every CPU view up front (``FileSystemWriterAsync.prepare_write_data._clone_if_needed``), holding
    all MLP gate / up weights twice until the file is written (+0.8 GiB for a 1B model). One chunk
    covering the whole key is the same global tensor, which torch_dist reshards on load into the
    halves any TP asks for (the parity tests load it at TP = 2 and PP = 2).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for k, v in sharded_state_dict.items():
        if isinstance(v, dict):
            v = _whole_gated_fc1(v)
        elif isinstance(v, ShardedTensorFactory) and ".mlp.linear_fc1." in v.key:
            half = v.build()[0]
            n = half.prepend_axis_num  # the layer axis megatron prepends ("decoder.layers.mlp...")
            assert tuple(half.global_shape[n:]) == tuple(v.data.shape), (v.key, half.global_shape)  # TP = 1
            layer_offsets = [(a, half.global_offset[a], half.axis_fragmentations[a]) for a in range(n)]
            v = ShardedTensor.from_rank_offsets(v.key, v.data, *layer_offsets, replica_id=v.replica_id,
                                                prepend_axis_num=n)
            assert v.global_shape == half.global_shape, (v.key, v.global_shape, half.global_shape)
        out[k] = v
    return out


def _save_strategy():
    """megatron's torch_dist save strategy, with the shard files written in this process.

    ``TorchDistSaveShardedStrategy.save`` runs ``AsyncRequest.execute_sync``: its ``preload_fn``
    (``FileSystemWriterAsync.preload_tensors(non_blocking=True)``) calls ``torch.cuda.synchronize()``,
    and in megatron-core 0.16 its writer forks a process per bucket (``write_preloaded_data_multiproc``)
    that reports through queues: on our CPU runs the child died without reporting (psutil was missing)
    and the parent waited forever, and forking a process that runs gloo threads is fragile anyway. The
    tensors of a converter are in host memory already, so here the preload runs only when CUDA exists
    and the writing happens in this process:

    * 0.16 (``write_preloaded_data_multiproc``): our :func:`_write_buckets_in_process` runs the same
      ``FileSystemWriterAsync.write_preloaded_data`` bucket by bucket; the files written are the same.
    * 0.17 - 0.19 (``write_preloaded_data_multithread``): megatron writes with threads, no fork, so our
      in-process writer is not needed; megatron's own function is called directly (after
      ``async_save(..., async_strategy="mcore")``, as megatron's sync ``save`` does there).

    Anything else (other function names or argument counts: private megatron internals) fails with
    "unsupported megatron-core version" rather than an opaque unpacking error.

    megatron's results queue is by default a *spawn* ``Manager`` (a server process re-importing
    ``__main__``, ~2 s and ~270 MB, impossible in a daemonic process); the writers run in this process
    here, so each save gets a thread queue instead (:func:`_thread_results_queue`).
    """
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class _InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            # On CPU, state_dict_saver's CUDA device requests (its finalize flag tensor) are served
            # by megatron_credit.distributed's CPU shims, installed by initialize() before any save.
            import inspect

            # 0.17+: async_save defaults to nvidia-resiliency-ext ("nvrx"); megatron's own sync save
            # asks for its built-in "mcore" implementation, as we do. 0.19 deprecates "mcore" (a one-time
            # "MCore's async save is deprecated" warning) in favour of "nvrx", which needs the
            # nvidia-resiliency-ext package and does not exist in 0.16.1: "mcore" stays (README: Status).
            kwargs = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(self.async_save).parameters \
                else {}
            with _thread_results_queue():
                request = self.async_save(sharded_state_dict, checkpoint_dir, **kwargs)
            write = _checked_write_fn(request)
            if write is not None:
                fn_name, writer_args, (rank, buckets, results) = write
                if request.preload_fn is not None and torch.cuda.is_available():
                    buckets = request.preload_fn()  # device tensors -> host, as execute_sync does
                if fn_name == "write_preloaded_data_multithread":
                    request.async_fn(rank, buckets, results)
                else:
                    _write_buckets_in_process(*writer_args, rank, buckets, results)
            torch.distributed.barrier()
            for fn in request.finalize_fns:
                fn()

    return _InProcessTorchDistSave("torch_dist", 1, thread_count=1)


@contextlib.contextmanager
def _thread_results_queue() -> Iterator[None]:
    """megatron's results queue as a ``queue.Queue`` while a save request is built (see :func:`_save_strategy`).

    The writer keeps the queue it was given, so the global is restored once the request exists."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    saved, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


_WRITE_FNS = ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
_WRITE_ITEM_PARAMS = ("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue",
                      "use_fsync")


def _unsupported(detail: str) -> RuntimeError:
    from megatron.core import package_info

    return RuntimeError(f"unsupported megatron-core version {package_info.__version__} for the in-process "
                        f"checkpoint writer (megatron_credit/conversion/checkpoint.py; checked on 0.16.1 - "
                        f"0.19.2): {detail}")


def _checked_write_fn(request) -> tuple[str, tuple, tuple] | None:
    """``(function name, (transform_list, use_msc), (rank, write_buckets, results_queue))`` of megatron's
    async save request, or None when this rank writes nothing; raises on an unknown layout."""
    import functools
    import inspect

    for attr in ("async_fn", "async_fn_args", "preload_fn", "finalize_fns"):
        if not hasattr(request, attr):
            raise _unsupported(f"the async save request {type(request).__name__} has no {attr!r}")
    fn = request.async_fn
    if fn is None:
        return None
    if not isinstance(fn, functools.partial):
        raise _unsupported(f"async_fn is a {type(fn).__name__}, expected functools.partial")
    name = getattr(fn.func, "__name__", repr(fn.func))
    if name not in _WRITE_FNS:
        raise _unsupported(f"async_fn wraps {name!r}, expected one of {_WRITE_FNS}")
    if len(fn.args) != 2 or fn.keywords:
        raise _unsupported(f"{name} is bound to {len(fn.args)} positional / {sorted(fn.keywords)} keyword "
                           "arguments, expected (transform_list, use_msc)")
    args = tuple(request.async_fn_args)
    if len(args) != 3:
        raise _unsupported(f"async_fn_args has {len(args)} entries, expected (rank, write_buckets, results_queue)")
    if name == "write_preloaded_data_multiproc":
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        params = tuple(inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters)
        if params[:len(_WRITE_ITEM_PARAMS)] != _WRITE_ITEM_PARAMS:
            raise _unsupported(f"FileSystemWriterAsync.write_preloaded_data takes {params}, expected "
                               f"{_WRITE_ITEM_PARAMS} first")
    return name, tuple(fn.args), args


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``write_preloaded_data_multiproc`` without the worker processes (same results protocol)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
        idx, out = local.get()
        if isinstance(out, Exception):
            global_results_queue.put(out)
            return
        results[idx] = out
    global_results_queue.put(results)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    """``conversion_meta.json`` of a converted checkpoint, checked (CheckpointFormatError naming it)."""
    path = Path(ckpt_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: is {str(ckpt_dir)!r} a converted checkpoint?")
    try:
        meta = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(path, f"is not valid JSON ({exc})") from None
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
