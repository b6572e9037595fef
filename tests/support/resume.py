"""What the resume tests share (one home instead of test files importing one another): a checkpointed run
in a pool worker that can compare, right after the load, this rank's shards with the checkpoint's global
tensors (:func:`train_checkpointed`), and those global tensors as one file (:func:`global_tensors`).
Used by ``tests/trainer/test_resume_layouts.py`` (every layout pair) and ``tests/trainer/test_moe_resume.py``
(across expert-parallel sizes)."""
from __future__ import annotations

import os

import torch

from tests.support.runs import TINY_CHECKPOINTED


def train_checkpointed(run_dir: str, resume: str, overrides, saved: str | None = None, base: dict | None = None):
    """``train`` of ``base`` (default :data:`TINY_CHECKPOINTED`) with ``overrides`` on every rank of the worker;
    returns ``(rows, log lines, the load's comparison, the error line or None)``: a refused resume fails its
    own test, not a fixture. With ``saved`` (:func:`global_tensors`), this rank's model and optimizer shards
    are compared with them right after ``checkpoint.load`` (:func:`compare_shards`)."""
    from megatron_credit import distributed
    from megatron_credit.cli import error_line
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import checkpoint, loop

    recipe = recipe_from_dict(TINY_CHECKPOINTED if base is None else base, overrides=list(overrides))
    lines: list[str] = []
    compared: dict = {}
    original = checkpoint.load

    def load(path, actor, **kwargs):
        out = original(path, actor, **kwargs)
        compared.update(compare_shards(actor, saved))
        return out

    if saved is not None:
        checkpoint.load = load
    device = distributed.initialize(recipe.parallel, seed=recipe.seed)
    try:
        rows = loop.train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume=resume,
                          log=lines.append)
    except ValueError as exc:
        return None, lines, compared, error_line(exc)
    finally:
        distributed.destroy()
        checkpoint.load = original
    return rows, lines, compared, None


def compare_shards(actor, saved: str) -> dict:
    """This rank's share of the model and the optimizer moments (megatron's sharded state dict, as a save
    would write it) against the checkpoint's global tensors: how many were compared, and the keys of
    those that differ."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_credit.trainer.checkpoint import _sharded_state

    whole = torch.load(saved, weights_only=True)
    state = _sharded_state(actor, for_load=False)
    apply_factories(state)
    shards = [v for v in nested_values(state) if isinstance(v, ShardedTensor)]
    differ = sorted({v.key for v in shards
                     if not torch.equal(v.data.detach().cpu(), whole[v.key][v.global_slice()].to(v.data.dtype))})
    return {"tensors": len(shards), "optimizer": sum(v.key.startswith("optimizer.") for v in shards),
            "differ": differ}


def global_tensors(model_dir: str, out: str) -> str:
    """The tensors of the dist checkpoint ``model_dir`` (model and optimizer, whole) as one ``torch.save``
    file ``out``, readable with ``weights_only=True``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(model_dir, out + ".all")
    everything = torch.load(out + ".all", weights_only=False)  # written just above from our own save
    torch.save({k: v for k, v in everything.items() if isinstance(v, torch.Tensor)}, out)
    os.remove(out + ".all")
    return out
