"""What a resume checks before megatron reads a checkpoint, and which checkpoint ``--resume`` picks.

megatron's ``dist_checkpointing.load`` unpickles ``model_optim/.metadata`` with plain ``pickle`` and the
byte items of the ``.distcp`` files (each layer's ``_extra_state``) with ``weights_only=False``: a
checkpoint handed over by someone else runs code on a plain ``--resume``. So every file of a checkpoint
goes through the export tools' checks (``conversion/safe_load.py``) first, before the model is built:

- ``meta.json``: JSON naming a step and a layout;
- ``model_optim/`` (and ``critic_optim/`` when ``meta.json`` names a critic): the ``.metadata`` pickle
  with only torch's checkpoint classes, every data file present and as long as the metadata says, and
  every byte item loading with ``weights_only=True``;
- every ``rank_NNNNN.pt``: loads with ``weights_only=True``.

Every rank checks every file, so all ranks reach the same verdict without a collective. A refused file
is one :class:`~megatron_credit.conversion.hf_io.CheckpointFormatError` naming it; ``--resume auto``
then takes the newest checkpoint that passes and says which it skipped. The load itself still runs
under ``weights_only_byte_items`` (a second guard, for files changed after the check).

Partly a megatron adapter by design: :func:`check_request` compares the model's tensors with the
checkpoint's through megatron's sharded state dict (``dist_checkpointing.mapping``, imported there only),
over the whole model: the union of what every pipeline stage asks for (:func:`whole_model_request`), so
a checkpoint resumes under any layout; the rest is the standard library and torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_credit.conversion.hf_io import CheckpointFormatError, read_json

from megatron_credit.run_dir import CRITIC_OPTIM, MODEL_OPTIM, complete_checkpoints


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of a run checkpoint; CheckpointFormatError naming the file if it is not one."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise CheckpointFormatError(meta_path, "is missing: not a complete run checkpoint")
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or not isinstance(meta.get("layout"), dict):
        raise CheckpointFormatError(meta_path, "does not name an integer 'step' and a 'layout': not written by "
                                    "this trainer")
    for key in ("optimizer_steps", "adam_step"):
        if key not in meta:
            raise CheckpointFormatError(meta_path, f"has no {key!r}: not written by this trainer")
    return meta


def check_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check every file of run checkpoint ``path`` (module docstring) without building anything from
    it; returns its ``meta.json``. Raises CheckpointFormatError (or UnsafeCheckpointError) naming the
    first file refused."""
    from megatron_credit.conversion.safe_load import (check_byte_items, check_dist_checkpoint,
                                                      check_weights_only_file)

    path = Path(path)
    meta = read_meta(path)
    subs = [MODEL_OPTIM] + ([CRITIC_OPTIM] if "critic" in meta else [])
    for sub in subs:
        try:
            metadata = check_dist_checkpoint(path / sub)
        except FileNotFoundError:
            raise CheckpointFormatError(path / sub, "is missing: the checkpoint is incomplete") from None
        check_byte_items(path / sub, metadata)
    ranks = sorted(path.glob("rank_*.pt"))
    if not ranks:
        raise CheckpointFormatError(path, "holds no rank_NNNNN.pt file: the checkpoint is incomplete")
    for rank_file in ranks:
        check_weights_only_file(rank_file)
    return meta


def resolve(run_dir: str, resume: str, *, log: Callable[[str], None] = print) -> Optional[str]:
    """``--resume``: ``none`` -> None; ``auto`` -> the newest complete checkpoint that passes
    :func:`check_checkpoint` (None when the run has none; a ValueError when every one is refused);
    a path -> that checkpoint, checked (CheckpointFormatError naming the refused file)."""
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.isdir(resume):
            raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
        check_checkpoint(resume)
        return resume
    done = complete_checkpoints(run_dir)
    refused = []
    for _, path in reversed(done):
        try:
            check_checkpoint(path)
        except CheckpointFormatError as exc:
            refused.append(path)
            log(f"warning: --resume auto: skipping checkpoint {path}: {' '.join(str(exc).split())}")
            continue
        if refused:
            log(f"warning: --resume auto: falling back to {path}, the newest checkpoint that passes the checks")
        return path
    if refused:
        raise ValueError(f"--resume auto: every checkpoint of {os.path.join(run_dir, 'checkpoints')} was refused "
                         f"(newest {refused[0]}; see the warnings above); pass --resume PATH or --resume none "
                         "with another --output-dir")
    return None


def check_request(model_dir: str | os.PathLike, request: dict, *, pipeline_group=None) -> None:
    """The checkpoint at ``model_dir`` stores every tensor this model and optimizer ask for, with the
    same global shape, and no model tensor this model lacks (e.g. a value head of a PPO run resumed
    by FIPO, which a load would drop silently). One ValueError naming the checkpoint, the recipe
    fields to compare and a few keys, before megatron reads any data.

    "This model" is the whole model, every pipeline stage of it: a stage holds only its part (the
    first the embedding, the last the final norm and the output layer), so the tensors each stage asks
    for are gathered over ``pipeline_group`` (names and shapes, once per resume) and every stage judges
    their union. So all stages reach the same verdict, and a checkpoint saved without pipeline
    parallelism resumes with it; a tensor no stage owns is still refused.

    ``request``: a freshly built sharded state dict (its factories are applied here, in place);
    ``pipeline_group``: this rank's pipeline-parallel group (None: one stage)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_credit.conversion.safe_load import read_dist_metadata

    stored = {k: tuple(m.size) for k, m in read_dist_metadata(model_dir).state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata)}
    apply_factories(request)
    mine = {v.key: tuple(v.global_shape) for v in nested_values(request) if isinstance(v, ShardedTensor)}
    wanted = whole_model_request(mine, pipeline_group)
    where = f"--resume {model_dir}"
    hint = "(model.architecture / model.name_or_path and algorithm.name must be those of the run that saved it)"
    # the model's own tensors first: the optimizer's state of them is named after them
    missing = sorted((k for k in wanted if k not in stored), key=lambda k: (k.startswith("optimizer."), k))
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} tensor(s) this recipe's model needs, "
                         f"e.g. {missing[:3]} {hint}")
    shapes = [f"{k}: checkpoint {list(stored[k])}, model {list(s)}" for k, asked in sorted(wanted.items())
              for s in sorted(asked) if stored[k] != s]
    if shapes:
        raise ValueError(f"{where}: {len(shapes)} tensor(s) have another shape than this recipe's model, e.g. "
                         f"{'; '.join(shapes[:2])} {hint}")
    extra = sorted(k for k in stored if k not in wanted and not k.startswith("optimizer."))
    if extra:
        raise ValueError(f"{where}: the checkpoint holds {len(extra)} model tensor(s) this recipe's model does not "
                         f"have, e.g. {extra[:3]} {hint}")


def whole_model_request(mine: dict[str, tuple], pipeline_group=None) -> dict[str, set[tuple]]:
    """Checkpoint key -> the global shapes asked for it, over every stage of ``pipeline_group``:
    ``mine`` (this stage's key -> shape) all-gathered (None or a group of one: ``mine`` alone). A
    collective on the group when it has several ranks: every stage calls it at the same point. A tied
    output layer asks for the embedding's key on the last stage too, hence a set of shapes per key.

    >>> whole_model_request({"embedding.word_embeddings.weight": (64, 32)})
    {'embedding.word_embeddings.weight': {(64, 32)}}
    """
    stages = [mine]
    if pipeline_group is not None:
        import torch.distributed as dist

        size = dist.get_world_size(pipeline_group)
        if size > 1:
            stages = [None] * size
            dist.all_gather_object(stages, mine, group=pipeline_group)  # bounded by the group's timeout
    union: dict[str, set[tuple]] = {}
    for stage in stages:
        for key, shape in stage.items():
            union.setdefault(key, set()).add(tuple(shape))
    return union


RUN_FILES = ("metrics.jsonl", "checkpoints")


def check_fresh_run_dir(run_dir: str) -> None:
    """``--resume none``: refuse a run directory that already holds a run (its ``metrics.jsonl`` or
    checkpoints), instead of cutting its metrics and leaving its newer checkpoints for the next
    ``--resume auto`` to mix in. FileExistsError naming the directory and what it holds."""
    held = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        held.append("metrics.jsonl")
    n = len(complete_checkpoints(run_dir))
    if n:
        held.append(f"{n} checkpoint(s)")
    if held:
        raise FileExistsError(f"--resume none: {run_dir} already holds a run ({', '.join(held)}); continue it with "
                              "--resume auto, or start the new run in another --output-dir (or remove that one)")
