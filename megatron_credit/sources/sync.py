"""``rollout.mode: sync``: the engines share the trainer's GPUs; generate, then train (:class:`SyncSource`).

Every GPU generates (``rollout.placement``): world size / rollout TP engines, engine ``e`` built by rank
``e * rollout_tp`` on the GPUs of its ``rollout_tp`` ranks, whatever the trainer's TP / PP / CP / DP.
Each draw takes ``rollout.prompts_per_step`` prompts from the job's one stream; each engine samples and
scores its contiguous slice, with seeds from (run seed, iteration, draw) and each prompt's index in the
draw, so the samples do not depend on the number of engines or ranks. Whether each group's accuracy
varies (DAPO's dynamic sampling) is all-gathered, every rank takes the same decisions, and the kept
groups go to the ranks that train them (:class:`~megatron_credit.sources.routing.RolloutSourceBase`).

Around each generation phase (the iteration's rollout, validation) the trainer gives the engine its
memory: the optimizer states go to the host and the gradient buffers are released
(``trainer.offload``), the engine wakes its weights, receives the ones the driver hands over (HF-named
buckets of whole layers, gathered over TP and PP on every rank), wakes its KV cache, generates and
sleeps; then the trainer takes its memory back. A resumed run samples exactly what the uninterrupted run
would have.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, TYPE_CHECKING

import torch.distributed as dist

from megatron_credit.batch.train_batch import TrainBatch
from megatron_credit.recipe import rollout_modes as modes
from megatron_credit.rollout.placement import EnginePlacement, draw_seed, split
from megatron_credit.rollout.types import SamplingParams
from megatron_credit.sources.base import (ROLLOUT_SOURCES, Offload, SourceInputs, Weights, build_verifier_workers,
                                          check_full, counted, draw_share, draw_until_full, env_failures,
                                          sampling_params)
from megatron_credit.sources.routing import RolloutSourceBase

if TYPE_CHECKING:
    from megatron_credit.recipe.sections import RewardConfig, RolloutConfig


@ROLLOUT_SOURCES.register("sync")
class SyncSource(RolloutSourceBase, modes.Sync):
    """Generates each iteration's :class:`TrainBatch` for this rank on the trainer's own GPUs (module
    docstring): samples of the weights that train them, staleness 0."""

    bound = 0

    @classmethod
    def build(cls, inputs: SourceInputs) -> SyncSource:
        from megatron_credit.rollout.engine import build_trainer_engine

        recipe, r = inputs.recipe, inputs.recipe.rollout
        engines = EnginePlacement(world_size=dist.get_world_size(), local_world_size=inputs.node_ranks,
                                  rollout_tp=r.tensor_parallel_size)
        from megatron_credit.rollout.multi_turn import build_episode_engine

        def engine(gpus):  # multi-turn (env.name): the engine plays episodes in the recipe's environment
            built = build_trainer_engine(r, recipe.model, seed=recipe.seed, hf_config=inputs.hf_config,
                                         device=inputs.device, gpus=gpus)
            return build_episode_engine(built, recipe.env, inputs.tokenizer)
        return cls(rollout=r, reward=recipe.reward, engine_factory=engine, seed=recipe.seed,
                   max_draws=recipe.algorithm.max_draws, dynamic_sampling=recipe.algorithm.dynamic_sampling,
                   val_samples=recipe.train.val_samples, tokenizer=inputs.tokenizer, prompts=inputs.prompts,
                   val_prompts=inputs.val_prompts, device=inputs.device, dp_group=inputs.dp_group, placement=engines,
                   local_rank=inputs.local_rank, dp_of_rank=inputs.dp_of_rank, offload=inputs.offload,
                   group_timeout_s=recipe.distributed.timeout_s, log=inputs.log)

    # -- a run's source -----------------------------------------------------------------------------
    def __init__(self, *, rollout: RolloutConfig, reward: RewardConfig, engine_factory: Callable[..., Any],
                 seed: int, max_draws: int, dynamic_sampling: bool, val_samples: int, tokenizer, prompts,
                 val_prompts, device, dp_group, placement: EnginePlacement, local_rank: int, dp_of_rank: list[int],
                 offload: Offload, group_timeout_s: float, log=print):
        """The recipe's ``rollout`` and ``reward`` sections; ``engine_factory(gpus=...)`` builds the rollout
        engine (on engine leaders only: ``rollout.engine.build_trainer_engine``); ``seed`` (the run's),
        ``max_draws`` and ``dynamic_sampling`` (``algorithm.*``: DAPO's dynamic sampling), ``val_samples``
        (``train.val_samples``: k of the validation's Avg@k); ``device`` and ``dp_group``: this rank's;
        ``placement``: the engines; ``local_rank``: this rank's device index on its node; ``dp_of_rank``: the
        data-parallel rank of every global rank; ``offload``: what the trainer gives up while engines
        generate; ``group_timeout_s``: the timeout of the engines' own process groups
        (``distributed.timeout_s``)."""
        self.rollout, self.reward = rollout, reward
        self.seed, self.max_draws, self.dynamic_sampling, self.val_samples = seed, max_draws, dynamic_sampling, val_samples
        self.tokenizer, self.prompts, self.val_prompts = tokenizer, prompts, val_prompts
        self.device, self.dp_group = device, dp_group
        self.placement, self.offload, self.log = placement, offload, log
        self.rank = dist.get_rank()
        self.dp_of_rank = list(dp_of_rank)
        self.dp_rank, self.dp_size = self.dp_of_rank[self.rank], max(self.dp_of_rank) + 1
        self.engine_index = placement.engine_of(self.rank)
        self.engine = self.verifier_workers = None
        if placement.is_leader(self.rank):
            self.engine = engine_factory(gpus=placement.gpus(rank=self.rank, local_rank=local_rank))
            self.verifier_workers = build_verifier_workers(reward)
        self.stop_ids = tuple(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None)
        self.last_sync: dict[str, float] = {}
        self.peers = self._peer_buckets(group_timeout_s)
        import datetime

        # Where the ranks wait for the engines' leaders while they generate: a gloo group, on the host. A rank
        # that leads no engine would otherwise wait inside the draw's first NCCL collective, whose kernel spins
        # on a GPU that an engine's other worker is generating on, for the whole draw (hours at 20K tokens).
        self.host_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout_s))

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
        for e in range(self.placement.num_engines):
            leader = self.placement.leader(e)
            group = dist.new_group(list(range(leader, leader + self.placement.rollout_tp)),
                                   timeout=datetime.timedelta(seconds=timeout_s))
            if e == self.engine_index and wants[leader]:
                mine = PeerBuckets(group, leader, stage)
        return mine

    def close(self) -> None:
        if self.verifier_workers is not None:
            self.verifier_workers.close()
        if self.engine is not None:
            self.engine.close()

    # -- the generation phase ------------------------------------------------------------------------
    def sync_weights(self, weights: Weights) -> None:
        """``weights`` -> engine: every rank takes part in the TP / PP gathers; engine leaders load the
        buckets into their awake engine. Sets ``sync/bytes`` (what one engine received) and ``sync/seconds``."""
        t0, sizes = time.perf_counter(), []
        stream = counted(weights.buckets(), sizes)
        if self.engine is not None:
            self.engine.update_weights(stream, **({"peers": self.peers} if self.peers is not None else {}))
        elif self.peers is not None:  # this rank's GPU serves a worker of the engine: its copy of each bucket
            self.peers.follow(stream, self.device)
        else:
            for _ in stream:
                pass
        self.last_sync = {"sync/bytes": float(sum(sizes)), "sync/seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def generating(self, weights: Weights):
        """The memory order of a generation phase: offload (optimizer states to the host, gradient buffers
        released, the allocator's cache emptied), wake the engine's weights, load ``weights``, wake its KV
        cache; afterwards the engine sleeps (dropping what the next sync overwrites) and the trainer restores
        its states before it trains."""
        self.offload.offload()
        try:
            if self.engine is not None:
                self.engine.wake_up(["weights"])
            self.sync_weights(weights)
            if self.engine is not None:
                self.engine.wake_up(["kv_cache"])
            yield
        finally:
            if self.engine is not None:
                self.engine.sleep()
            self.offload.restore()

    def leaders_done(self) -> None:
        """Wait on the host (:attr:`host_group`, gloo) until every rank, engine leaders included, has finished
        its part of a generation phase; only then does the phase's device exchange (NCCL on a GPU) begin."""
        dist.barrier(group=self.host_group)

    def _params(self, n: int, seed: int) -> SamplingParams:
        return sampling_params(self.rollout, self.stop_ids, n=n, seed=seed)

    def _my_prompts(self, count: int) -> range:
        """This engine's slice of ``count`` prompts (empty on ranks that lead no engine)."""
        if self.engine is None:
            return range(0)
        return split(count, self.placement.num_engines)[self.engine_index]

    def _draw(self, iteration: int, draw: int, held: dict, verifier_sums: dict) -> list[tuple[int, int]]:
        """One draw of ``prompts_per_step`` prompts over all engines; this engine's groups go to ``held``
        (keyed ``(draw, prompt)``). Returns the keys of the draw's groups that count (dynamic sampling: its
        accuracy varies), the same list on every rank."""
        count = self.rollout.prompts_per_step
        records = self.prompts.take(count)
        groups, counts, verifier_counts = draw_share(
            self.engine, self.verifier_workers, self.tokenizer, records, self._my_prompts(count),
            self._params(self.rollout.n, draw_seed(self.seed, iteration, draw)), rollout=self.rollout,
            reward=self.reward, dynamic_sampling=self.dynamic_sampling)
        for k, v in verifier_counts.items():
            verifier_sums[k] = verifier_sums.get(k, 0.0) + v
        held.update({(draw, p): group for p, group in groups.items()})
        self.leaders_done()
        merged: dict[int, bool] = {}
        for part in self._all_gather(counts):
            merged.update(part)
        assert sorted(merged) == list(range(count)), "every prompt of a draw is sampled by exactly one engine"
        return [(draw, p) for p in range(count) if merged[p]]

    def next(self, iteration: int, *, weights: Weights) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's rows: ``prompts_per_step / DP`` groups of ``n`` (dynamic sampling: mixed groups),
        generated by ``weights`` (those of ``iteration - 1``: the rows' ``policy_version``)."""
        count = self.rollout.prompts_per_step
        held: dict[tuple[int, int], Any] = {}
        verifier_sums: dict[str, float] = {}
        t_wait = time.perf_counter()  # the trainer waits for the whole phase: nothing of it is hidden
        with self.generating(weights):
            t0 = time.perf_counter()
            kept, draws = draw_until_full(lambda d: self._draw(iteration, d, held, verifier_sums), count=count,
                                          max_draws=self.max_draws)
            wall = time.perf_counter() - t0
        failed = (0, 0, "")
        if len(kept) < count:  # the run stops: why, from every engine's groups (an object collective: only then)
            parts = self._all_gather(env_failures(held.values()))
            failed = (sum(p[0] for p in parts), sum(p[1] for p in parts), next((p[2] for p in parts if p[2]), ""))
        check_full(len(kept), count=count, max_draws=self.max_draws, env_failed=failed)
        rows = self._route(kept[:count], held)
        batch, metrics = self._assemble(rows, [weights.version] * len(rows), iteration, draws=draws, kept=len(kept),
                                        wall=wall, engines=self.placement.num_engines, verifier_sums=verifier_sums)
        metrics.update({"time/rollout_wait_s": time.perf_counter() - t_wait, "time/rollout_hidden_frac": 0.0})
        return batch, metrics

    def validate(self, iteration: int, *, weights: Weights) -> dict[str, float]:
        """Avg@k (``val/accuracy``), Cons@k and Pass@k on the held-out prompts, sampled at the rollout
        temperature with k = ``train.val_samples``, each engine its slice of the prompts, with the same seeds
        whatever the engine count (``megatron_credit.sources.evaluation``, the code of ``tools/evaluate.py``);
        the engines generate with ``weights`` (those of ``iteration``)."""
        from megatron_credit.sources.evaluation import metric_sums, sample_and_grade

        if self.val_prompts is None:
            return {}
        k, sums = self.val_samples, None
        with self.generating(weights):
            mine = self._my_prompts(len(self.val_prompts))
            if len(mine):
                problems = sample_and_grade(self.engine, self.tokenizer, [self.val_prompts[i] for i in mine], k=k,
                                            verifier_workers=self.verifier_workers,
                                            sampling=self._params(k, draw_seed(self.seed, -1)), first_group=mine.start)
                sums = metric_sums(problems, k=k)
            self.leaders_done()
        return self._val_metrics(sums, k)
