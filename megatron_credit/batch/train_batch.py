"""``TrainBatch``: one data-parallel rank's samples of an iteration as tensors, and the global
denominators of each optimizer step.

Label space. The actor's output at position ``t`` predicts token ``t + 1``, so every per-token tensor
here is indexed by the position that *scores* a token: ``labels[:, t] = input_ids[:, t + 1]``,
``loss_mask[:, t]`` is True when ``input_ids[:, t + 1]`` is a response token, and ``old_logp``,
``advantages``, ``values`` ... at ``t`` belong to that token. ``values[:, t]`` is the critic's value of
the prefix ``input_ids[:, :t + 1]``, the state in which the token was chosen.

Global denominators (docs/architecture.md "Known traps"): a mini-batch's token and sequence counts are summed over
the data-parallel group once per optimizer step, before any micro-batch runs, from the *whole*
sequences (every CP rank of a DP replica holds the same rows, so they are never summed over CP). Each
micro-batch's loss is then ``aggregate_loss(..., global_num_tokens=N)``, and the sum over micro-batches
and DP x CP ranks is the loss of the whole mini-batch, whatever the split.

Micro-batch forms. A :class:`MicroBatch` is either padded rows ``[b, s]`` (:func:`make_microbatch`) or
one packed stream ``[1, t]`` of its sequences end to end (:func:`make_packed_microbatch`, THD, megatron's
``PackedSeqParams``; ``batch/packing.py``). Per-sequence math reads the packed one through its row view
(:meth:`MicroBatch.rows_view`), outputs go back to the batch's rows through :meth:`MicroBatch.whole_rows`,
so the losses, the aggregations and the scans see one response per row either way.

Devices. A ``TrainBatch`` stays where the rollout made it (host memory); each ``MicroBatch`` is cut and
CP-split there, then copied to the actor's device (pinned, non-blocking on CUDA); the denominators are
made on that device, where the loss and NCCL read them. A mixture of experts' routing is never padded to
the batch (``[B, T, layers, top_k]`` would be gigabytes per rank): the batch holds each sample's own tensor
(:class:`~megatron_credit.batch.ragged.RaggedRouting`), and a micro-batch gathers its rows' routing straight
into its padded or packed, CP-split form, the tensor cutting the padded form would give (``batch/ragged.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from megatron_credit.batch.cp_chunks import check_sequence_length, load_balanced_positions, split_for_cp
from megatron_credit.batch.packing import PackedIndex
from megatron_credit.batch.ragged import RaggedRouting

# Per-token fields, in label space; sliced, padded and CP-split together with the side channels
# (``TrainBatch.extras``, which may have trailing dimensions: ``[B, T, ...]``). All are [B, T].
TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "rollout_logp", "old_logp", "ref_logp", "values",
                "advantages", "returns", "obs_mask", "turn_ids")
# Per-position model inputs (indexed like ``input_ids``, not shifted), cut with the fields above: a mixture
# of experts' routed experts, ragged in the batch (``RaggedRouting``), ``[b, s, layers, top_k]`` in a
# micro-batch, -1 where there is none (and on padding).
POSITION_FIELDS = ("routed_experts",)
FILL = {"input_ids": None, "labels": None, "routed_experts": -1, "turn_ids": -1}
"""The padding value of a field (None: the pad id); 0 for the others."""


def _fill(name: str, pad_id: int):
    value = FILL.get(name, 0)
    return pad_id if value is None else value


@dataclasses.dataclass(kw_only=True)
class TrainBatch:
    """One DP rank's rows (one response per row), right-padded; label space (module docstring)."""

    input_ids: torch.Tensor
    """``[B, T]`` int64 prompt + response tokens, right-padded with the pad id."""
    labels: torch.Tensor
    """``[B, T]`` int64 ``input_ids`` shifted left by one (pad id at the end)."""
    loss_mask: torch.Tensor
    """``[B, T]`` bool: ``labels[:, t]`` is a response token the policy chose (in a multi-turn trajectory an
    action token, never an observation's: ``obs_mask``)."""
    rollout_logp: torch.Tensor
    """``[B, T]`` float32 the engine's log-prob of ``labels[:, t]`` (0 off the mask)."""
    seq_lens: torch.Tensor
    """``[B]`` int64 prompt + response tokens of each row."""
    group_ids: torch.Tensor
    """``[B]`` int64 prompt group of each row (unique over the DP group)."""
    rewards: torch.Tensor
    """``[B]`` float32 shaped reward of each response."""
    correct: torch.Tensor
    """``[B]`` bool verifier verdict."""
    policy_version: Optional[torch.Tensor] = None
    """``[B]`` int64 the policy that generated each row: the RL iterations its weights had completed."""
    old_logp: Optional[torch.Tensor] = None
    """``[B, T]`` behaviour log-probs recomputed by the actor (set by the old-log-prob pass)."""
    ref_logp: Optional[torch.Tensor] = None
    """``[B, T]`` frozen reference log-probs (KL penalty only)."""
    values: Optional[torch.Tensor] = None
    """``[B, T]`` critic values of the behaviour pass (critic algorithms only)."""
    advantages: Optional[torch.Tensor] = None
    """``[B, T]`` detached advantages, 0 off the mask."""
    returns: Optional[torch.Tensor] = None
    """``[B, T]`` value targets (critic algorithms only)."""
    update_logp: Optional[torch.Tensor] = None
    """``[B, T]`` the log-probs of the update's forward of each row (the policy that updated on it; the last
    epoch's), after the update: what FIPO's weights read, and the credit maps' log-prob change. Not cut into
    micro-batches."""
    routed_experts: Optional[RaggedRouting] = None
    """The rollout engine's experts of each token, one ``[seq_lens[i], layers, top_k]`` int16 tensor per row
    (position space, like ``input_ids``; -1 where the engine reported none), not padded
    (``batch/ragged.py``): what the actor's routers replay (``moe.routing_replay``). Each micro-batch gets its
    rows' as ``[b, s, layers, top_k]`` (-1 on padding). A padded ``[B, T, layers, top_k]`` tensor here would
    be cut like the token fields: the same micro-batches, at the padded batch's memory."""
    obs_mask: Optional[torch.Tensor] = None
    """``[B, T]`` bool: ``labels[:, t]`` is an environment token inside a multi-turn trajectory (an
    observation between turns): context the policy reads, out of the loss, the entropy, the KL, the mismatch
    and the token counts (none of them is in ``loss_mask``); the credit scans pass across it
    (``docs/multi_turn.md``). None for single-turn batches."""
    turn_ids: Optional[torch.Tensor] = None
    """``[B, T]`` int64: the turn of ``labels[:, t]`` (an observation's is the turn it answers), -1 off the
    response; None for single-turn batches."""
    turn_rewards: Optional[torch.Tensor] = None
    """``[B, K]`` float32: the environment's reward of each turn of a row (part of ``rewards``, which is the
    trajectory's return); None for single-turn batches."""
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``{name: [B, T, ...]}`` the algorithm's side channels: its capture's outputs from the behaviour pass
    (``algorithm/capture.py``), its ``behaviour_extras`` and what its state adds before the estimator. Cut
    into micro-batches with the fields above; a policy loss gets those it names as keywords."""

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def token_rewards(self) -> torch.Tensor:
        """``[B, T]`` the response's reward on its last scored token, 0 elsewhere (GAE evidence). A multi-turn
        trajectory's turn ``k`` reward goes to turn ``k``'s last action token, and the rest of its return
        (the verifier's score) to its last action token: never to an observation."""
        out = torch.zeros(self.loss_mask.shape, dtype=torch.float32)
        rows = torch.arange(self.size)
        has = self.loss_mask.any(dim=1)
        if self.turn_ids is None:
            last = self.seq_lens - 2  # the position scoring the last token
            out[rows[has], last[has]] = self.rewards[has].float()
            return out
        positions = torch.arange(self.loss_mask.shape[1])
        last_action = torch.where(self.loss_mask, positions, -1).max(dim=1).values
        turn_rewards = self.turn_rewards if self.turn_rewards is not None else torch.zeros(self.size, 1)
        final = self.rewards.float() - turn_rewards.sum(dim=1)
        out[rows[has], last_action[has]] = final[has]
        for k in range(turn_rewards.shape[1]):
            at = torch.where(self.loss_mask & (self.turn_ids == k), positions, -1).max(dim=1).values
            ok = at >= 0
            out[rows[ok], at[ok]] += turn_rewards[ok, k]
        return out


def train_batch_from_rollout(padded, *, rewards: torch.Tensor, correct: torch.Tensor,
                             pad_id: int, policy_version: "int | torch.Tensor | None" = None) -> TrainBatch:
    """A :class:`TrainBatch` from a ``rollout.PaddedRollout`` (which is aligned with the tokens);
    ``policy_version``: the version of the weights that generated every row, or ``[B]`` one per row."""
    ids = padded.input_ids
    shift = lambda x, fill: torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)  # noqa: E731
    return TrainBatch(
        input_ids=ids, labels=shift(ids, pad_id), loss_mask=shift(padded.response_mask, False),
        rollout_logp=shift(padded.rollout_logprobs, 0.0),
        seq_lens=padded.prompt_lens + padded.response_lens, group_ids=padded.group_ids,
        rewards=rewards.float(), correct=correct.bool(), routed_experts=getattr(padded, "routed_experts", None),
        obs_mask=None if getattr(padded, "obs_mask", None) is None else shift(padded.obs_mask, False),
        turn_ids=None if getattr(padded, "turn_ids", None) is None else shift(padded.turn_ids, -1),
        turn_rewards=getattr(padded, "turn_rewards", None),
        policy_version=None if policy_version is None else torch.as_tensor(policy_version, dtype=torch.int64).expand(
            ids.shape[0]).clone())


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepDenominators:
    """Global counts of one optimizer step (one mini-batch over all DP ranks)."""

    global_num_tokens: torch.Tensor
    """Scored response tokens of the mini-batch, summed over DP."""
    global_num_seqs: torch.Tensor
    """Responses of the mini-batch, summed over DP."""
    norm_length: int
    """Dr.GRPO's fixed L: ``rollout.max_response_len``."""

    def for_rows(self, loss_mask_rows: torch.Tensor) -> dict[str, Any]:
        """``aggregate_loss`` keywords for a micro-batch whose whole rows' masks are given."""
        return {"global_num_tokens": self.global_num_tokens, "global_num_seqs": self.global_num_seqs,
                "norm_length": self.norm_length, "seq_num_tokens": loss_mask_rows.sum(-1)}


def step_denominators(loss_mask: torch.Tensor, *, norm_length: int, device: torch.device,
                      dp_group=None) -> StepDenominators:
    """Counts of the rows ``loss_mask: [b, T]`` of this rank's part of a mini-batch, summed over DP, on
    ``device`` (the actor's: NCCL reduces device tensors only).

    One all-reduce per optimizer step (never per micro-batch)."""
    import torch.distributed as dist

    counts = torch.tensor([float(loss_mask.sum()), float(loss_mask.shape[0])], dtype=torch.float64)
    counts = counts.to(device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return StepDenominators(global_num_tokens=counts[0].float(), global_num_seqs=counts[1].float(),
                            norm_length=norm_length)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """The model inputs and per-token tensors of one micro-batch on this rank (CP-split)."""

    rows: tuple[int, ...]
    """Indices into the TrainBatch (padding rows, if any, are not listed)."""
    num_rows: int
    """Rows of the tensors (>= len(rows) when padded to a uniform pipeline shape)."""
    seq_len: int
    """Global (pre-CP) length of the tensors."""
    position_ids: torch.Tensor
    """``[b, s]`` global positions of this rank's tokens."""
    tensors: dict
    """Per-token fields of :data:`TOKEN_FIELDS` and :data:`POSITION_FIELDS` that are set, and the side
    channels, ``[b, s(, ...)]`` (this CP rank's share)."""
    whole_loss_mask: torch.Tensor
    """``[b, seq_len]`` loss mask of the whole rows (for per-response denominators under CP); packed: the
    ``[n, T]`` rows of the batch's loss mask."""
    packing: Optional[PackedIndex] = None
    """Packed: where each of this rank's tokens lives (``batch/packing.py``); None for padded rows."""
    first_scored: Optional[int] = None
    """:attr:`query_start`, found on the host when the micro-batch is made (None: from
    :attr:`whole_loss_mask`, a device read)."""

    @property
    def packed(self) -> bool:
        return self.packing is not None

    @property
    def packed_seq_params(self):
        """megatron's ``PackedSeqParams`` of a packed micro-batch (THD; the padded lengths are the sequence
        lengths, ``batch/packing.py``), on the micro-batch's device; None for padded rows."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams  # only the actor asks, megatron's side

        cu = self.packing.cu_seqlens.to(self.position_ids.device)
        longest = max(self.packing.padded_lens)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
        params.cu_seqlens_host = tuple(self.packing.cu_seqlens.tolist())  # for host-side readers: no device sync
        return params

    @property
    def computed_tokens(self) -> int:
        """Tokens the forward pass computes (all CP ranks): the padded block, or the packed stream."""
        return self.packing.total_tokens if self.packed else self.num_rows * self.seq_len

    def rows_view(self, t: Optional[torch.Tensor], fill=0) -> Optional[torch.Tensor]:
        """``t`` (this rank's ``[b, s(, ...)]`` tokens) with one response per row: itself when padded, the
        packed stream's row view ``[n, W(, ...)]`` (differentiable) when packed."""
        if t is None or not self.packed:
            return t
        return self.packing.to_rows(t, fill)

    def whole_rows(self, local: torch.Tensor, *, cp_group=None) -> torch.Tensor:
        """This rank's ``[b, s]`` output -> ``[len(rows), >= longest row]``: row ``k`` is ``rows[k]``'s whole
        sequence (gathered over ``cp_group`` under CP; detached use only)."""
        if self.packed:
            return self.packing.whole_rows(local, cp_group=cp_group)
        if cp_group is not None:
            from megatron_credit.batch.context_parallel import gather_from_cp

            local = gather_from_cp(local, cp_group=cp_group)
        return local[: len(self.rows)]

    @property
    def query_start(self) -> int:
        """The first (global) position that scores a response token in any row (a final-layer capture reads
        the attention of the queries from there on); ``seq_len`` when no row has one."""
        if self.first_scored is not None:
            return self.first_scored
        return first_scored(self.whole_loss_mask, self.seq_len)


def first_scored(loss_mask: torch.Tensor, default: int) -> int:
    """The first column of ``loss_mask [b, s]`` that is set in any row; ``default`` when none is.

    >>> first_scored(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]]), 4), first_scored(torch.zeros(2, 3), 3)
    (1, 3)
    """
    cols = loss_mask.any(dim=0).nonzero()
    return int(cols[0]) if len(cols) else default


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host -> CUDA copies go through pinned memory without blocking the host (the
    copy is queued on the current stream, before the kernels that read it)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def make_microbatch(batch: TrainBatch, rows: Sequence[int], *, seq_len: int, num_rows: int, pad_id: int,
                    device: torch.device, cp_size: int = 1, cp_rank: int = 0) -> MicroBatch:
    """Rows ``rows`` of ``batch`` cut or right-padded to ``seq_len`` tokens and ``num_rows`` rows (all
    padding is masked), then split for context parallelism (megatron's load-balanced chunk order) and copied
    to ``device`` (the actor's). Ragged routing is gathered at this rank's positions directly."""
    idx = torch.tensor(list(rows), dtype=torch.long)
    if cp_size > 1:
        check_sequence_length(seq_len, multiple=2 * cp_size)
        pos = load_balanced_positions(seq_len // cp_size, cp_rank=cp_rank, cp_size=cp_size)
    else:
        pos = torch.arange(seq_len)
    out, ready = {}, {}
    for name in TOKEN_FIELDS + POSITION_FIELDS + tuple(batch.extras):
        t = batch.extras[name] if name in batch.extras else getattr(batch, name)
        if t is None:
            continue
        if isinstance(t, RaggedRouting):  # this rank's share, cut and padded: no [B, T] copy
            out[name] = ready[name] = t.block(rows, positions=pos, num_rows=num_rows)
            continue
        t = t[idx]
        fill = _fill(name, pad_id)
        if t.shape[1] < seq_len:
            t = torch.cat([t, t.new_full((t.shape[0], seq_len - t.shape[1], *t.shape[2:]), fill)], dim=1)
        t = t[:, :seq_len]
        if t.shape[0] < num_rows:
            t = torch.cat([t, t.new_full((num_rows - t.shape[0], *t.shape[1:]), fill)], dim=0)
        out[name] = t
    whole = out["loss_mask"]
    if cp_size > 1:
        out = {k: v if k in ready else split_for_cp(v, cp_size=cp_size, cp_rank=cp_rank) for k, v in out.items()}
    return MicroBatch(rows=tuple(int(r) for r in rows), num_rows=num_rows, seq_len=seq_len,
                      position_ids=to_device(pos.expand(num_rows, -1).contiguous(), device),
                      tensors={k: to_device(v, device) for k, v in out.items()},
                      whole_loss_mask=to_device(whole, device), first_scored=first_scored(whole, seq_len))


def make_packed_microbatch(batch: TrainBatch, rows: Sequence[int], *, multiple: int, pad_id: int,
                           device: torch.device, cp_size: int = 1, cp_rank: int = 0) -> MicroBatch:
    """Rows ``rows`` of ``batch`` as one packed stream: each sequence's ``seq_lens`` tokens rounded up to
    ``multiple`` (the CP / SP alignment, masked), end to end; this CP rank's chunks of every sequence
    (megatron's THD split), on ``device``."""
    idx = torch.tensor(list(rows), dtype=torch.long)
    index = PackedIndex.build(batch.seq_lens[idx].tolist(), multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)
    out = {}
    for name in TOKEN_FIELDS + POSITION_FIELDS + tuple(batch.extras):
        t = batch.extras[name] if name in batch.extras else getattr(batch, name)
        if isinstance(t, RaggedRouting):  # this rank's tokens of each row, gathered: no [n, T] copy
            out[name] = t.stream(rows, seq_ids=index.seq_ids, positions=index.positions)
        elif t is not None:
            out[name] = index.pack(t[idx], _fill(name, pad_id))
    return MicroBatch(rows=tuple(int(r) for r in rows), num_rows=1, seq_len=index.total_tokens,
                      position_ids=to_device(index.positions[None], device),
                      tensors={k: to_device(v, device) for k, v in out.items()},
                      whole_loss_mask=to_device(batch.loss_mask[idx], device), packing=index,
                      first_scored=first_scored(batch.loss_mask[idx], index.total_tokens))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
