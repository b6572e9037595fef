"""Rollouts of the whole job: the engines, the reward pools, dynamic sampling, the samples to the trainers.
This module is ``rollout.mode: sync`` (:class:`RolloutManager`) and what every mode shares
(:class:`SampleRouter`, :func:`generate_and_score`); ``trainer/async_rollout.py`` is the other two.

Every GPU generates (``rollout.placement``): world size / rollout TP engines, engine ``e`` built by rank
``e * rollout_tp`` on the GPUs of its ``rollout_tp`` ranks, whatever the trainer's TP / PP / CP / DP.
Each draw takes ``rollout.prompts_per_step`` prompts from the job's one stream; each engine samples and
scores its contiguous slice, with seeds from (run seed, iteration, draw) and each prompt's index in the
draw, so the samples do not depend on the number of engines or ranks. Whether each group's accuracy
varies (DAPO's dynamic sampling) is all-gathered, every rank takes the same decisions, and the kept
groups go, in order, to the data-parallel ranks that train them (``prompts_per_step / DP`` each, to every
TP / PP / CP rank of that replica) in one all-to-all of the pickled samples.

Around each generation phase (the iteration's rollout, validation) the trainer gives the engine its
memory: the optimizer states go to the host and the gradient buffers are released
(``trainer.offload``), the engine wakes its weights, receives the current ones (HF-named buckets of
whole layers, gathered over TP and PP on every rank: ``Actor.hf_weight_buckets``), wakes its KV cache,
generates and sleeps; then the trainer takes its memory back. A resumed run samples exactly what the
uninterrupted run would have.
"""
from __future__ import annotations

import contextlib
import pickle
import time
from typing import Any, Callable, Protocol, TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_credit.rollout.placement import EngineLayout, dp_rank_of_group, draw_seed, split
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, SamplingParams
from megatron_credit.batch.train_batch import TrainBatch, train_batch_from_rollout

if TYPE_CHECKING:
    from megatron_credit.trainer.offload import GenerationOffload
    from megatron_credit.recipe.sections import RewardConfig, RolloutConfig


POOL_COUNTS = ("reward_pool/items", "reward_pool/timeouts", "reward_pool/errors", "reward_pool/restarts",
               "reward_pool/seconds")
"""The reward pools' counts logged per iteration (``ScoredBatch.metrics`` of every draw, summed)."""


def sampling_params(rollout: RolloutConfig, stop_ids: tuple[int, ...], *, n: int, seed: int) -> SamplingParams:
    """The engine's sampling parameters of one draw: the recipe's ``rollout`` section, ``n`` per prompt."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_response_len, stop_token_ids=stop_ids, n=n, seed=seed)


def group_varies(correct: torch.Tensor) -> bool:
    """Whether a group's verdicts differ (DAPO's dynamic sampling keeps only those)."""
    return bool(correct.any() & ~correct.all())


def generate_and_score(engine, pool, tokenizer, records, params: SamplingParams, *, rollout: RolloutConfig,
                       reward: RewardConfig, first_group: int):
    """Sample ``params.n`` responses to each prompt record and score them: ``(RolloutBatch, shaped rewards,
    verdicts, the pool's counts)``; prompt ``i`` of ``records`` is prompt ``first_group + i`` of the draw
    (its samples' seeds)."""
    from megatron_credit.rewards.compute import score_responses
    from megatron_credit.rewards.shaping import ShapingConfig

    n = params.n
    batch = engine.generate([list(rec.prompt_ids) for rec in records], params,
                            group_ids=range(first_group, first_group + len(records)))
    texts = [tokenizer.decode(s.response_ids) for s in batch.samples]
    rec_of = [records[i // n] for i in range(len(batch.samples))]
    scored = score_responses(
        pool, responses=texts, ground_truths=[r.ground_truth for r in rec_of],
        data_sources=[r.data_source for r in rec_of],
        response_lens=torch.tensor([len(s.response_ids) for s in batch.samples]),
        shaping=ShapingConfig(max_response_len=rollout.max_response_len,
                              overlong_buffer_len=reward.overlong_buffer_len,
                              overlong_penalty_factor=reward.overlong_penalty_factor))
    counts = {k: float(v) for k, v in scored.metrics.items() if k in POOL_COUNTS}
    return batch, scored.rewards, scored.correct, counts


class RolloutSource(Protocol):
    """Where the trainer's batches come from: ``next(step)`` returns this rank's :class:`TrainBatch` of
    iteration ``step`` (each row tagged with the ``policy_version`` that generated it) and the rollout's
    metrics; ``validate`` and ``close`` as the loop calls them. :class:`RolloutManager` (colocated, synchronous:
    generate, then train) is one."""

    def next(self, step: int) -> tuple[TrainBatch, dict[str, float]]: ...

    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics of the current policy (``val/*``)."""

    def close(self) -> None:
        """Release the engines and worker processes."""


class SampleRouter:
    """What every rollout source does with scored groups: route them to the ranks that train them, make
    this rank's :class:`TrainBatch` and the rollout's metrics. The subclass sets ``rollout``, ``reward``,
    ``tokenizer``, ``actor``, ``dp_of_rank``, ``dp_size``, ``staleness_bound`` (the most versions a trained
    sample may lag), ``last_sync`` and ``log``."""

    def _assemble(self, rows: list, versions: list[int], iteration: int, *, draws: int, kept: int, wall: float,
                  engines: int, pool_sums: dict[str, float], partial: int = 0) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's :class:`TrainBatch` from its groups ``rows`` (samples, rewards, correct) and each
        group's policy version, with the rollout's metrics: staleness against the ``iteration - 1``
        versions of the weights that train it, the draws of the batch and its generation wall time."""
        samples, row_versions = [], []
        for g, ((ss, _, _), v) in enumerate(zip(rows, versions)):
            for s in ss:
                s.group_id = g
                samples.append(s)
                row_versions.append(v)
        padded = RolloutBatch(samples=samples).to_padded(pad_token_id=self.tokenizer.pad_token_id)
        batch = train_batch_from_rollout(padded, rewards=torch.cat([k[1] for k in rows]),
                                         correct=torch.cat([k[2] for k in rows]),
                                         pad_id=self.tokenizer.pad_token_id,
                                         policy_version=torch.tensor(row_versions, dtype=torch.int64))
        status = padded.status
        staleness = (iteration - 1) - batch.policy_version
        metrics = self._dp_mean({
            "reward/mean": batch.rewards.mean(), "accuracy/mean": batch.correct.float().mean(),
            "response_length/mean": padded.response_lens.float().mean(),
            "response/truncated_frac": (status == int(FinishStatus.TRUNCATED)).float().mean(),
            "rollout/staleness_mean": staleness.double().mean(), "time/rollout_engine_s": torch.tensor(wall)})
        bound = self.staleness_bound
        counts = torch.stack([(staleness == s).sum() for s in range(bound + 1)]).double().to(self.actor.device)
        worst = staleness.max().double().reshape(1).to(self.actor.device)
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.actor.dp_group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.actor.dp_group)
        metrics.update({f"rollout/staleness_hist/{s}": float(counts[s]) for s in range(bound + 1)})
        metrics["rollout/staleness_max"] = float(worst)
        metrics.update({"rollout/draws": float(draws), "rollout/kept_group_frac": kept / (draws * self.rollout.prompts_per_step),
                        "rollout/engines": float(engines), "rollout/partial_draws": float(partial), **self.last_sync})
        metrics["rollout/tokens"] = self._dp_sum(batch.seq_lens.sum().float())
        metrics.update(self._pool_metrics(pool_sums, iteration, engines=engines))
        return batch, metrics

    def _val_metrics(self, sums: dict[str, float] | None, k: int) -> dict[str, float]:
        """``val/*`` from the ``evaluation.metric_sums`` of the ranks that sampled (None on the others),
        summed over every rank."""
        from megatron_credit.rewards.evaluation import means_from_sums

        names = (f"avg@{k}", f"cons@{k}", f"pass@{k}", "num_problems")
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.actor.device)
        if sums is not None:
            vec += torch.tensor([sums[name] for name in names], dtype=torch.float64).to(vec.device)
        dist.all_reduce(vec)
        means = means_from_sums(dict(zip(names, vec.tolist())))
        return {"val/accuracy": means[f"avg@{k}"], f"val/cons@{k}": means[f"cons@{k}"],
                f"val/pass@{k}": means[f"pass@{k}"]}

    def _route(self, kept: list[tuple[int, int]], held: dict) -> list[Any]:
        """The kept groups to the ranks that train them: group ``k`` to every rank of data-parallel rank
        ``dp_rank_of_group(k)``, from the engine leader that holds it. Returns this rank's groups in order."""
        world = len(self.dp_of_rank)
        send: list[list[Any]] = [[] for _ in range(world)]
        for k, key in enumerate(kept):
            if key in held:
                dp = dp_rank_of_group(k, groups=len(kept), dp_size=self.dp_size)
                for q in range(world):
                    if self.dp_of_rank[q] == dp:
                        send[q].append((k, held[key]))
        got = sorted((item for part in self._exchange(send) for item in part), key=lambda item: item[0])
        assert len(got) == len(kept) // self.dp_size, "each data-parallel rank gets prompts_per_step / DP groups"
        return [group for _, group in got]

    def _pool_metrics(self, sums: dict[str, float], iteration: int, *, engines: int) -> dict[str, float]:
        """``reward_pool/*`` of the iteration, summed over its draws and the engines' pools (``seconds``: the
        mean over the pools); a warning line when more than a tenth of the items timed out."""
        if self.reward.num_workers == 0:
            return {}
        keys = POOL_COUNTS
        vec = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64).to(self.actor.device)
        dist.all_reduce(vec)  # only engine leaders hold a pool
        out = dict(zip(keys, vec.tolist()))
        out["reward_pool/seconds"] /= engines
        if out["reward_pool/timeouts"] > 0.1 * max(out["reward_pool/items"], 1.0):
            self.log(f"warning: iteration {iteration}: {out['reward_pool/timeouts']:.0f} of "
                     f"{out['reward_pool/items']:.0f} responses timed out in the reward pool (scored as incorrect; "
                     "reward.timeout_s / reward.batch_timeout_s)")
        return out

    # -- collectives ---------------------------------------------------------------------------------
    def _all_gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank (small objects: NCCL moves them through this rank's device)."""
        out = [None] * len(self.dp_of_rank)
        dist.all_gather_object(out, obj)
        return out

    def _exchange(self, send: list[Any]) -> list[Any]:
        """All-to-all of picklable objects: ``send[q]`` goes to rank ``q``; returns what every rank sent
        here. The pickles travel as one byte tensor on this rank's device (NCCL: a CUDA tensor)."""
        if len(send) == 1:
            return send
        blobs = [pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in send]
        device = self.actor.device
        sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64).to(device)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes)
        recv = got.tolist()
        out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
        payload = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).to(device)
        dist.all_to_all_single(out, payload, output_split_sizes=recv, input_split_sizes=[len(b) for b in blobs])
        data = out.cpu().numpy().tobytes()
        parts, at = [], 0
        for size in recv:
            parts.append(pickle.loads(data[at:at + size]))  # noqa: S301  (this job's own ranks)
            at += size
        return parts

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


class RolloutManager(SampleRouter):
    """Generates each iteration's :class:`TrainBatch` for this rank (see module docstring): a colocated,
    synchronous :class:`RolloutSource`."""

    staleness_bound = 0

    def __init__(self, *, rollout: RolloutConfig, reward: RewardConfig, engine_factory: Callable[..., Any],
                 seed: int, max_draws: int, dynamic_sampling: bool, val_samples: int, tokenizer, prompts,
                 val_prompts, actor, layout: EngineLayout, local_rank: int, dp_of_rank: list[int],
                 offload: GenerationOffload, group_timeout_s: float, log=print):
        """The recipe's ``rollout`` and ``reward`` sections; ``engine_factory(gpus=...)`` builds the rollout
        engine (on engine leaders only: ``rollout.engine.build_trainer_engine``); ``seed`` (the run's),
        ``max_draws`` and ``dynamic_sampling`` (``algorithm.*``: DAPO's dynamic sampling), ``val_samples``
        (``train.val_samples``: k of the validation's Avg@k); ``layout``: the engines; ``local_rank``: this
        rank's device index on its node; ``dp_of_rank``: the data-parallel rank of every global rank;
        ``offload``: what the trainer gives up while engines generate; ``group_timeout_s``: the timeout of
        the engines' own process groups (``distributed.timeout_s``)."""
        self.rollout, self.reward = rollout, reward
        self.seed, self.max_draws, self.dynamic_sampling, self.val_samples = seed, max_draws, dynamic_sampling, val_samples
        self.tokenizer, self.prompts, self.val_prompts = tokenizer, prompts, val_prompts
        self.actor, self.layout, self.offload, self.log = actor, layout, offload, log
        self.rank = dist.get_rank()
        self.dp_of_rank = list(dp_of_rank)
        self.dp_rank, self.dp_size = self.dp_of_rank[self.rank], max(self.dp_of_rank) + 1
        self.engine_index = layout.engine_of(self.rank)
        self.engine = self.pool = None
        if layout.is_leader(self.rank):
            self.engine = engine_factory(gpus=layout.gpus(rank=self.rank, local_rank=local_rank))
            if reward.num_workers > 0:
                from megatron_credit.rewards.pool import RewardPool, RewardPoolConfig

                self.pool = RewardPool(RewardPoolConfig(num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                                                        batch_timeout_s=reward.batch_timeout_s))
        self.stop_ids = tuple(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None)
        self.last_sync: dict[str, float] = {}
        self.peers = self._peer_buckets(group_timeout_s)

    def _peer_buckets(self, timeout_s: float):
        """The :class:`~megatron_credit.rollout.weight_sync.PeerBuckets` of this rank's engine when it takes
        each bucket from every rank of its GPUs (vLLM's CUDA IPC at rollout TP > 1), else None. Every rank
        makes every engine's group, in the same order, when any engine asks for it."""
        import datetime

        from megatron_credit.rollout.engine import ROLLOUT_ENGINES
        from megatron_credit.rollout.weight_sync import PeerBuckets

        wants = self._all_gather(bool(getattr(self.engine, "peer_transfer", False)))
        if not any(wants):
            return None
        stage = ROLLOUT_ENGINES.get(self.rollout.engine).stage_peer_bucket
        mine = None
        for e in range(self.layout.num_engines):
            leader = self.layout.leader(e)
            group = dist.new_group(list(range(leader, leader + self.layout.rollout_tp)),
                                   timeout=datetime.timedelta(seconds=timeout_s))
            if e == self.engine_index and wants[leader]:
                mine = PeerBuckets(group, leader, stage)
        return mine

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.engine is not None:
            self.engine.close()

    # -- the generation phase ------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Actor -> engine: every rank takes part in the TP / PP gathers; engine leaders load the buckets
        into their awake engine. Sets ``sync/bytes`` (what one engine received) and ``sync/seconds``."""
        t0, nbytes = time.perf_counter(), 0

        def counted(buckets):
            nonlocal nbytes
            for bucket in buckets:
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        stream = counted(self.actor.hf_weight_buckets())
        if self.engine is not None:
            self.engine.update_weights(stream, **({"peers": self.peers} if self.peers is not None else {}))
        elif self.peers is not None:  # this rank's GPU serves a worker of the engine: its copy of each bucket
            self.peers.follow(stream, self.actor.device)
        else:
            for _ in stream:
                pass
        self.last_sync = {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def generating(self):
        """The memory order of a generation phase: offload (optimizer states to the host, gradient buffers
        released, the allocator's cache emptied), wake the engine's weights, sync them, wake its KV cache;
        afterwards the engine sleeps (dropping what the next sync overwrites) and the trainer restores its
        states before it trains."""
        self.offload.offload()
        try:
            if self.engine is not None:
                self.engine.wake_up(["weights"])
            self.sync_weights()
            if self.engine is not None:
                self.engine.wake_up(["kv_cache"])
            yield
        finally:
            if self.engine is not None:
                self.engine.sleep()
            self.offload.restore()

    def _params(self, n: int, seed: int) -> SamplingParams:
        return sampling_params(self.rollout, self.stop_ids, n=n, seed=seed)

    def _my_prompts(self, count: int) -> range:
        """This engine's slice of ``count`` prompts (empty on ranks that lead no engine)."""
        if self.engine is None:
            return range(0)
        return split(count, self.layout.num_engines)[self.engine_index]

    def _generate_and_score(self, records, n: int, seed: int, *, first_group: int):
        return generate_and_score(self.engine, self.pool, self.tokenizer, records, self._params(n, seed),
                                  rollout=self.rollout, reward=self.reward, first_group=first_group)

    def _draw(self, iteration: int, draw: int, held: dict, pool_sums: dict) -> list[bool]:
        """One draw of ``prompts_per_step`` prompts over all engines; this engine's groups go to ``held``
        (keyed ``(draw, prompt)``). Returns, for every prompt of the draw, whether the group counts
        (dynamic sampling: its accuracy varies), the same list on every rank."""
        n, count = self.rollout.n, self.rollout.prompts_per_step
        records = self.prompts.take(count)
        mine = self._my_prompts(count)
        varies: dict[int, bool] = {}
        if len(mine):
            rollout, rewards, correct, pool = self._generate_and_score(
                [records[i] for i in mine], n, draw_seed(self.seed, iteration, draw), first_group=mine.start)
            for k, v in pool.items():
                pool_sums[k] = pool_sums.get(k, 0.0) + v
            for j, p in enumerate(mine):
                sl = slice(j * n, (j + 1) * n)
                held[(draw, p)] = (rollout.samples[sl], rewards[sl], correct[sl])
                varies[p] = group_varies(correct[sl])
        merged: dict[int, bool] = {}
        for part in self._all_gather(varies):
            merged.update(part)
        assert sorted(merged) == list(range(count)), "every prompt of a draw is sampled by exactly one engine"
        return [merged[p] or not self.dynamic_sampling for p in range(count)]

    def next(self, iteration: int) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's rows: ``prompts_per_step / DP`` groups of ``n`` (dynamic sampling: mixed groups),
        generated by the weights of ``iteration - 1`` completed iterations (their ``policy_version``)."""
        count = self.rollout.prompts_per_step
        held: dict[tuple[int, int], Any] = {}
        kept: list[tuple[int, int]] = []
        pool_sums: dict[str, float] = {}
        draws = 0
        t_wait = time.perf_counter()  # the trainer waits for the whole phase: nothing of it is hidden
        with self.generating():
            t0 = time.perf_counter()
            while len(kept) < count and draws < self.max_draws:
                counts = self._draw(iteration, draws, held, pool_sums)
                kept += [(draws, p) for p in range(count) if counts[p]]
                draws += 1
            wall = time.perf_counter() - t0
        if len(kept) < count:
            raise ValueError(  # the recipe's to fix: one error line, not a traceback
                f"dynamic sampling: fewer than rollout.prompts_per_step = {count} groups with mixed accuracy "
                f"after algorithm.max_draws={self.max_draws} draws ({len(kept)} kept); raise algorithm.max_draws, "
                "or turn algorithm.dynamic_sampling off")
        rows = self._route(kept[:count], held)
        batch, metrics = self._assemble(rows, [iteration - 1] * len(rows), iteration, draws=draws, kept=len(kept),
                                        wall=wall, engines=self.layout.num_engines, pool_sums=pool_sums)
        metrics.update({"time/rollout_wait_s": time.perf_counter() - t_wait, "time/rollout_hidden_frac": 0.0})
        return batch, metrics

    def validate(self, iteration: int) -> dict[str, float]:
        """Avg@k (``val/accuracy``), Cons@k and Pass@k on the held-out prompts, sampled at the rollout
        temperature with k = ``train.val_samples``, each engine its slice of the prompts, with the same seeds
        whatever the engine count (``megatron_credit.rewards.evaluation``, the code of ``tools/evaluate.py``)."""
        from megatron_credit.rewards.evaluation import metric_sums, sample_and_grade

        if self.val_prompts is None:
            return {}
        k, sums = self.val_samples, None
        with self.generating():
            mine = self._my_prompts(len(self.val_prompts))
            if len(mine):
                problems = sample_and_grade(self.engine, self.tokenizer, [self.val_prompts[i] for i in mine], k=k,
                                            pool=self.pool, sampling=self._params(k, draw_seed(self.seed, -1)),
                                            first_group=mine.start)
                sums = metric_sums(problems, k=k)
        return self._val_metrics(sums, k)
