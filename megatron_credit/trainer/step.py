"""One RL iteration (docs/architecture.md "Data flow"), with no megatron import.

:func:`rl_iteration` is the whole iteration on one screen; the functions below it are its parts. The
algorithm enters only through ``ctx.algorithm`` (an ``algorithm.base.Algorithm``: estimator, loss,
aggregation, critic, state), built from its typed config: nothing here looks at an algorithm's name or
reads a field of its config.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_credit.algorithm.base import AdvantageInputs
from megatron_credit.credit.diagnostics import advantage_sums
from megatron_credit.credit.future_kl import pass_observations
from megatron_credit.batch.microbatch import plan_minibatches
from megatron_credit.losses.importance import truncated_is_weights
from megatron_credit.losses.kl import KL_ESTIMATORS
from megatron_credit.rollout.mismatch import logprob_mismatch
from megatron_credit.batch.rows import MicroBatchCut, RowCopies
from megatron_credit.batch.train_batch import POSITION_FIELDS, TOKEN_FIELDS, TrainBatch, step_denominators
from megatron_credit.metrics.tables import CORE
from megatron_credit.metrics.sums import StatSums, loss_statistics

if TYPE_CHECKING:  # the iteration's inputs; no megatron import here
    from megatron_credit.trainer.context import Context


def rl_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    """Weights -> rollout -> rewards -> (dynamic sampling) -> old log-probs -> advantages -> update. The
    rollout source gets the weights of ``iteration - 1`` (each mode loads them when its engine can take them)."""
    timer = ctx.timer
    with timer("rollout"):  # engine + verifiers + dyn. sampling
        batch, rollout_metrics = ctx.rollouts.next(iteration, weights=ctx.weights(iteration - 1))
    ctx.check_length(int(batch.seq_lens.max()))
    fused = fused_old_logprob(ctx)
    plan = plan_microbatches(ctx, batch)
    with timer("old_logprob"):
        behaviour_pass(ctx, batch, plan, skip_first=fused)  # old_logp (+ values, ref_logp, the capture's side channels)
    stats = StatSums()
    with timer("advantages"):
        compute_advantages(ctx, batch, iteration, stats)
    if not fused:
        add_mismatch(batch, stats)
    with timer("update"):
        ctx.actor.reset_model_statistics()  # the update's forwards only (not a warm-up's)
        for epoch in range(ctx.knobs.epochs):
            for i, mini in enumerate(plan):
                update_minibatch(ctx, batch, mini, stats, first=epoch == 0 and i == 0,
                                 old_from_update=fused and epoch == 0 and i == 0)
    if fused:  # the first mini-batch's old log-probs exist only now
        add_mismatch(batch, stats)
    credit_diagnostics(ctx, batch, iteration, stats)
    stats.add(ctx.actor.model_statistics())  # e.g. a mixture of experts' routing (``Actor.metric_tables``)
    return {**rollout_metrics, **ctx.reduction(stats)}


# --------------------------------------------------------------------------------------------- parts
def add_mismatch(batch: TrainBatch, stats: StatSums) -> None:
    """Engine vs trainer log-probs of the sampled tokens (``rollout/mismatch_*``)."""
    if batch.old_logp is not None:
        mm = logprob_mismatch(batch.rollout_logp, batch.old_logp, batch.loss_mask)
        stats.add({"sum:mismatch_abs": mm["abs_diff_sum"], "sum:mismatch_tokens": batch.loss_mask.sum()})


def credit_view(ctx: Context, batch: TrainBatch, *, full: bool = False) -> dict[str, torch.Tensor]:
    """The per-token credit of the batch after the update, ``{name: [B, T]}`` whole rows: ``advantage``
    (what the loss applies to each token: the estimator's, or the algorithm's own, FIPO's ``f_t * A_t``,
    the estimator's then kept as ``estimator_advantage``) and the algorithm's quantities
    (``Algorithm.credit_fields``). ``full`` adds the trainer's own for the credit maps: ``logp_change``
    (the update forward's log-prob minus the behaviour's), the critic's ``value`` and ``return``, and the
    truncated importance weights ``tis_weight`` (with ``algorithm.tis_cap``)."""
    mask, old = batch.loss_mask, batch.old_logp
    logp = batch.update_logp if batch.update_logp is not None else old
    side = dict(batch.extras)
    if batch.obs_mask is not None:  # a multi-turn batch's observations, which the credit scans pass across
        side["obs_mask"] = batch.obs_mask
    own = ctx.algorithm.credit_fields(logp=logp, old_logp=old, advantages=batch.advantages, mask=mask, side=side)
    fields = {"advantage": batch.advantages}
    if "advantage" in own:
        fields["estimator_advantage"] = batch.advantages
    fields.update(own)
    if full:
        fields["logp_change"] = torch.where(mask, logp - old, 0.0)
        fields.update({k: v for k, v in (("value", batch.values), ("return", batch.returns)) if v is not None})
        if ctx.algorithm_section.tis_cap is not None:
            fields["tis_weight"] = truncated_is_weights(old, batch.rollout_logp, mask,
                                                        cap=ctx.algorithm_section.tis_cap)[0]
    return {k: v.detach().float() for k, v in fields.items()}


def credit_diagnostics(ctx: Context, batch: TrainBatch, iteration: int, stats: StatSums) -> None:
    """The ``credit/`` diagnostics of the applied advantages (``credit.diagnostics``, summed over ranks with
    the other statistics) and, when due, the iteration's credit map (``ctx.credit_maps``: written by the
    one rank that holds DP rank 0's rows whole)."""
    if batch.old_logp is None or batch.advantages is None:  # not the last pipeline stage
        return
    maps = ctx.credit_maps
    due = maps is not None and maps.due(iteration) and maps.holds_data(ctx.actor)
    with ctx.timer("credit"):
        fields = credit_view(ctx, batch, full=due)
        sums = advantage_sums(fields["advantage"], batch.loss_mask, batch.turn_ids)
        stats.add(sums)
        if due:
            maps.write(iteration, batch, fields)


def fused_old_logprob(ctx: Context) -> bool:
    """``train.fuse_old_logprob``: the first mini-batch of the iteration is updated with the very policy
    that the behaviour pass would run, so its old log-probs are the update forward's own log-probs,
    detached (as verl does on-policy): the same loss and gradient without that forward pass. Later
    mini-batches keep their behaviour pass. Needs one epoch (a second one reads old log-probs of the
    first mini-batch after it was updated) and nothing else from the policy's pass (an algorithm's
    capture or side channels, a value head on the trunk): those are refused naming the field."""
    if not ctx.train.fuse_old_logprob:
        return False
    why = None
    if ctx.knobs.epochs != 1:
        why = f"{ctx.knobs.epochs} epochs (train.epochs, or the algorithm's knobs): needs 1"
    elif ctx.actor.capture is not None:
        why = "this algorithm reads the behaviour pass's forward (its capture)"
    elif ctx.algorithm.side_channels:
        why = f"this algorithm's loss reads side channels made after the behaviour pass {list(ctx.algorithm.side_channels)}"
    elif ctx.actor.with_critic:
        why = "the values of the critic head on the trunk come from the behaviour pass"
    if why is not None:
        raise ValueError(f"train.fuse_old_logprob: {why}; set train.fuse_old_logprob=false")
    return True


def plan_microbatches(ctx: Context, batch: TrainBatch) -> list[list[list[int]]]:
    """One micro-batch plan per iteration, used by the behaviour pass and by every update epoch: padded
    rows filled longest first, or packed streams first-fit decreasing (``train.packing``)."""
    t = ctx.train
    return plan_minibatches(batch.seq_lens.tolist(), num_minibatches=t.num_minibatches,
                            max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                            mode="packed" if ctx.actor.packed_sequences else "padded",
                            pad_to_multiple_of=ctx.seq_multiple)


def microbatch_cut(ctx: Context) -> MicroBatchCut:
    """How this actor's forward reads a mini-batch's rows (``batch/rows.py``): packed streams or padded rows,
    aligned to ``ctx.seq_multiple``, this CP rank's share, one shape under PP."""
    a = ctx.actor
    return MicroBatchCut(packed=a.packed_sequences, multiple=ctx.seq_multiple, pad_id=ctx.pad_id, device=a.device,
                         cp_size=a.cp_size, cp_rank=a.cp_rank, one_shape=a.pp_size > 1)


def behaviour_pass(ctx: Context, batch: TrainBatch, plan, *, skip_first: bool = False) -> None:
    """Recompute ``old_logp`` (and critic ``values``, reference ``ref_logp``) with the update's plan; the
    outputs are copied from the actor's device into the batch (host memory, ``batch.py``).
    ``skip_first`` (``train.fuse_old_logprob``): the policy's pass skips the first mini-batch, whose
    ``old_logp`` the update writes (zeros until then)."""
    actor, critic = ctx.actor, ctx.critic
    cut = microbatch_cut(ctx)
    with_ref = ctx.knobs.kl_coef > 0
    capture = actor.capture.outputs if actor.capture is not None else {}  # read in the same pass
    # (outputs of the pass -> TrainBatch fields or side channels, the model's forward-only run); "aux:"
    # outputs are whole rows already (identical on every CP rank), the others this CP rank's share.
    main = {"logp": "old_logp", "values": "values", **{f"aux:{k}": k for k in capture}}
    passes = [(main, lambda mbs: actor.run(mbs, keep, forward_only=True, capture=bool(capture), count_routing=True))]
    if with_ref:
        passes.append(({"logp": "ref_logp"}, lambda mbs: actor.run(mbs, keep, forward_only=True, reference=True)))
    if critic is not None:  # a separate value model (PPO's critic: separate)
        passes.append(({"values": "values"}, lambda mbs: critic.run(mbs, keep, forward_only=True)))
    shape = batch.loss_mask.shape
    batch.extras = {k: torch.zeros((*shape, *o.trailing), dtype=o.dtype) for k, o in capture.items()}
    for mapping, _ in passes:
        for key, field in mapping.items():
            if not key.startswith("aux:"):
                setattr(batch, field, torch.zeros(shape, dtype=torch.float32))
    target = lambda key, field: batch.extras[field] if key.startswith("aux:") else getattr(batch, field)  # noqa: E731

    def keep(mb, logp, ent, values, aux):
        out = {f"aux:{k}": v for k, v in aux.items()}
        if logp is not None:
            out["logp"] = logp.detach()
        if values is not None:
            out["values"] = values.detach()
        return mb.tensors["loss_mask"].new_zeros((), dtype=torch.float32), out

    copies = RowCopies(actor.cp_group if actor.cp_size > 1 else None)
    for j, mini in enumerate(plan):
        mbs = cut.cut(batch, mini)
        for mapping, run in passes:
            if skip_first and j == 0 and mapping is main:
                continue
            for mb, out in zip(mbs, run(mbs)):
                for key, field in mapping.items():
                    if key in out:
                        full = out[key] if key.startswith("aux:") else None
                        copies.add(target(key, field), mb, out[key], whole=full)
    copies.flush()
    if not (actor.with_critic or critic is not None):
        batch.values = None
    if not actor.last_stage:  # only the last stage computes losses; others never read these
        batch.old_logp = batch.values = batch.ref_logp = None
        batch.extras = {}


def add_behaviour_extras(alg, batch: TrainBatch) -> None:
    """The algorithm's side channels made after the behaviour pass (``Algorithm.behaviour_extras``: a
    per-token weight, ...) into ``batch.extras``, next to its capture's outputs. Refused in one line: a
    name that clashes, one the loss would never see (not in ``side_channels``), and a side channel the
    loss names that nothing made."""
    extras = alg.behaviour_extras(batch)
    clash = sorted(set(extras) & (set(TOKEN_FIELDS) | set(POSITION_FIELDS) | set(batch.extras)))
    if clash:
        raise ValueError(f"behaviour_extras names {clash} clash with TrainBatch fields or the capture's outputs")
    unread = sorted(k for k in extras if k not in alg.side_channels)
    if unread:  # made for the loss, which would never see them (it gets the side channels it names)
        raise ValueError(f"behaviour_extras names {unread}, which {type(alg).__name__}.side_channels "
                         f"{list(alg.side_channels)} does not name")
    batch.extras.update(extras)
    missing = [k for k in alg.side_channels if k not in batch.extras]
    if missing:
        raise ValueError(f"{type(alg).__name__}.side_channels names {missing}, which neither its capture nor "
                         "its behaviour_extras makes")


def compute_advantages(ctx: Context, batch: TrainBatch, iteration: int = 1, stats: "StatSums | None" = None) -> None:
    """The algorithm's side channels made from the behaviour pass (:func:`add_behaviour_extras`), then
    ``batch.advantages`` (and ``returns``) from the algorithm's estimator, with what the algorithm's state
    adds to its inputs from the side channels (``Algorithm.advantage_inputs``, kept in ``batch.extras``
    too). The algorithm's ``advantage_post``: the critic's warm-up (values
    enter the advantages after ``critic_warmup_steps`` iterations), PPO-style whitening over the global
    batch (masked, summed over DP) and the advantage clip. Then the critic kind's diagnostics
    (``Algorithm.critic_stats``)."""
    if batch.old_logp is None:  # not the last pipeline stage
        return
    alg = ctx.algorithm
    add_behaviour_extras(alg, batch)
    mask = batch.loss_mask
    stats = StatSums() if stats is None else stats
    added, added_stats = alg.advantage_inputs(batch.extras, mask, iteration)
    batch.extras.update(added)
    stats.add(added_stats)
    post = alg.advantage_post
    values = batch.values
    if values is not None and iteration <= post.critic_warmup_steps:
        values = torch.zeros_like(values)  # the critic trains on these returns but is not trusted yet
    inputs = AdvantageInputs(response_mask=mask, scores=batch.rewards, group_ids=batch.group_ids,
                             token_rewards=batch.token_rewards() if values is not None else None,
                             values=values, extras=added, obs_mask=batch.obs_mask)
    out = alg.estimate(inputs)  # full sequences on every CP rank: no cp_group needed
    adv = out.advantages.float()
    if post.whiten:
        adv = ctx.whiten(adv, mask)
    if post.clip is not None:
        adv = adv.clamp(-post.clip, post.clip)
    batch.advantages = adv
    batch.returns = None if out.returns is None else out.returns.float()
    if batch.returns is not None:  # the critic kind's own diagnostics (a feature critic's critic/*)
        critic_stats = alg.critic_stats(batch.values, batch.returns, mask)
        stats.add(critic_stats)


def update_minibatch(ctx: Context, batch: TrainBatch, mini: list[list[int]], stats: "StatSums", *,
                      first: bool = False, old_from_update: bool = False) -> None:
    """One optimizer step over one mini-batch: forward-backward of its micro-batches, reduce, clip, step.
    ``first``: the iteration's first mini-batch (its FIPO weights are also logged apart: on-policy, they
    must be exactly 1). ``old_from_update`` (``train.fuse_old_logprob``): the old log-probs are this
    forward's own, detached, and are written into ``batch.old_logp`` after it."""
    alg, section, knobs = ctx.algorithm, ctx.algorithm_section, ctx.knobs
    kl = KL_ESTIMATORS.get(section.kl_estimator) if knobs.kl_coef > 0 else None
    cp_group = ctx.actor.cp_group if ctx.actor.cp_size > 1 else None
    tables = (CORE, *alg.metrics)
    mbs = microbatch_cut(ctx).cut(batch, mini)
    rows = [i for mb in mini for i in mb]
    den = step_denominators(batch.loss_mask[rows], norm_length=ctx.norm_length,
                            device=ctx.actor.device, dp_group=ctx.actor.dp_group)

    fresh = []  # (micro-batch, detached log-probs of this forward): batch.update_logp (and an old_from_update step's)
    if batch.update_logp is None:
        batch.update_logp = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)

    def loss_fn(mb, logp, ent, values, aux):
        fresh.append((mb, logp.detach()))
        # One response per row from here on (the packed stream's row view; padded rows as they are).
        logp, ent, values = mb.rows_view(logp), mb.rows_view(ent), mb.rows_view(values)
        t = {k: mb.rows_view(v, False if v.dtype == torch.bool else 0) for k, v in mb.tensors.items()}
        mask = t["loss_mask"]
        if old_from_update:
            t["old_logp"] = logp.detach()
        is_w, tis = None, {}
        if section.tis_cap is not None:  # engine vs trainer mismatch: min(pi_old / pi_engine, C)
            is_w, tis = truncated_is_weights(t["old_logp"], t["rollout_logp"], mask, cap=section.tis_cap)
        slots = mb.packing.row_slots.to(mask.device) if mb.packed and cp_group else None
        per_tok, m = alg.loss(logp, t["old_logp"], t["advantages"], mask, cp_group=cp_group, is_weights=is_w,
                              row_slots=pass_observations(slots, t.get("obs_mask")),
                              **{k: t[k] for k in alg.side_channels})
        kl_tok = None
        if kl is not None:
            kl_tok = kl(logp, t["ref_logp"])
            per_tok = per_tok + knobs.kl_coef * torch.where(mask, kl_tok, 0.0)
        agg = den.for_rows(mb.whole_loss_mask)
        pg_loss = alg.aggregate(per_tok, mask, **agg)
        loss = pg_loss
        n = mask.sum().float()
        s = {"sum:tokens": n, "sum:pg_loss": pg_loss.detach(),
             "sum:entropy": torch.where(mask, ent, 0.0).sum().detach(),
             "sum:logp_diff": torch.where(mask, (logp - t["old_logp"]).abs(), 0.0).sum().detach()}
        # rank-local statistics -> the sums / extremes the trainer reduces, as the metric tables declare
        s.update(loss_statistics({**m, **tis}, tables, tokens=n, first=first))
        if kl_tok is not None:
            s["sum:kl"] = torch.where(mask, kl_tok, 0.0).sum().detach()
        if values is not None:
            v_loss, v_stats = alg.value_loss(values, t["values"], t["returns"], mask,
                                             global_num_tokens=den.global_num_tokens)
            loss = loss + alg.value_weight * v_loss
            s.update(v_stats)
        return loss, s

    out = ctx.actor.run(mbs, loss_fn, forward_only=False)
    copies = RowCopies(cp_group)
    for mb, lp in fresh:  # as the behaviour pass writes them (the last stage only computes losses)
        copies.add(batch.update_logp, mb, lp)
        if old_from_update:
            copies.add(batch.old_logp, mb, lp)
    copies.flush()
    local = StatSums()
    computed = sum(mb.computed_tokens for mb in mbs)  # padding: what the forward computes past the tokens
    local.add({"sum:computed_tokens": computed, "sum:padding_tokens": computed - int(batch.seq_lens[rows].sum())})
    for s in out:
        local.add(s)
    loss_ok = ctx.all_finite(local.get("sum:pg_loss"))
    norm, applied = ctx.actor.optimizer_step(lr_scale=knobs.lr_scale, loss_finite=loss_ok,
                                             clip=knobs.clip_grad, critic_clip=knobs.critic_clip_grad,
                                             critic_lr_scale=knobs.critic_lr_scale)
    stats.merge(local)
    stats.add({"sum:grad_norm": norm.float(), "sum:opt_steps": torch.tensor(1.0),
               "sum:skipped_steps": torch.tensor(0.0 if applied else 1.0)}, replicated=True)
    if ctx.actor.last_critic_grad_norm is not None:
        stats.add({"sum:critic_grad_norm": ctx.actor.last_critic_grad_norm.float()}, replicated=True)
    if ctx.critic is not None:  # a separate value model: its own forward-backward and optimizer step
        from megatron_credit.trainer.critic_model import critic_step

        def critic_loss_fn(mb, logp, ent, values, aux):
            t = mb.tensors  # the value loss itself (vf_coef weighs it against the policy loss on a shared trunk)
            return alg.value_loss(values, t["values"], t["returns"], t["loss_mask"],
                                  global_num_tokens=den.global_num_tokens)

        critic_step(ctx, mbs, stats, critic_loss_fn)
