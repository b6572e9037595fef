"""The samples to the ranks that train them, and this rank's batch and metrics from them: what every
rollout source does once its groups are scored (:class:`RolloutSourceBase`).

The kept groups go, in order, to the data-parallel ranks that train them (``prompts_per_step / DP`` each):
once, as bytes of tensors (``rollout/wire.py``), to the first rank of that replica, which broadcasts them to
the replica's other TP / PP / CP ranks.
"""
from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist

from megatron_credit.batch.train_batch import TrainBatch, train_batch_from_rollout
from megatron_credit.rollout.placement import dp_rank_of_group
from megatron_credit.rollout.types import FinishStatus, RolloutBatch
from megatron_credit.sources.base import VERIFIER_COUNTS


class RolloutSourceBase:
    """The base class of every rollout source (the ``RolloutSource`` contract of ``sources/base.py``): what
    each does with scored groups. Route them to the ranks that train them, make
    this rank's :class:`TrainBatch` and the rollout's metrics. The subclass sets ``rollout``, ``reward``,
    ``tokenizer``, ``device``, ``dp_group``, ``dp_of_rank``, ``dp_size``, ``bound`` (the most versions a
    trained sample may lag), ``last_sync`` and ``log``."""

    def _assemble(self, rows: list, versions: list[int], iteration: int, *, draws: int, kept: int, wall: float,
                  engines: int, verifier_sums: dict[str, float],
                  partial: int = 0) -> tuple[TrainBatch, dict[str, float]]:
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
        bound = self.bound
        counts = torch.stack([(staleness == s).sum() for s in range(bound + 1)]).double().to(self.device)
        worst = staleness.max().double().reshape(1).to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.dp_group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.dp_group)
        metrics.update({f"rollout/staleness_hist/{s}": float(counts[s]) for s in range(bound + 1)})
        metrics["rollout/staleness_max"] = float(worst)
        metrics.update({"rollout/draws": float(draws), "rollout/kept_group_frac": kept / (draws * self.rollout.prompts_per_step),
                        "rollout/engines": float(engines), "rollout/partial_draws": float(partial), **self.last_sync})
        metrics["rollout/tokens"] = self._dp_sum(batch.seq_lens.sum().float())
        if padded.obs_mask is not None:
            metrics.update(self._episode_metrics(samples, padded, batch.correct))
        metrics.update(self._transfer_metrics())
        metrics.update(self._verifier_metrics(verifier_sums, iteration, engines=engines))
        return batch, metrics

    def _episode_metrics(self, samples: list, padded, correct: torch.Tensor) -> dict[str, float]:
        """Multi-turn: ``accuracy/first_turn`` (the share of trajectories correct after one model turn,
        ``rollout.episode_scores.first_turn_correct``: with the feedback environment, right at the first
        attempt; ``accuracy/mean`` is after the feedback), ``rollout/turns_mean`` and
        ``rollout/tool_calls_mean`` (per trajectory),
        ``rollout/env_token_frac`` (the environment's share of the response tokens), ``env/errors`` (environment
        failures: trajectories ended by the abort rule), ``env/failed_frac`` (their share of the trajectories),
        ``env/error_reasons`` (``{reason: trajectories}``, only when some failed) and ``env/tool_errors`` (calls
        answered with the error observation), over the data-parallel group."""
        from megatron_credit.rollout.episode_scores import first_turn_correct

        eps = [s.episode for s in samples if s.episode is not None]
        sums = torch.tensor([len(samples), sum(e.turns for e in eps), sum(e.tool_calls for e in eps),
                             float(padded.obs_mask.sum()), float((padded.response_mask | padded.obs_mask).sum()),
                             sum(e.env_errors for e in eps), sum(e.tool_errors for e in eps),
                             float(first_turn_correct(samples, correct).sum())],
                            dtype=torch.float64).to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(sums, group=self.dp_group)
        n, turns, calls, env_tokens, tokens, errors, tool_errors, first = sums.tolist()
        out = {"accuracy/first_turn": first / max(n, 1), "rollout/turns_mean": turns / max(n, 1), "rollout/tool_calls_mean": calls / max(n, 1),
               "rollout/env_token_frac": env_tokens / max(tokens, 1), "env/errors": errors,
               "env/failed_frac": errors / max(n, 1), "env/tool_errors": tool_errors}
        if errors:  # the reasons, which every rank of the group then holds (an object collective: only then)
            reasons = collections.Counter(s.error for s in samples if s.episode is not None and s.episode.aborted)
            if self.dp_size > 1:
                held: list[Any] = [None] * self.dp_size
                dist.all_gather_object(held, dict(reasons), group=self.dp_group)
                reasons = sum((collections.Counter(h) for h in held), collections.Counter())
            out["env/error_reasons"] = dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        return out

    def _val_metrics(self, sums: dict[str, float] | None, k: int) -> dict[str, float]:
        """``val/*`` from the ``evaluation.metric_sums`` of the ranks that sampled (None on the others),
        summed over every rank."""
        from megatron_credit.sources.evaluation import means_from_sums

        names = (f"avg@{k}", f"cons@{k}", f"pass@{k}", "num_problems")
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        if sums is not None:
            vec += torch.tensor([sums[name] for name in names], dtype=torch.float64).to(vec.device)
        dist.all_reduce(vec)
        means = means_from_sums(dict(zip(names, vec.tolist())))
        return {"val/accuracy": means[f"avg@{k}"], f"val/cons@{k}": means[f"cons@{k}"],
                f"val/pass@{k}": means[f"pass@{k}"]}

    def _route(self, kept: list[tuple[int, int]], held: dict) -> list[Any]:
        """The kept groups to the ranks that train them: group ``k`` goes once, from the engine leader that
        holds it, to the first rank of data-parallel replica ``dp_rank_of_group(k)``, as bytes of tensors
        (``rollout/wire.py``: one message per destination, one all-to-all); that rank broadcasts the
        replica's groups to the replica's other ranks (TP / PP / CP) in one message. Returns this rank's
        groups in order. The bytes go to ``transfer/*`` (:meth:`_transfer_metrics`)."""
        from megatron_credit.rollout.wire import decode, encode, payload_bytes

        world = len(self.dp_of_rank)
        if world == 1:
            self._sent = (0, 0, 0)
            return [held[key] for key in kept]
        heads = self._replica_heads()
        send: list[list[Any]] = [[] for _ in range(world)]
        for k, key in enumerate(kept):
            if key in held:
                send[heads[dp_rank_of_group(k, groups=len(kept), dp_size=self.dp_size)]].append((k, held[key]))
        messages = [encode(items) for items in send]
        payload = sum(payload_bytes(items) for items in send)
        got = sorted((item for buf in self._exchange(messages) for item in decode(buf)), key=lambda item: item[0])
        rank = dist.get_rank()
        got, broadcast = self._replica_broadcast(got, head=rank == heads[self.dp_of_rank[rank]])
        self._sent = (sum(m.numel() for m in messages), payload, broadcast)
        assert len(got) == len(kept) // self.dp_size, "each data-parallel rank gets prompts_per_step / DP groups"
        return [g for _, g in got]

    def _replica_broadcast(self, got: list, *, head: bool) -> tuple[list, int]:
        """The replica's groups ``got`` (``[(k, group), ...]``, held by its head) on every rank of the replica
        (TP / PP / CP), in one message from the head; returns them and the bytes broadcast."""
        from megatron_credit.rollout.wire import decode, encode

        group, size = self._replica_group()
        if size == 1:
            return got, 0
        src = self._replica_heads()[self.dp_of_rank[dist.get_rank()]]
        mine = encode(got) if head else None
        length = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=src, group=group)
        buf = mine.to(self.device) if mine is not None else torch.empty(int(length), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=src, group=group)
        if mine is None:
            return decode(buf.cpu()), 0
        return got, mine.numel() * (size - 1)

    def _replica_heads(self) -> list[int]:
        """The first global rank of each data-parallel replica (indexed by DP rank)."""
        heads: dict[int, int] = {}
        for q, dp in enumerate(self.dp_of_rank):
            heads.setdefault(dp, q)
        return [heads[dp] for dp in range(self.dp_size)]

    def _replica_group(self) -> tuple[Any, int]:
        """This rank's replica (the ranks of its DP rank: TP x PP x CP) as a process group, and its size; the
        groups are made once, every rank calling ``new_group`` for every replica in the same order."""
        if getattr(self, "_replicas", None) is None:
            members = [[q for q, dp in enumerate(self.dp_of_rank) if dp == d] for d in range(self.dp_size)]
            self._replicas = [(dist.new_group(m) if len(m) > 1 else None, len(m)) for m in members]
        return self._replicas[self.dp_of_rank[dist.get_rank()]]

    def _transfer_metrics(self) -> dict[str, float]:
        """``transfer/sample_bytes`` (the messages from the engine leaders to the replicas' heads, every
        group once), ``transfer/sample_payload_bytes`` (what they carry: ``rollout/wire.payload_bytes``) and
        ``transfer/sample_broadcast_bytes`` (the heads' broadcasts within their replicas), summed over ranks."""
        v = torch.tensor([float(x) for x in getattr(self, "_sent", (0, 0, 0))], dtype=torch.float64).to(self.device)
        if len(self.dp_of_rank) > 1:
            dist.all_reduce(v)
        names = ("transfer/sample_bytes", "transfer/sample_payload_bytes", "transfer/sample_broadcast_bytes")
        return dict(zip(names, v.tolist()))

    def _verifier_metrics(self, sums: dict[str, float], iteration: int, *, engines: int) -> dict[str, float]:
        """``verifier/*`` of the iteration, summed over its draws and the engines' verifier workers
        (``seconds``: the mean over the engines); a warning line when more than a tenth of the items timed
        out."""
        if self.reward.num_workers == 0:
            return {}
        keys = VERIFIER_COUNTS
        vec = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64).to(self.device)
        dist.all_reduce(vec)  # only engine leaders hold verifier workers
        out = dict(zip(keys, vec.tolist()))
        out["verifier/seconds"] /= engines
        if out["verifier/timeouts"] > 0.1 * max(out["verifier/items"], 1.0):
            self.log(f"warning: iteration {iteration}: {out['verifier/timeouts']:.0f} of "
                     f"{out['verifier/items']:.0f} responses timed out in the verifier workers (scored as incorrect; "
                     "reward.timeout_s / reward.batch_timeout_s)")
        return out

    # -- collectives ---------------------------------------------------------------------------------
    def _all_gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank (small objects: NCCL moves them through this rank's device)."""
        out = [None] * len(self.dp_of_rank)
        dist.all_gather_object(out, obj)
        return out

    def _exchange(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-to-all of byte tensors: ``send[q]`` goes to rank ``q``; returns what every rank sent here (on
        this rank's device: NCCL moves CUDA tensors)."""
        device = self.device
        sizes = torch.tensor([m.numel() for m in send], dtype=torch.int64).to(device)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes)
        recv = got.tolist()
        out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, torch.cat(send).to(device), output_split_sizes=recv,
                               input_split_sizes=[m.numel() for m in send])
        return list(out.cpu().split(recv))

    def _dp_mean(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        keys = sorted(values)
        vec = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).to(self.device) for k in keys])
        if self.dp_size > 1:
            dist.all_reduce(vec, group=self.dp_group)
        return {k: float(v) / self.dp_size for k, v in zip(keys, vec)}

    def _dp_sum(self, value: torch.Tensor) -> float:
        v = torch.as_tensor(value, dtype=torch.float64).reshape(1).clone().to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(v, group=self.dp_group)
        return float(v)
