"""Checkpoints of a run: model and optimizer as a megatron distributed checkpoint (reshardable), plus
every rank's RNG states and data position, written atomically.

The files of ``<run>/checkpoints/iter_0000012/``:

- ``model_optim/``: megatron ``torch_dist`` checkpoint of the model's sharded state dict and the AdamW
  moments sharded exactly like their parameters (megatron's ``optim_state_to_sharding_state``), so a run
  resumes under another TP / PP / CP / DP layout (megatron reshards on load); with ``optim.backend:
  megatron``, megatron's optimizer's own ``sharded_state_dict`` (the distributed optimizer's
  ``fully_reshardable`` format, which reshards too);
- ``critic_optim/``: the same for a separate value model (PPO's ``algorithm.params.critic: separate``);
- ``rank_00003.pt``: this rank's RNG states and data cursor (``torch.load(weights_only=True)``: no
  pickled code runs from a checkpoint);
- ``meta.json``: step, layout, optimizer step count, the lr schedule (megatron's
  ``OptimizerParamScheduler.state_dict()``), and the same of a separate critic under ``critic``; written
  last.

Every rank writes into ``iter_0000012.tmp``; after a barrier rank 0 renames the directory, so a crash or
a SIGKILL during a save never leaves a directory that looks complete, and ``--resume auto`` takes the
newest directory without the ``.tmp`` suffix. A failed save removes its ``.tmp`` (and names a full
disk: :func:`save_error`); a save also removes the ``.tmp`` a killed one left.

Before the model is built, :func:`resolve` passes every file of the checkpoint through the export
tools' safe loader (``checkpoint_check``: no pickle beyond torch's checkpoint classes, byte items and
rank files ``weights_only``, sizes checked); ``--resume auto`` falls back past a refused one, saying so.

Resuming under the same layout is exact (same samples, same numbers). Under another layout the model and optimizer reshard exactly; sampling seeds depend on
the data-parallel rank and the prompts are re-sharded, so the data position is carried over as the
number of prompts consumed and the run continues on new samples.

A megatron adapter by design (like ``actor.py``): the format is megatron's ``dist_checkpointing`` and the
optimizer moments are mapped with its ``optimizer`` helpers, so this file imports megatron; the iteration
(``loop.py``, ``step.py``, ``context.py``, ...) reaches it only through :func:`save` / :func:`load`.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_credit.distributed import rng_state, set_rng_state  # noqa: F401  (the rank files' RNG states)
from megatron_credit.run_dir import (_DIR, CRITIC_OPTIM, MODEL_OPTIM, checkpoint_dir,  # noqa: F401
                                     complete_checkpoints)


def reference_extras(actor) -> dict[str, Any]:
    """The frozen reference as a rank file saves it. A reference that is still the HF weights the run
    started from (``actor.reference_from``: ``model.name_or_path``, no warm-up, no layout change since) is
    saved as that path and a SHA-256 of this rank's shard, not as a second copy of the weights (a
    135M-parameter model's checkpoint shrank by 0.5 GB so); any other reference in full."""
    if getattr(actor, "reference_off", False):  # LoRA: the reference is the base, which the run names
        return {"adapters_off": True}
    if getattr(actor, "reference_from", None) is not None:
        return {"hf_weights": actor.reference_from, "sha256": state_digest(actor.reference.state_dict())}
    # host copies: the rank file is read back with map_location="cpu" (and on another device count)
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in actor.reference.state_dict().items()}


def load_reference(actor, saved: dict[str, Any], *, path: str) -> None:
    """Restore the reference from a rank file's entry (:func:`reference_extras`). The HF-weights form is
    checked: the reference the trainer just loaded from ``model.name_or_path`` must be the saved one,
    bit for bit, or the resume stops naming the folder."""
    if saved.get("adapters_off"):
        if not getattr(actor, "reference_off", False):
            raise ValueError(f"--resume {path}: the checkpoint's reference is its LoRA base (the adapters off), "
                             "and this run has no adapters (model.lora.rank)")
        return
    if "hf_weights" not in saved:
        (actor.reference_copy() if actor.reference is None else actor.reference).load_state_dict(saved)
        actor.reference_from = None
        return
    mine = getattr(actor, "reference_from", None)
    if mine is None or os.path.abspath(mine) != os.path.abspath(saved["hf_weights"]) or \
            state_digest(actor.reference.state_dict()) != saved["sha256"]:
        raise ValueError(f"--resume {path}: the reference model was saved as the HF weights of "
                         f"{saved['hf_weights']!r}, and model.name_or_path ({actor.model_path!r}) "
                         "does not hold those weights now (changed or another folder)")


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a state dict's tensors (names, dtypes, shapes and bytes, in key order)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        v = state[k]
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().contiguous()
            h.update(f"{k}:{v.dtype}:{tuple(v.shape)};".encode())
            h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sharded_state(actor, *, for_load: bool) -> dict[str, Any]:
    """The model's sharded state dict and the AdamW moments sharded like their parameters.

    Every trainable parameter gets a state entry (zeros where the optimizer has none yet, which is what
    AdamW would create on its first step), so a save and a load always name the same tensors. The
    per-parameter ``step`` is common to all parameters and travels in ``meta.json``."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    opt = actor.optimizer
    if not for_load:
        actor.gather_params()  # overlap_param_gather: the last step's shards, gathered before they are saved
    if actor.megatron_optimizer:  # megatron's own sharded optimizer state (reshardable, distributed or not)
        if for_load:
            _materialize_adam_state(opt)
        model_sd = _trained_entries(actor, actor.model.sharded_state_dict())
        # fully_reshardable: each parameter's state in model space (gathered on DP rank 0 for the save), so
        # the distributed optimizer's state reshards over TP / PP / DP (0.16.1 refuses to save the older
        # fully_sharded_model_space's flattened ranges).
        # On CPU the exchange goes through the gloo DP group (``_mem_efficient``: megatron's NCCL path calls
        # ``.cuda()``); interchangeable formats for megatron, so a GPU run resumes a CPU save and back.
        meta = {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}
        return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=for_load, metadata=meta)}
    masters = [m for g in opt.param_groups for m in g["params"]]  # the model's params when fp32
    for m, p in zip(masters, opt.model_params):
        st = opt.state[m]
        if "exp_avg" not in st or for_load:
            st["exp_avg"] = torch.zeros_like(m) if "exp_avg" not in st else st["exp_avg"]
            st["exp_avg_sq"] = torch.zeros_like(m) if "exp_avg_sq" not in st else st["exp_avg_sq"]
            st.setdefault("step", torch.tensor(0.0))
        if m is not p:  # bf16 / fp16 model: the fp32 master weights travel with the moments
            st["master_param"] = m.detach()
    model_sd = _trained_entries(actor, actor.model.sharded_state_dict())
    optim_sd = opt.state_dict()
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, opt.model_params),
                                  exclude_keys=("step",))
    return {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}


def _trained_entries(actor, model_sd: dict[str, Any]) -> dict[str, Any]:
    """A LoRA run's checkpoint holds what trains (the adapters, a value head), not its frozen base, which
    ``meta.json`` names (``lora.base``) and the run loads from ``model.name_or_path``; others hold everything."""
    if getattr(actor, "lora", None) is None:
        return model_sd
    trained = {id(p) for p in actor.model.parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if id(getattr(v, "data", None)) in trained}


def lora_meta(actor) -> Optional[dict[str, Any]]:
    """What a LoRA checkpoint records of its adapters and the base they were trained on (None: no LoRA)."""
    lora = getattr(actor, "lora", None)
    if lora is None:
        return None
    dtype = next(p.dtype for p in actor.model.parameters() if not p.requires_grad)  # the frozen base's
    return {"rank": lora.rank, "alpha": lora.scale_alpha, "targets": list(lora.targets),
            "base": os.path.abspath(actor.model_path) if actor.model_path else None,
            "base_dtype": str(dtype).removeprefix("torch.")}


def _check_lora(path: str, meta: dict[str, Any], actor) -> None:
    """One line when the checkpoint's adapters (or their absence) do not fit this run's ``model.lora``, or were
    trained on another base than ``model.name_or_path``."""
    saved, mine = meta.get("lora"), lora_meta(actor)
    if saved is None and mine is None:
        return
    if saved is None or mine is None:
        raise ValueError(f"--resume {path}: the checkpoint {'has' if saved else 'has no'} LoRA adapters and this "
                         f"recipe {'has' if mine else 'has none'} (model.lora.rank: "
                         f"{saved['rank'] if saved else 0} in the checkpoint, {mine['rank'] if mine else 0} here)")
    for field in ("rank", "alpha", "targets"):
        if saved[field] != mine[field]:
            raise ValueError(f"--resume {path}: model.lora.{field}: checkpoint {saved[field]}, recipe {mine[field]}")
    if saved["base"] != mine["base"]:
        raise ValueError(f"--resume {path}: the checkpoint's adapters were trained on the base {saved['base']}, "
                         f"and model.name_or_path is {mine['base']}")


@torch.no_grad()
def _materialize_adam_state(opt) -> None:
    """Give a fresh megatron optimizer the Adam state a load fills in (``step`` included: without Apex / TE
    megatron's ``DistributedOptimizer.state_dict`` reads one ``step`` from every parameter's state): one
    step with zero gradients at lr 0, which leaves every parameter exactly as it is."""
    for inner in opt.chained_optimizers:
        torch_opt = inner.optimizer
        if len(torch_opt.state) > 0:
            continue
        lrs = [g["lr"] for g in torch_opt.param_groups]
        for g in torch_opt.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        for g, lr in zip(torch_opt.param_groups, lrs):
            g["lr"] = lr


def _adam_step(actor) -> float:
    if actor.megatron_optimizer:  # in megatron's optimizer state itself
        return 0.0
    steps = {float(st["step"]) for st in actor.optimizer.state.values() if "step" in st}
    return max(steps, default=0.0)


def _optimizer_meta(actor) -> dict[str, Any]:
    return {"optimizer_steps": actor.optimizer_steps, "adam_step": _adam_step(actor),
            "opt_param_scheduler": actor.scheduler.state_dict()}


def save(run_dir: str, step: int, actor, extras: dict[str, Any], *, layout: dict[str, int], keep: int,
         critic=None) -> str:
    """Collective: the model and optimizer as one distributed checkpoint (and a separate ``critic``'s as a
    second one), each rank's extras, then rank 0 publishes the directory and prunes old ones."""
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion.mcore_save import _save_strategy

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = checkpoint_dir(run_dir, step)
    tmp = final + ".tmp"
    try:
        if rank == 0:
            _remove_leftover_saves(run_dir)  # a killed or failed save's .tmp never blocks this one
            os.makedirs(os.path.join(tmp, MODEL_OPTIM))
            if critic is not None:
                os.makedirs(os.path.join(tmp, CRITIC_OPTIM))
        _barrier()
        for model, sub in ((actor, MODEL_OPTIM), (critic, CRITIC_OPTIM)):
            if model is not None:
                dist_checkpointing.save(_sharded_state(model, for_load=False), os.path.join(tmp, sub),
                                        sharded_strategy=_save_strategy())
        path = os.path.join(tmp, f"rank_{rank:05d}.pt")
        torch.save(extras, path + ".part")
        os.replace(path + ".part", path)
        _barrier()
        if rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                meta = {"step": step, "layout": layout, **_optimizer_meta(actor), "critic_lr": actor.optim.critic_lr}
                if lora_meta(actor) is not None:
                    meta["lora"] = lora_meta(actor)
                if critic is not None:
                    meta["critic"] = _optimizer_meta(critic)
                json.dump(meta, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # the publication: a directory without .tmp is complete
            for _, old in complete_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial save: it holds the space the next one needs
        err = save_error(final, exc)
        if err is exc:
            raise
        raise err from exc
    _barrier()
    return final


def _remove_leftover_saves(run_dir: str) -> None:
    root = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if name.endswith(".tmp") and _DIR.match(name[:-len(".tmp")]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class CheckpointSaveError(ValueError):
    """A save that failed for a reason the user fixes (a full disk, a read-only run directory)."""


def save_error(final: str, exc: Exception) -> Exception:
    """``exc`` of a failed save as one line naming the cause (CheckpointSaveError), or ``exc`` itself
    when it is not the disk's: torch's zip writer reports a full disk as ``enforce fail at
    inline_container.cc``, never naming the space, so the free space is looked at too."""
    import errno

    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    codes = {getattr(e, "errno", None) for e in chain}
    text = " ".join(str(e) for e in chain)
    root = os.path.dirname(os.path.dirname(final))
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if errno.ENOSPC in codes or errno.EDQUOT in codes or "No space left" in text or (
            "inline_container" in text and free is not None and free < 256 * 1024 ** 2):
        return CheckpointSaveError(f"saving checkpoint {final}: no space left on device ({free} bytes free under "
                                   f"{root}); the partial save was removed, the earlier checkpoints are intact")
    if errno.EROFS in codes or errno.EACCES in codes or errno.EPERM in codes:
        return CheckpointSaveError(f"saving checkpoint {final}: the run directory {root} is not writable "
                                   f"({' '.join(str(exc).split())[:200]})")
    return exc


def resolve(run_dir: str, resume: str, *, log=print) -> Optional[str]:
    """``--resume``: ``none`` -> None; ``auto`` -> the newest complete checkpoint that passes the safety
    checks of ``checkpoint_check`` (or None); a path, checked. See ``checkpoint_check.resolve``."""
    from megatron_credit.trainer.checkpoint_check import resolve as checked_resolve

    return checked_resolve(run_dir, resume, log=log)


def load(path: str, actor, *, layout: dict[str, int],
         critic=None) -> tuple[int, Optional[dict[str, Any]], dict[str, Any]]:
    """Load the model and optimizer of checkpoint ``path`` into ``actor`` (and a separate ``critic``'s), in
    any layout (megatron reshards).

    Returns ``(step, this rank's extras or None when the layout differs, meta)``."""
    from megatron_credit.trainer.checkpoint_check import read_meta

    meta = read_meta(path)  # resolve() checked every file of the checkpoint before the model was built
    saved_critic = "critic" in meta
    if saved_critic != (critic is not None):
        raise ValueError(f"--resume {path}: the checkpoint {'has a' if saved_critic else 'has no'} separate critic "
                         f"model and this recipe {'has one' if critic is not None else 'has none'} "
                         "(algorithm.params.critic, separate or trunk, must be the one of the run that saved it)")
    _check_schedule(path, meta, actor, critic=critic)  # before anything is loaded
    _check_lora(path, meta, actor)
    _load_model_optim(path, MODEL_OPTIM, actor, meta)
    if critic is not None:
        _load_model_optim(path, CRITIC_OPTIM, critic, meta["critic"])
    return _finish_load(path, meta, layout)


def _load_model_optim(path: str, sub: str, actor, meta: dict[str, Any]) -> None:
    """One model's weights, optimizer state and schedule position from ``path/sub``; ``meta`` holds its
    ``adam_step`` / ``opt_param_scheduler`` / ``optimizer_steps``."""
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion.safe_load import checkpoint_errors_unwrapped, weights_only_byte_items
    from megatron_credit.trainer.checkpoint_check import check_request

    model_dir = os.path.join(path, sub)
    # names a model mismatch before any read; every pipeline stage judges the whole model's request
    check_request(model_dir, _sharded_state(actor, for_load=True),
                  pipeline_group=actor.pp_group if actor.pp_size > 1 else None)
    request = _sharded_state(actor, for_load=True)
    with weights_only_byte_items(model_dir), checkpoint_errors_unwrapped():  # a second guard (safe_load)
        state = dist_checkpointing.load(request, model_dir)
    result = actor.model.load_state_dict(state["model"], strict=False)
    missing = list(result.missing_keys)
    if getattr(actor, "lora", None) is not None:  # the frozen base came from model.name_or_path
        trained = {n for n, p in actor.model.named_parameters() if p.requires_grad}
        missing = [k for k in missing if k in trained]
    bad = [k for k in missing + list(result.unexpected_keys) if not k.endswith("_extra_state")]
    if bad:
        raise ValueError(f"checkpoint {path}: model keys do not match this model: {bad[:5]}")
    opt = actor.optimizer
    if actor.megatron_optimizer:
        # megatron's load restores its param groups' schedule keys: this recipe's are kept (checked equal above
        # unless optim.resume_schedule is recipe)
        keys = [{k: g[k] for k in SCHEDULE_GROUP_KEYS} for g in opt.param_groups]
        _load_megatron_optimizer(opt, state["optimizer"])
        for g, k in zip(opt.param_groups, keys):
            g.update(k)
        _load_schedule(meta, actor)
        return
    masters = [m for g in opt.param_groups for m in g["params"]]
    adam_step = torch.tensor(float(meta["adam_step"]))
    for i, (m, p) in enumerate(zip(masters, opt.model_params)):
        loaded = state["optimizer"]["state"][i]
        opt.state[m] = {"step": adam_step.clone(), "exp_avg": loaded["exp_avg"].to(m.dtype).clone(),
                        "exp_avg_sq": loaded["exp_avg_sq"].to(m.dtype).clone()}
        if m is not p:
            with torch.no_grad():
                m.copy_(loaded["master_param"])
    _load_schedule(meta, actor)


SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr", "wd_mult")
# OptimizerParamScheduler.state_dict() entries -> the recipe fields they come from
SCHEDULE_FIELDS = {"max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_steps",
                   "lr_decay_style": "optim.schedule", "lr_decay_steps": "optim.warmup_steps + optim.decay_steps",
                   "start_wd": "optim.weight_decay"}


def _check_schedule(path: str, meta: dict[str, Any], actor, *, critic=None) -> None:
    """``optim.resume_schedule: strict``: the recipe's lr schedule must be the checkpoint's (one error
    naming every field that differs), before anything is loaded."""
    saved = meta.get("opt_param_scheduler")
    if saved is None or actor.optim.resume_schedule != "strict":
        return
    mine = actor.scheduler.state_dict()
    constant = "constant" in (mine["lr_decay_style"], saved["lr_decay_style"])  # decay steps: not the recipe's then
    keys = [k for k in SCHEDULE_FIELDS if not (k == "lr_decay_steps" and constant)]
    diff = [f"{SCHEDULE_FIELDS[k]}: checkpoint {saved[k]!r}, recipe {mine[k]!r}" for k in keys if saved[k] != mine[k]]
    critic_lr = actor.optim.critic_lr
    if (getattr(actor, "with_critic", False) or critic is not None) and meta.get("critic_lr", critic_lr) != critic_lr:
        diff.append(f"optim.critic_lr: checkpoint {meta['critic_lr']!r}, recipe {critic_lr!r}")
    if diff:
        raise ValueError(f"--resume {path}: the recipe's lr schedule differs from the checkpoint's ("
                         + "; ".join(diff) + "); set optim.resume_schedule=recipe to continue with the recipe's "
                         "schedule from the checkpoint's step")


def _load_schedule(meta: dict[str, Any], actor) -> None:
    """The schedule's position (and, checked or overridden, its settings): megatron's ``load_state_dict``."""
    saved = meta.get("opt_param_scheduler")
    if saved is None:  # a checkpoint from before the scheduler was saved: its position only
        actor.optimizer_steps = int(meta["optimizer_steps"])
        return
    sched = actor.scheduler
    sched.num_steps = 0  # load_state_dict adds the saved step count
    sched.load_state_dict(saved)


def _load_megatron_optimizer(opt, state) -> None:
    """``opt.load_state_dict(state)``, with the distributed optimizer's parameter state loaded after the
    torch Adam ``step`` entries are set aside: without Apex / TE, megatron 0.16.1's ``load_state_dict``
    puts ``step`` into every parameter's state and then ``_set_main_param_and_optimizer_states`` expects a
    loaded tensor for every state key, ``step`` included (a KeyError). The step is restored after, as a
    tensor of its own per parameter."""
    inners = opt.chained_optimizers
    states = [state] if len(inners) == 1 else (
        [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state))
    for inner, st in zip(inners, states):
        param_state = st.pop("param_state", None)
        kind = st.pop("param_state_sharding_type", None)
        inner.load_state_dict(st)
        # megatron's torch-Adam path gives every parameter the same ``step`` tensor object, which Adam then
        # increments in place once per parameter: each parameter gets its own.
        for p_state in inner.optimizer.state.values():
            if "step" in p_state:
                p_state["step"] = p_state["step"].clone()
        if param_state is None:
            continue
        if kind != "fully_reshardable":
            raise ValueError(f"distributed optimizer state of type {kind!r}: this trainer saves fully_reshardable")
        torch_state = inner.optimizer.state
        steps = {p: torch_state[p].pop("step") for p in list(torch_state) if "step" in torch_state[p]}
        try:
            inner.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                torch_state[p]["step"] = step
    if len(inners) > 1:
        opt._synchronize_steps()


def _finish_load(path: str, meta: dict[str, Any], layout: dict[str, int]):
    extras = None
    if meta.get("layout") == layout:
        rank = dist.get_rank() if dist.is_initialized() else 0
        extras = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True)
    return int(meta["step"]), extras, meta


def rank0_extras(path: str) -> dict[str, Any]:
    """Rank 0's extras of checkpoint ``path``, read on any layout: what every rank saves alike (the job's
    prompt stream)."""
    return torch.load(os.path.join(path, "rank_00000.pt"), map_location="cpu", weights_only=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
