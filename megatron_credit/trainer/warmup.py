"""A supervised warm-up of the actor on the synthetic task, through the same megatron actor, cached.

Real runs start from a pretrained base; the CPU demo starts from a tiny random model, which RL cannot
turn into an arithmetic solver in minutes. So the demo first fits the task's answers with a
*systematic misconception*: with probability ``carry_drop_prob`` a label forgets its carries
(``47+38=`` -> ``75``). The warmed-up policy answers confidently and is wrong in a structured way that
per-token credit can fix, which is what RL is for. On the chain task (``data/chain.py``) the labels
instead slip once with probability ``slip_prob`` (one running sum off by one). On the calculator task
(``data/tool_task.py``) a fraction ``tool_prob`` of the traces call the tool and copy its result, the
others answer at once; a trace is tokenized piece by piece as the multi-turn rollout appends it, and the
observation's tokens are out of the loss. On a reasoning-gym task (``data/reasoning_gym_tasks.py``) a fraction
``retry_prob`` of the traces make a wrong first attempt, get the run's environment's answer to it (the
feedback environment's "Wrong: ..."), and answer again. Weights are cached per rank under a key of everything that
determines them, so a second run starts RL at once; with ``warmup.seed`` set, runs that differ only in
``seed`` share one warmed-up policy.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_credit.data.chain import ChainTask
from megatron_credit.data.reasoning_gym_tasks import ReasoningGymTask
from megatron_credit.data.synthetic import ArithmeticTask, carry_dropped_answer
from megatron_credit.data.tool_task import ToolTask
from megatron_credit.batch.train_batch import TrainBatch, make_microbatch, round_up, step_denominators


_NEUTRAL_FIELDS = {"tool_prob": 0.0, "retry_prob": 0.0}
"""Fields of the ``warmup`` section left out of the cache key at these values (:func:`warmup_cache_path`)."""


def warmup_seed(w, seed: int) -> int:
    """The seed of the warm-up ``w`` (the recipe's ``warmup`` section): ``warmup.seed``, or the run's
    ``seed`` when it is None."""
    return seed if w.seed is None else w.seed


def warmup_cache_path(w, *, model, parallel, data, seed: int, rank: int, env=None) -> Path:
    """This rank's cache file of the warm-up ``w``, under a key of everything that determines its result:
    the recipe's ``model``, ``parallel`` and ``data`` sections, ``w`` itself (but where it is cached),
    the warm-up's seed (:func:`warmup_seed` of the run's ``seed``) and, when its traces retry
    (``warmup.retry_prob``), the ``env`` section that answers them. A field of ``w`` at the value that
    leaves the warm-up as it was without it (:data:`_NEUTRAL_FIELDS`) is left out, so adding one does
    not move the cache of an existing recipe."""
    key = {"model": dataclasses.asdict(model), "parallel": dataclasses.asdict(parallel),
           "data": dataclasses.asdict(data),
           "warmup": {k: v for k, v in dataclasses.asdict(w).items()
                      if k not in ("cache_dir", "seed") and not (k in _NEUTRAL_FIELDS and v == _NEUTRAL_FIELDS[k])},
           "seed": warmup_seed(w, seed), "version": 2}
    if w.retry_prob and env is not None:
        key["env"] = dataclasses.asdict(env)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = Path(w.cache_dir or Path.home() / ".cache" / "megatron_credit" / "warmup")
    return root / digest / f"rank_{rank:05d}.pt"


def _response_pieces(task, index: int, rng: random.Random, *, carry_drop_prob: float, slip_prob: float,
                     tool_prob: float, retry_prob: float, env, eos_id: int) -> list[tuple[str | list[int], bool]]:
    """The warm-up response of problem ``index`` as ``(text or token ids, trained)`` pieces, each text
    encoded on its own."""
    if isinstance(task, ReasoningGymTask):
        return task.warmup_turns(index, rng, retry_prob=retry_prob, env=env, eos_id=eos_id)
    if isinstance(task, ChainTask):
        return [(task.warmup_response(index, rng, slip_prob=slip_prob), True)]
    if isinstance(task, ToolTask):
        return task.warmup_turns(index, rng, tool_prob=tool_prob)
    rec = task.record(index)
    answer = rec.ground_truth
    if rng.random() < carry_drop_prob:
        answer = carry_dropped_answer(rec.messages[0].content)
    return [(" " + answer, True)]


def supervised_batch(task: ArithmeticTask | ChainTask | ToolTask | ReasoningGymTask, tokenizer, indices, *,
                     carry_drop_prob: float = 0.0, slip_prob: float = 0.0, tool_prob: float = 0.0,
                     retry_prob: float = 0.0, env=None, seed: int) -> TrainBatch:
    """Prompt + ``" <answer></s>"`` rows (the chain: ``" s1 s2 ... sN</s>"``; the calculator task:
    ``Answer:<answer></s>`` or, with probability ``tool_prob``, ``<call>..</call><result>..</result>
    Answer:<answer></s>``); the loss covers the model's tokens and the stop token, not a tool's
    observation. Each piece is encoded on its own, at the token boundaries of a multi-turn rollout.
    ``carry_drop_prob`` applies to arithmetic, ``slip_prob`` to the chain, ``tool_prob`` to the
    calculator task, ``retry_prob`` (answered by the environment ``env``) to a reasoning-gym task."""
    rng = random.Random(seed)
    rows = []
    for i in indices:
        rec = task.record(i)
        prompt = list(tokenizer.apply_chat_template(rec.chat(), tokenize=True, add_generation_prompt=True))
        row, trained = prompt, [False] * len(prompt)
        for text, train in _response_pieces(task, i, rng, carry_drop_prob=carry_drop_prob, slip_prob=slip_prob,
                                            tool_prob=tool_prob, retry_prob=retry_prob, env=env,
                                            eos_id=tokenizer.eos_token_id):
            piece = tokenizer.encode(text) if isinstance(text, str) else list(text)
            row, trained = row + piece, trained + [train] * len(piece)
        rows.append((row + [tokenizer.eos_token_id], trained + [True]))
    t = max(len(r) for r, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.bool)
    for b, (row, trained) in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row) - 1] = torch.tensor(trained[1:])  # label space: position t scores token t + 1
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad)], dim=1)
    lens = torch.tensor([len(r) for r, _ in rows])
    n = len(rows)
    return TrainBatch(input_ids=ids, labels=labels, loss_mask=mask, rollout_logp=torch.zeros(n, t),
                      seq_lens=lens, group_ids=torch.arange(n), rewards=torch.zeros(n),
                      correct=torch.zeros(n, dtype=torch.bool))


def run_warmup(actor, task: ArithmeticTask | ChainTask | ToolTask | ReasoningGymTask, tokenizer, *, w, model,
               parallel, data, seed: int, dp_rank: int, dp_size: int, seq_multiple: int, env=None, log=print) -> bool:
    """Warm the actor up (or load the cached result); returns whether it came from the cache. ``w``: the
    recipe's ``warmup`` section; ``seed``: the run's; ``model``, ``parallel``, ``data``: the sections the
    result depends on, read for the cache key only (:func:`warmup_cache_path`); ``env``: the recipe's ``env``
    section, whose environment answers the retrying traces (``warmup.retry_prob``).

    With ``warmup.seed`` set the policy is re-initialised from that seed first, so the result is what
    the cache key says whatever the recipe's seed; the value head keeps its recipe-seed initialisation
    (as on a cache hit)."""
    path = warmup_cache_path(w, model=model, parallel=parallel, data=data, seed=seed, rank=dist.get_rank(), env=env)
    seed = warmup_seed(w, seed)
    have = torch.tensor([1.0 if path.exists() else 0.0]).to(actor.device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if float(have) == 1.0:
        missing, unexpected = actor.model.load_state_dict(
            torch.load(path, map_location="cpu", weights_only=True), strict=False)
        assert not unexpected and all(k.startswith("value_head.") for k in missing), (missing, unexpected)
        actor.sync_optimizer_from_model()
        actor.reset_reference()
        return True
    if w.seed is not None:
        actor.load_initial_weights(seed=w.seed)  # the policy only: value_head.* is not touched
    opt = actor.build_optimizer(weight_decay=0.0)  # the run's kind (local / megatron), fresh, no decay
    saved_opt, actor.optimizer = actor.optimizer, opt
    per_rank = w.batch_size // dp_size
    environment = None
    if w.retry_prob and env is not None and env.enabled:
        from megatron_credit.env import build_environment

        environment = build_environment(env.name, env.options)
    try:
        for step in range(w.steps):
            idx = [10_000_000 + (step * w.batch_size) + dp_rank * per_rank + k for k in range(per_rank)]
            batch = supervised_batch(task, tokenizer, idx, carry_drop_prob=w.carry_drop_prob,
                                     slip_prob=w.slip_prob, tool_prob=w.tool_prob, retry_prob=w.retry_prob,
                                     env=environment, seed=seed * 7919 + step * dp_size + dp_rank)
            den = step_denominators(batch.loss_mask, norm_length=1, device=actor.device, dp_group=actor.dp_group)
            seq = round_up(int(batch.seq_lens.max()), seq_multiple)
            mb = make_microbatch(batch, range(batch.size), seq_len=seq, num_rows=batch.size,
                                 pad_id=tokenizer.pad_token_id, device=actor.device, cp_size=actor.cp_size,
                                 cp_rank=actor.cp_rank)

            def loss_fn(mb, logp, ent, values, aux):
                m = mb.tensors["loss_mask"]
                loss = -torch.where(m, logp, 0.0).sum() / den.global_num_tokens
                return loss, {"sum:nll": loss.detach()}

            out = actor.run([mb], loss_fn, forward_only=False)
            actor.optimizer_step(lr=w.lr)
            if (step + 1) % max(1, w.steps // 5) == 0 and out:
                log(f"warm-up step {step + 1}/{w.steps}: nll {float(out[0]['sum:nll']) * dp_size:.3f} (rank-local)")
    finally:
        if environment is not None:
            environment.close()
        actor.optimizer = saved_opt
        actor.sync_optimizer_from_model()
        actor.optimizer_steps = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # The policy only: a critic's value head is not warmed up (and the cache is shared by algorithms).
    actor.gather_params()
    torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in actor.model.state_dict().items()
                if not k.startswith("value_head.")}, tmp)  # host copies: read back with map_location="cpu"
    os.replace(tmp, path)
    dist.barrier()
    return False
