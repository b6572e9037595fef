"""Rollouts of one data-parallel replica: the engine, the reward pool, dynamic sampling, the broadcast.

One engine per DP replica, on the replica's first rank (TP = PP = CP rank 0, the "source"); the
samples and their rewards are broadcast to the other ranks of the replica, which train on the same
rows. Weight sync streams the actor's HF-named buckets (collective over TP and PP) into the engine.
Sampling seeds depend only on ``(seed, iteration, draw, dp_rank)``, so a resumed run samples exactly
what the uninterrupted run would have.
"""
from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from megatron_credit.rollout.types import FinishStatus, RolloutBatch, SamplingParams
from megatron_credit.trainer.batch import TrainBatch, train_batch_from_rollout

if TYPE_CHECKING:
    from megatron_credit.training_config import RewardConfig, RolloutConfig


POOL_COUNTS = ("reward_pool/items", "reward_pool/timeouts", "reward_pool/errors", "reward_pool/restarts",
               "reward_pool/seconds")
"""The reward pool's counts logged per iteration (``ScoredBatch.metrics`` of every draw, summed)."""


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class RolloutManager:
    """Collects each iteration's :class:`TrainBatch` for this rank (see module docstring)."""

    def __init__(self, *, rollout: RolloutConfig, reward: RewardConfig, engine_factory: Callable[[], Any],
                 seed: int, max_draws: int, dynamic_sampling: bool, val_samples: int, tokenizer, prompts,
                 val_prompts, actor, replica_group, replica_src: int, dp_rank: int, dp_size: int, log=print):
        """The recipe's ``rollout`` and ``reward`` sections; ``engine_factory()`` builds the rollout engine
        (on the replica's source rank only: ``rollout.engine.build_trainer_engine``); ``seed`` (the run's),
        ``max_draws`` and ``dynamic_sampling`` (``algorithm.*``: DAPO's dynamic sampling), ``val_samples``
        (``train.val_samples``: k of the validation's Avg@k)."""
        self.rollout, self.reward = rollout, reward
        self.seed, self.max_draws, self.dynamic_sampling, self.val_samples = seed, max_draws, dynamic_sampling, val_samples
        self.tokenizer, self.prompts, self.val_prompts = tokenizer, prompts, val_prompts
        self.actor, self.group, self.src = actor, replica_group, replica_src
        self.dp_rank, self.dp_size, self.log = dp_rank, dp_size, log
        self.is_src = dist.get_rank() == replica_src
        self.engine = self.pool = None
        if self.is_src:
            self.engine = engine_factory()
            if reward.num_workers > 0:
                from megatron_credit.rewards.pool import RewardPool, RewardPoolConfig

                self.pool = RewardPool(RewardPoolConfig(num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                                                        batch_timeout_s=reward.batch_timeout_s))
        self.prompts_per_rank = rollout.prompts_per_step // dp_size
        self.stop_ids = tuple(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.engine is not None:
            self.engine.close()

    def sync_weights(self) -> None:
        """Actor -> engine (every rank takes part in the TP / PP gathers). Engines accept weights while
        asleep (the colocated order: sleep, train, sync, wake up)."""
        buckets = self.actor.hf_weight_buckets()
        if self.engine is not None:
            self.engine.update_weights(buckets)
        else:
            for _ in buckets:
                pass

    def sleep(self) -> None:
        """Release the engine's accelerator memory while the actor trains (a no-op on CPU)."""
        if self.engine is not None:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def _params(self, n: int, seed: int) -> SamplingParams:
        r = self.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_response_len, stop_token_ids=self.stop_ids, n=n, seed=seed)

    def _generate_and_score(self, records, n: int, seed: int):
        """On the source rank: samples and their shaped rewards."""
        from megatron_credit.rewards.compute import score_responses
        from megatron_credit.rewards.shaping import ShapingConfig

        rollout = self.engine.generate([list(rec.prompt_ids) for rec in records], self._params(n, seed))
        texts = [self.tokenizer.decode(s.response_ids) for s in rollout.samples]
        rec_of = [records[i // n] for i in range(len(rollout.samples))]
        rw = self.reward
        scored = score_responses(
            self.pool, responses=texts, ground_truths=[r.ground_truth for r in rec_of],
            data_sources=[r.data_source for r in rec_of],
            response_lens=torch.tensor([len(s.response_ids) for s in rollout.samples]),
            shaping=ShapingConfig(max_response_len=self.rollout.max_response_len,
                                  overlong_buffer_len=rw.overlong_buffer_len,
                                  overlong_penalty_factor=rw.overlong_penalty_factor))
        pool = {k: float(v) for k, v in scored.metrics.items() if k in POOL_COUNTS}
        return rollout, scored.rewards, scored.correct, pool

    def collect(self, iteration: int) -> tuple[TrainBatch, dict[str, float]]:
        """This iteration's rows: ``prompts_per_rank`` groups of ``n`` (dynamic sampling: mixed groups)."""
        r = self.rollout
        payload = None
        if self.is_src:
            self.wake_up()
            kept, draws, drawn_groups, t0 = [], 0, 0, time.perf_counter()
            pool_sums = dict.fromkeys(POOL_COUNTS, 0.0) if self.pool is not None else {}
            while len(kept) < self.prompts_per_rank:
                if draws == self.max_draws:
                    break
                records = self.prompts.take(self.prompts_per_rank)
                rollout, rewards, correct, pool = self._generate_and_score(
                    records, r.n, _seed(self.seed, iteration, draws, self.dp_rank))
                for k, v in pool.items():
                    pool_sums[k] += v
                draws += 1
                drawn_groups += len(records)
                for g in range(len(records)):
                    sl = slice(g * r.n, (g + 1) * r.n)
                    if self.dynamic_sampling and bool(correct[sl].all() | ~correct[sl].any()):
                        continue  # DAPO: a group whose accuracy does not vary carries no signal
                    kept.append((rollout.samples[sl], rewards[sl], correct[sl]))
            payload = (kept[: self.prompts_per_rank], draws, drawn_groups, time.perf_counter() - t0, pool_sums)
            self.sleep()  # the actor trains next
        payload = self._broadcast(payload)
        kept, draws, drawn_groups, wall, pool_sums = payload
        short = torch.tensor([float(len(kept) < self.prompts_per_rank)]).to(self.actor.device)
        dist.all_reduce(short)
        if float(short) > 0:
            raise ValueError(  # the recipe's to fix: one error line (issue 24), not a traceback
                f"dynamic sampling: fewer than rollout.prompts_per_step/DP = {self.prompts_per_rank} groups "
                f"with mixed accuracy after algorithm.max_draws={self.max_draws} draws on some data-parallel "
                "rank; raise algorithm.max_draws, or turn algorithm.dynamic_sampling off")
        samples = []
        for g, (ss, _, _) in enumerate(kept):
            for s in ss:
                s.group_id = g
                samples.append(s)
        padded = RolloutBatch(samples=samples).to_padded(pad_token_id=self.tokenizer.pad_token_id)
        batch = train_batch_from_rollout(padded, rewards=torch.cat([k[1] for k in kept]),
                                         correct=torch.cat([k[2] for k in kept]),
                                         pad_id=self.tokenizer.pad_token_id)
        status = padded.status
        metrics = self._dp_mean({
            "reward/mean": batch.rewards.mean(), "accuracy/mean": batch.correct.float().mean(),
            "response_length/mean": padded.response_lens.float().mean(),
            "response/truncated_frac": (status == int(FinishStatus.TRUNCATED)).float().mean(),
            "rollout/draws": torch.tensor(float(draws)),
            "rollout/kept_group_frac": torch.tensor(len(kept) / max(drawn_groups, 1)),
            "time/rollout_engine_s": torch.tensor(wall)})
        metrics["rollout/tokens"] = self._dp_sum(batch.seq_lens.sum().float())
        metrics.update(self._pool_metrics(pool_sums, iteration))
        return batch, metrics

    def _pool_metrics(self, sums: dict[str, float], iteration: int) -> dict[str, float]:
        """``reward_pool/*`` of the iteration, summed over its draws and the data-parallel ranks
        (``seconds``: the mean over ranks); a warning line when more than a tenth of the items timed out."""
        if not sums:
            return {}
        out = {k: v * (1 if k == "reward_pool/seconds" else self.dp_size)
               for k, v in self._dp_mean({k: torch.tensor(v) for k, v in sums.items()}).items()}
        if out["reward_pool/timeouts"] > 0.1 * max(out["reward_pool/items"], 1.0):
            self.log(f"warning: iteration {iteration}: {out['reward_pool/timeouts']:.0f} of "
                     f"{out['reward_pool/items']:.0f} responses timed out in the reward pool (scored as incorrect; "
                     "reward.timeout_s / reward.batch_timeout_s)")
        return out

    def validate(self, iteration: int) -> dict[str, float]:
        """Avg@k (``val/accuracy``), Cons@k and Pass@k on the held-out prompts, sampled at the rollout
        temperature with k = ``train.val_samples``, over all DP ranks (``megatron_credit.evaluation``, the
        code of ``tools/evaluate.py``)."""
        from megatron_credit.evaluation import means_from_sums, metric_sums, sample_and_grade

        if self.val_prompts is None:
            return {}
        k = self.val_samples
        names = (f"avg@{k}", f"cons@{k}", f"pass@{k}", "num_problems")
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.actor.device)
        if self.is_src:
            self.wake_up()
            problems = sample_and_grade(self.engine, self.tokenizer, self.val_prompts, k=k, pool=self.pool,
                                        sampling=self._params(k, _seed(self.seed, -1, self.dp_rank)))
            per_rank = metric_sums(problems, k=k)
            sums += torch.tensor([per_rank[name] for name in names], dtype=torch.float64).to(sums.device)
            self.sleep()
        dist.all_reduce(sums)  # only source ranks contribute
        means = means_from_sums(dict(zip(names, sums.tolist())))
        return {"val/accuracy": means[f"avg@{k}"], f"val/cons@{k}": means[f"cons@{k}"],
                f"val/pass@{k}": means[f"pass@{k}"]}

    # -- collectives ---------------------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return obj
        box = [obj]
        # the pickled samples travel as a byte tensor on this rank's device (NCCL: a CUDA tensor)
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.actor.device)
        return box[0]

    def _dp_mean(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        keys = sorted(values)
        vec = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).to(self.actor.device) for k in keys])
        if self.dp_size > 1:
            dist.all_reduce(vec, group=self.actor.dp_group)
        return {k: float(v) / self.dp_size for k, v in zip(keys, vec)}

    def _dp_sum(self, value: torch.Tensor) -> float:
        v = torch.as_tensor(value, dtype=torch.float64).reshape(1).clone().to(self.actor.device)
        if self.dp_size > 1:
            dist.all_reduce(v, group=self.actor.dp_group)
        return float(v)
