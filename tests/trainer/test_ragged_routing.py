"""Routing replay's routing stays ragged until the micro-batch that replays it (``batch/ragged.py``).

- Every micro-batch the trainer cuts (``batch/rows.py: MicroBatchCut.cut``: padded rows, uniform under PP,
  packed streams, each CP rank's share) gets, bit for bit, the routing tensor that cutting the padded
  ``[B, T, layers, top_k]`` form gives, the form the batch held before (built here as ``to_padded`` built it).
- Host memory: building the batch allocates no routing (the batch holds the samples' own tensors), and the
  routing allocated on the host while the trainer cuts its micro-batches is at most two micro-batches'
  worth at any time (one micro-batch's tensor, and on CUDA its pinned copy), however long the longest
  sample: measured by a dispatch mode that counts the bytes of every int16 host tensor that torch allocates,
  alive and at the peak, for samples of very different lengths.
"""
from __future__ import annotations

import dataclasses
import math
import types
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_credit.batch.ragged import RaggedRouting
from megatron_credit.batch.train_batch import TOKEN_FIELDS, train_batch_from_rollout
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, RolloutSample
from megatron_credit.trainer import step

LAYERS, TOP_K, EXPERTS, PAD = 5, 3, 16, 0
ENTRY = LAYERS * TOP_K * 2  # routing bytes per token (int16)


def _samples(n: int = 48, seed: int = 0, longest: int = 1200) -> list[RolloutSample]:
    """``n`` samples of very different lengths (responses log-uniform from 1 to ``longest`` tokens), every
    fifth without routing (an engine that reported none), the last token of every other one -1 (no forward
    ran it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, 40, (1,), generator=g))
        r = max(1, int(math.exp(float(torch.rand(1, generator=g)) * math.log(longest))))
        routed = None
        if i % 5 != 3:
            routed = torch.randint(0, EXPERTS, (p + r, LAYERS, TOP_K), generator=g, dtype=torch.int16)
            if i % 2:  # as the engines report it; the others keep a last entry a cut could lose
                routed[-1] = -1
        out.append(RolloutSample(prompt_ids=torch.randint(5, 90, (p,), generator=g).tolist(),
                                 response_ids=torch.randint(5, 90, (r,), generator=g).tolist(),
                                 logprobs=-torch.rand(r, generator=g), status=FinishStatus.STOPPED, group_id=i // 4,
                                 sample_index=i % 4, logprobs_mode="raw", routed_experts=routed))
    return out


def _old_padded(samples, t: int) -> torch.Tensor:
    """The ``[B, T, layers, top_k]`` routing ``RolloutBatch.to_padded`` built before it stayed ragged."""
    routed = torch.full((len(samples), t, LAYERS, TOP_K), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routed_experts is not None:
            routed[i, : s.num_tokens] = s.routed_experts.to(torch.int16)
    return routed


def _train_batch(samples):
    padded = RolloutBatch(samples=samples).to_padded(pad_token_id=PAD)
    rewards = torch.linspace(-1.0, 1.0, len(samples))
    return train_batch_from_rollout(padded, rewards=rewards, correct=rewards > 0, pad_id=PAD)


def _ctx(*, packed: bool, cp: int = 1, cp_rank: int = 0, pp: int = 1, budget: int = 1600, minibatches: int = 2,
         device=torch.device("cpu")):
    """What ``step.plan_microbatches`` and ``step.microbatch_cut`` read of the trainer's context."""
    actor = types.SimpleNamespace(packed_sequences=packed, pp_size=pp, cp_size=cp, cp_rank=cp_rank, device=device)
    return types.SimpleNamespace(actor=actor, seq_multiple=2 * cp if cp > 1 else 1, pad_id=PAD,
                                 train=types.SimpleNamespace(num_minibatches=minibatches,
                                                             max_tokens_per_microbatch=budget))


LAYOUTS = {"padded": {"packed": False}, "padded_pp2": {"packed": False, "pp": 2}, "packed": {"packed": True},
           "padded_cp2": {"packed": False, "cp": 2}, "packed_cp2": {"packed": True, "cp": 2},
           "packed_cp2_pp2": {"packed": True, "cp": 2, "pp": 2}}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_microbatch_gets_the_routing_the_padded_batch_gave_bit_for_bit(name):
    samples = _samples()
    tb = _train_batch(samples)
    assert isinstance(tb.routed_experts, RaggedRouting)
    assert all(r is s.routed_experts for r, s in zip(tb.routed_experts.rows, samples))  # no copy, no padding
    old = dataclasses.replace(tb, routed_experts=_old_padded(samples, tb.input_ids.shape[1]))
    layout = LAYOUTS[name]
    seen = 0
    for cp_rank in range(layout.get("cp", 1)):
        ctx = _ctx(**layout, cp_rank=cp_rank)
        plan = step.plan_microbatches(ctx, tb)
        assert sum(len(mini) for mini in plan) > 2  # several micro-batches per mini-batch
        for mini in plan:
            cut = step.microbatch_cut(ctx).cut
            for new_mb, old_mb in zip(cut(tb, mini), cut(old, mini), strict=True):
                assert new_mb.rows == old_mb.rows and list(new_mb.tensors) == list(old_mb.tensors)
                a, b = new_mb.tensors["routed_experts"], old_mb.tensors["routed_experts"]
                assert a.dtype == b.dtype == torch.int16 and a.shape == b.shape and torch.equal(a, b)
                assert a.shape[-2:] == (LAYERS, TOP_K)
                for field in TOKEN_FIELDS:  # the other fields as they were
                    if field in old_mb.tensors:
                        assert torch.equal(new_mb.tensors[field], old_mb.tensors[field]), field
                seen += int((a >= 0).sum())
    assert seen > 0


def test_a_microbatch_cut_past_and_short_of_the_rows_with_padding_rows_is_the_padded_cut():
    """``make_microbatch`` directly: rows in any order, cut shorter than the longest row, padded past it,
    padding rows, both CP ranks; ``make_packed_microbatch`` with an alignment."""
    from megatron_credit.batch.train_batch import make_microbatch, make_packed_microbatch

    samples = _samples(n=9, seed=4, longest=60)
    tb = _train_batch(samples)
    old = dataclasses.replace(tb, routed_experts=_old_padded(samples, tb.input_ids.shape[1]))
    cpu = torch.device("cpu")
    rows = [7, 0, 3, 5]
    longest = int(tb.seq_lens[rows].max())
    for seq_len in (8, longest - longest % 4, longest - longest % 4 + 12):  # CP 2 needs multiples of 4
        for cp in (1, 2):
            for rank in range(cp):
                kw = dict(seq_len=seq_len, num_rows=6, pad_id=PAD, device=cpu, cp_size=cp, cp_rank=rank)
                a = make_microbatch(tb, rows, **kw).tensors["routed_experts"]
                b = make_microbatch(old, rows, **kw).tensors["routed_experts"]
                assert a.shape == (6, seq_len // cp, LAYERS, TOP_K) and torch.equal(a, b), (seq_len, cp, rank)
    for cp, multiple in ((1, 1), (1, 8), (2, 4)):
        for rank in range(cp):
            kw = dict(multiple=multiple, pad_id=PAD, device=cpu, cp_size=cp, cp_rank=rank)
            a = make_packed_microbatch(tb, rows, **kw).tensors["routed_experts"]
            b = make_packed_microbatch(old, rows, **kw).tensors["routed_experts"]
            assert a.shape[0] == 1 and torch.equal(a, b), (cp, multiple, rank)


def test_stream_and_block_gather_like_a_loop_in_any_order():
    """Tokens of the rows in any order (interleaved, repeated positions, padding rows) and any positions."""
    g = torch.Generator().manual_seed(7)
    ragged = RaggedRouting.of([torch.randint(0, EXPERTS, (n, LAYERS, TOP_K), generator=g, dtype=torch.int16)
                               if n else None for n in (5, 0, 9, 3)])
    rows = [2, 0, 1, 3]
    seq_ids = torch.randint(0, len(rows) + 1, (40,), generator=g)  # id 4: a padding row
    positions = torch.cat([torch.arange(8), torch.randint(0, 11, (32,), generator=g)])
    got = ragged.stream(rows, seq_ids=seq_ids, positions=positions)
    for j in range(len(seq_ids)):
        k, p = int(seq_ids[j]), int(positions[j])
        r = ragged.rows[rows[k]] if k < len(rows) else None
        want = r[p] if r is not None and p < len(r) else torch.full((LAYERS, TOP_K), -1, dtype=torch.int16)
        assert torch.equal(got[0, j], want), j
    block = ragged.block(rows, positions=positions, num_rows=6)
    assert block.shape == (6, len(positions), LAYERS, TOP_K)
    for i in range(6):
        ids = torch.full_like(positions, i)
        assert torch.equal(block[i], ragged.stream(rows, seq_ids=ids, positions=positions)[0]), i


def test_samples_with_different_routing_shapes_are_refused():
    with pytest.raises(ValueError, match="different \\[layers, top_k\\] shapes"):
        RaggedRouting.of([torch.zeros(3, 2, 2, dtype=torch.int16), torch.zeros(3, 2, 4, dtype=torch.int16)])
    assert RaggedRouting.of([None, None]) is None


class HostRouting(TorchDispatchMode):
    """The bytes of the int16 host tensors torch allocates while the mode is on (the routing: nothing else in
    this flow is int16), alive now and at the peak; a storage counts until its last tensor is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view allocates nothing; an in-place op's output is its input (seen, or not ours)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.int16 and t.device.type == "cpu":
                    self._add(t.untyped_storage())
        return out

    def _add(self, storage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        self._seen.add(key)
        self.alive += storage.nbytes()
        self.peak = max(self.peak, self.alive)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.alive -= nbytes


def test_the_meter_sees_the_padded_batch_the_trainer_used_to_build():
    samples = _samples()
    t = max(s.num_tokens for s in samples)
    with HostRouting() as meter:
        padded = _old_padded(samples, t)
        assert meter.alive == padded.numel() * 2 == len(samples) * t * ENTRY
        del padded
    assert meter.alive == 0 and meter.peak == len(samples) * t * ENTRY


DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["padded", "padded_pp2", "packed", "packed_cp2"])
def test_host_routing_is_at_most_two_microbatches_worth(name, device):
    """The trainer's flow on the host: the batch from the samples, then every mini-batch's micro-batches
    made at once (``MicroBatchCut.cut``) and sent to the actor's device ("meta" stands in for a GPU where
    none is: the copy leaves the host, as it does for CUDA, whose pinned copy is the second micro-batch)."""
    samples = _samples(n=64, longest=3000)
    tokens = sum(s.num_tokens for s in samples)
    whole = len(samples) * max(s.num_tokens for s in samples) * ENTRY  # the padded [B, T, layers, top_k]
    with HostRouting() as meter:
        tb = _train_batch(samples)
    assert meter.peak == 0  # the batch holds the samples' own routing: nothing allocated, nothing padded
    ragged = tb.routed_experts
    assert ragged.nbytes == sum(s.routed_experts.numel() * 2 for s in samples if s.routed_experts is not None) \
        <= tokens * ENTRY < whole / 2

    layout = LAYOUTS[name]
    ctx = _ctx(**layout, device=torch.device(device))
    largest = 0
    with HostRouting() as meter:
        for mini in step.plan_microbatches(ctx, tb):
            mbs = step.microbatch_cut(ctx).cut(tb, mini)  # the whole mini-batch's, as the trainer holds them
            assert all(mb.tensors["routed_experts"].device.type == device for mb in mbs)
            assert meter.alive == 0  # none left on the host
            largest = max([largest] + [mb.tensors["routed_experts"].numel() * 2 for mb in mbs])
            del mbs
    assert largest > 0 and 0 < meter.peak <= 2 * largest, (meter.peak, largest)
    # far below the padded batch (PP's one micro-batch shape, the most rows by the longest, is the layout's)
    assert meter.peak * (2 if "pp" in name else 10) < whole, (meter.peak, whole)
    if device == "meta":
        assert meter.peak == largest  # one micro-batch's tensor at a time
