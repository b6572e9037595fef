"""Token sampling as pure tensor functions: temperature, top-k, top-p, per-row seeded noise.

One decoding step maps last-position logits ``[R, V]`` to sampled tokens ``[R]`` and two log-probs per
token: "raw" (``log_softmax(logits / T)`` over the full vocabulary, what the trainer recomputes) and
"processed" (after top-k then top-p filtering and renormalisation, the distribution sampled from --
what vLLM returns by default). Sampling uses the Gumbel-max trick with noise from one
``torch.Generator`` per row (:class:`ExponentialNoise`), so a row's draw depends only on its own
generator and never on which other rows share the batch.

>>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
>>> filter_logits(logits, top_k=2, top_p=1.0)
tensor([[2., 1., -inf, -inf]])
>>> filter_logits(logits, top_k=0, top_p=0.5)  # p = [.64, .24, .09, .03]: the first token reaches 0.5
tensor([[2., -inf, -inf, -inf]])
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_credit.seed_modes import SEED_MODES
from megatron_credit.rollout.types import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of the splitmix64 finaliser: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, group_id: int, sample_index: int) -> int:
    """Seed of one sample's generator, a hash of (seed, group id, sample index) in [0, 2^63).

    Hashing (rather than e.g. ``seed + index``) keeps the streams of neighbouring samples and of
    consecutive iterations' seeds unrelated.

    >>> row_seed(1, 2, 3) == row_seed(1, 2, 3) and row_seed(1, 2, 3) != row_seed(1, 3, 2)
    True
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (group_id & _MASK64))
    h = _splitmix64(h ^ (sample_index & _MASK64))
    return h >> 1


def resolve_seed_mode(requested: str, *, engine_default: str) -> str:
    """``requested`` (``rollout.seed_mode``), or the engine's own default for ``auto``.

    >>> resolve_seed_mode("auto", engine_default="per_call"), resolve_seed_mode("per_sample", engine_default="per_call")
    ('per_call', 'per_sample')
    """
    mode = engine_default if requested == "auto" else requested
    if mode not in SEED_MODES:
        raise ValueError(f"rollout.seed_mode must be one of {('auto', *SEED_MODES)}, got {requested!r}")
    return mode


def call_seed(seed: int, first_group_id: int) -> int:
    """Seed of one ``generate`` call in ``per_call`` mode, a hash of (seed, the call's first group id) in
    [0, 2^63): engines given different slices of the prompts draw unrelated streams.

    >>> call_seed(1, 0) == call_seed(1, 0) != call_seed(1, 8) and call_seed(1, 0) != row_seed(1, 0, 0)
    True
    """
    return row_seed(seed, first_group_id, -1)  # sample index -1: no sample's own seed


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf.

    logits: [R, V] float. top_k = 0 and top_p = 1 disable the filters. Ties at the k-th value are all
    kept. The nucleus keeps every token whose preceding (higher-probability) mass is below top_p, so
    the token that crosses top_p is included and at least one token always survives.
    Returns [R, V], same dtype.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class ExponentialNoise:
    """Per-row Exp(1) noise for Gumbel-max sampling, drawn from one generator per row, or from one generator
    shared by all rows (:meth:`shared`, ``seed_mode: per_call``).

    Each row's draws come from its own generator only, in blocks of ``block_steps`` steps (one RNG
    call per row per block instead of per step); rows are therefore reproducible whatever else shares
    the batch, as long as ``block_steps`` is the same -- derive it from the sampling parameters, never
    from the batch. A shared generator draws a block for all rows in one call: reproducible for the same
    rows in the same order. ``next()`` returns [R, V] float32 on the generators' device.
    """

    def __init__(self, generators: list[torch.Generator], *, vocab: int, block_steps: int, device: torch.device):
        self.generators, self.vocab, self.block_steps, self.device = generators, vocab, block_steps, device
        self._shared: torch.Generator | None = None
        self._rows = len(generators)
        self._block: torch.Tensor | None = None
        self._pos = block_steps

    @classmethod
    def shared(cls, generator: torch.Generator, *, rows: int, vocab: int, block_steps: int,
               device: torch.device) -> "ExponentialNoise":
        """Noise for ``rows`` rows from one ``generator``."""
        noise = cls([], vocab=vocab, block_steps=block_steps, device=device)
        noise._shared, noise._rows = generator, rows
        return noise

    def select(self, rows: torch.Tensor, indices: Sequence[int]) -> None:
        """Keep only the given rows (indices into the current rows), e.g. when finished rows leave the batch:
        ``rows`` on the noise's device, ``indices`` the same on the host (no read of the device here)."""
        if len(indices) != len(rows):
            raise ValueError(f"rows ({len(rows)}) and indices ({len(indices)}) must name the same rows")
        self.generators = [self.generators[i] for i in indices] if self._shared is None else []
        self._rows = len(indices)
        if self._block is not None:
            self._block = self._block[rows]

    def next(self) -> torch.Tensor:
        if self._pos == self.block_steps:
            if self._shared is not None:
                self._block = torch.empty(self._rows, self.block_steps, self.vocab, device=self.device
                                          ).exponential_(generator=self._shared)
            else:
                self._block = torch.stack([
                    torch.empty(self.block_steps, self.vocab, device=self.device).exponential_(generator=g)
                    for g in self.generators
                ])  # [R, block_steps, V]
            self._pos = 0
        self._pos += 1
        return self._block[:, self._pos - 1]


def noise_block_steps(params: SamplingParams, vocab: int) -> int:
    """Steps of noise drawn per RNG call: about 64K values per row, at most max_new_tokens steps."""
    return max(1, min(params.max_new_tokens, (1 << 16) // vocab))


def sample_step(
    logits: torch.Tensor, *, params: SamplingParams, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits: [R, V] float, the model's next-token logits; noise: [R, V] i.i.d. Exp(1) draws (ignored,
    and may be None, when greedy). Returns (tokens [R] int64, raw_logp [R], processed_logp [R]).
    Greedy (temperature 0) takes the argmax and reports log-probs at temperature 1 of the *unfiltered*
    logits in both modes (processed == raw), as vLLM 0.11's greedy path does: top-k/top-p cannot change
    the argmax, and vLLM computes greedy "processed" log-probs before applying them. Both engines thus
    return the same numbers for the same greedy request.
    """
    if params.greedy:
        raw = torch.log_softmax(logits, dim=-1)
        tokens = raw.argmax(dim=-1)
        processed = raw
    else:
        scaled = logits / params.temperature
        raw = torch.log_softmax(scaled, dim=-1)
        processed = torch.log_softmax(filter_logits(scaled, top_k=params.top_k, top_p=params.top_p), dim=-1)
        # Gumbel-max: argmax(logp - log E) with E ~ Exp(1) is an exact draw from softmax(logp).
        tokens = (processed - noise.to(processed.dtype).clamp_min(1e-20).log()).argmax(dim=-1)
    pick = tokens.unsqueeze(-1)
    return tokens, raw.gather(-1, pick).squeeze(-1), processed.gather(-1, pick).squeeze(-1)
