"""One RL iteration (DESIGN.md "Data flow"), with no megatron import.

:func:`rl_iteration` is the whole iteration on one screen; the functions below it are its parts. The
algorithm enters only through ``ctx.spec`` (an ``AlgorithmSpec``: estimator, loss, aggregation) and its
typed ``ctx.params``: nothing here looks at an algorithm's name.
"""
from __future__ import annotations

import torch

from megatron_credit.algorithms import KL_ESTIMATORS, AdvantageInputs
from megatron_credit.data.microbatch import plan_minibatches
from megatron_credit.rollout.mismatch import truncated_is_weights
from megatron_credit.trainer.batch import TrainBatch, make_microbatch, round_up, step_denominators
from megatron_credit.trainer.metrics import StatSums


def rl_iteration(ctx, iteration: int) -> dict[str, float]:
    """Rollout -> rewards -> (dynamic sampling) -> old log-probs -> advantages -> update -> sync."""
    timer = ctx.timer
    with timer("rollout"):
        batch, rollout_metrics = ctx.rollouts.collect(iteration)  # engine + reward pool + dyn. sampling
    ctx.check_length(int(batch.seq_lens.max()))
    plan = plan_microbatches(ctx, batch)
    with timer("old_logprob"):
        behaviour_pass(ctx, batch, plan)  # old_logp (+ values, ref_logp), same micro-batches as the update
    with timer("advantages"):
        compute_advantages(ctx, batch)
    stats = StatSums()
    if batch.old_logp is not None:  # engine vs trainer log-probs of the sampled tokens
        diff = torch.where(batch.loss_mask, (batch.old_logp - batch.rollout_logp).abs(), 0.0)
        stats.add({"sum:mismatch_abs": diff.sum(), "sum:mismatch_tokens": batch.loss_mask.sum()})
    with timer("update"):
        for _epoch in range(ctx.recipe.train.epochs):
            for mini in plan:
                update_minibatch(ctx, batch, mini, stats)
    with timer("sync"):
        ctx.rollouts.sync_weights()
    return {**rollout_metrics, **ctx.reduce_stats(stats)}


# --------------------------------------------------------------------------------------------- parts
def plan_microbatches(ctx, batch: TrainBatch) -> list[list[list[int]]]:
    """One micro-batch plan per iteration, used by the behaviour pass and by every update epoch."""
    t = ctx.recipe.train
    return plan_minibatches(batch.seq_lens.tolist(), num_minibatches=t.num_minibatches,
                            max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                            pad_to_multiple_of=ctx.seq_multiple)


def microbatches(ctx, batch: TrainBatch, mini: list[list[int]]):
    """The micro-batches of one mini-batch, padded to ``ctx.seq_multiple`` (and to one shape with PP)."""
    lens = [round_up(int(max(batch.seq_lens[mb])), ctx.seq_multiple) for mb in mini]
    if ctx.actor.pp_size > 1:  # megatron's pipeline communicates one fixed shape per call
        rows, lens = [max(len(mb) for mb in mini)] * len(mini), [max(lens)] * len(mini)
    else:
        rows = [len(mb) for mb in mini]
    return [make_microbatch(batch, mb, seq_len=s, num_rows=r, pad_id=ctx.pad_id, cp_size=ctx.actor.cp_size,
                            cp_rank=ctx.actor.cp_rank) for mb, s, r in zip(mini, lens, rows)]


def behaviour_pass(ctx, batch: TrainBatch, plan) -> None:
    """Recompute ``old_logp`` (and critic ``values``, reference ``ref_logp``) with the update's plan."""
    actor = ctx.actor
    with_ref = ctx.recipe.algorithm.kl_coef > 0
    # (output of the pass -> TrainBatch field, run on the reference model?)
    passes = [({"logp": "old_logp", "values": "values"}, False)] + ([({"logp": "ref_logp"}, True)] if with_ref else [])
    for mapping, _ in passes:
        for field in mapping.values():
            setattr(batch, field, torch.zeros(batch.loss_mask.shape, dtype=torch.float32))

    def keep(mb, logp, ent, values):
        out = {"logp": logp.detach()}
        if values is not None:
            out["values"] = values.detach()
        return torch.zeros(()), out

    for mini in plan:
        mbs = microbatches(ctx, batch, mini)
        for mapping, reference in passes:
            for mb, out in zip(mbs, actor.run(mbs, keep, forward_only=True, reference=reference)):
                for key, field in mapping.items():
                    if key in out:
                        full = ctx.gather_cp(out[key])[: len(mb.rows)]  # [rows, seq_len]
                        n = min(mb.seq_len, batch.loss_mask.shape[1])  # seq_len may be padded past T
                        getattr(batch, field)[list(mb.rows), :n] = full[:, :n].float()
    if not actor.with_critic:
        batch.values = None
    if not actor.last_stage:  # only the last stage computes losses; others never read these
        batch.old_logp = batch.values = batch.ref_logp = None


def compute_advantages(ctx, batch: TrainBatch) -> None:
    """``batch.advantages`` (and ``returns``) from the algorithm's estimator; PPO-style whitening over
    the global batch (masked, summed over DP) when the parameters ask for it."""
    if batch.old_logp is None:  # not the last pipeline stage
        return
    inputs = AdvantageInputs(response_mask=batch.loss_mask, scores=batch.rewards, group_ids=batch.group_ids,
                             token_rewards=batch.token_rewards() if ctx.actor.with_critic else None,
                             values=batch.values)
    out = ctx.spec.estimate(inputs, ctx.params)  # full sequences on every CP rank: no cp_group needed
    adv = out.advantages.float()
    if getattr(ctx.params, "whiten_advantages", False):
        adv = ctx.whiten(adv, batch.loss_mask)
    batch.advantages = adv
    batch.returns = None if out.returns is None else out.returns.float()


def update_minibatch(ctx, batch: TrainBatch, mini: list[list[int]], stats: "StatSums") -> None:
    """One optimizer step over one mini-batch: forward-backward of its micro-batches, reduce, clip, step."""
    rows = [i for mb in mini for i in mb]
    den = step_denominators(batch.loss_mask[rows], norm_length=ctx.recipe.rollout.max_response_len,
                            dp_group=ctx.actor.dp_group)
    alg = ctx.recipe.algorithm
    kl = KL_ESTIMATORS.get(alg.kl_estimator) if alg.kl_coef > 0 else None
    cp_group = ctx.actor.cp_group if ctx.actor.cp_size > 1 else None

    def loss_fn(mb, logp, ent, values):
        t, mask = mb.tensors, mb.tensors["loss_mask"]
        is_w = None
        if alg.tis_cap is not None:  # engine vs trainer mismatch: min(pi_old / pi_engine, C)
            is_w, _ = truncated_is_weights(t["old_logp"], t["rollout_logp"], mask, cap=alg.tis_cap)
        per_tok, m = ctx.spec.loss(logp, t["old_logp"], t["advantages"], mask, ctx.params,
                                   cp_group=cp_group, is_weights=is_w)
        kl_tok = None
        if kl is not None:
            kl_tok = kl(logp, t["ref_logp"])
            per_tok = per_tok + alg.kl_coef * torch.where(mask, kl_tok, 0.0)
        agg = den.for_rows(mb.whole_loss_mask)
        pg_loss = ctx.spec.aggregate(per_tok, mask, **agg)
        loss = pg_loss
        n = mask.sum().float()
        s = {"sum:tokens": n, "sum:pg_loss": pg_loss.detach(),
             "sum:entropy": torch.where(mask, ent, 0.0).sum().detach(),
             "sum:logp_diff": torch.where(mask, (logp - t["old_logp"]).abs(), 0.0).sum().detach()}
        for k, v in m.items():  # rank-local means over valid tokens -> token-weighted sums
            if k.endswith(("/min", "/max")):
                s[("min:" if k.endswith("/min") else "max:") + k] = torch.where(n > 0, v, torch.nan)
            elif not k.endswith(("/p10", "/p50", "/p90")):
                s["sum:" + k] = torch.nan_to_num(v) * n
        if kl_tok is not None:
            s["sum:kl"] = torch.where(mask, kl_tok, 0.0).sum().detach()
        if values is not None:
            v_loss, v_stats = value_loss(values, t["values"], t["returns"], mask, den, ctx.params)
            loss = loss + ctx.params.vf_coef * v_loss
            s.update(v_stats)
        return loss, s

    out = ctx.actor.run(microbatches(ctx, batch, mini), loss_fn, forward_only=False)
    local = StatSums()
    for s in out:
        local.add(s)
    loss_ok = ctx.all_finite(local.get("sum:pg_loss"))
    norm, applied = ctx.actor.optimizer_step(lr=ctx.lr(), loss_finite=loss_ok)
    stats.merge(local)
    stats.add({"sum:grad_norm": norm.float(), "sum:opt_steps": torch.tensor(1.0),
               "sum:skipped_steps": torch.tensor(0.0 if applied else 1.0)}, replicated=True)


def value_loss(values, old_values, returns, mask, den, params):
    """Clipped value loss ``0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``, token-mean over the
    step's global token count; stats for ``critic/value_loss`` and ``critic/explained_var``."""
    from megatron_credit.losses.aggregation import aggregate_loss

    err = (values - returns) ** 2
    if params.value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-params.value_clip, params.value_clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    loss = 0.5 * aggregate_loss(err, mask, mode="token-mean", global_num_tokens=den.global_num_tokens)
    r = torch.where(mask, returns, 0.0)
    resid = torch.where(mask, returns - old_values, 0.0)
    return loss, {"sum:value_loss": loss.detach(), "sum:ret": r.sum(), "sum:ret2": (r * r).sum(),
                  "sum:resid": resid.sum(), "sum:resid2": (resid * resid).sum()}
