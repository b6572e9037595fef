"""Reward shaping on top of the verifier score: overlong, format and length penalties.

All penalties are <= 0 and added to the verifier score; the *accuracy* (``correct``) is never changed,
so DAPO's dynamic sampling, which keeps groups whose accuracy varies, is unaffected by shaping.

- Overlong (DAPO, eq. 13): ``min(0, -(L - (Lmax - Lbuf)) / Lbuf * factor)``: zero up to
  ``Lmax - Lbuf`` response tokens, then linear down to ``-factor`` at ``Lmax``. Unlike the
  published formula we clamp at ``-factor`` for ``L > Lmax`` (an engine that overshoots by a token
  must not produce a larger penalty than truncation itself).
- Format: ``-format_penalty`` when the reasoning tags are malformed (see ``reasoning_well_formed``).
- Length: ``-length_coef * min(L, Lmax) / Lmax``, applied only to correct *and* well-formed responses,
  so it trades length against nothing but other correct answers (penalising wrong answers for length
  would reward short wrong answers relative to long wrong ones, which is not the intent).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapingConfig:
    """Which penalties are applied and how strongly."""

    max_response_len: int
    """Lmax: the rollout's maximum number of response tokens."""
    overlong_buffer_len: int = 0
    """Lbuf: length of the soft overlong window before Lmax; 0 disables the overlong penalty."""
    overlong_penalty_factor: float = 1.0
    """Penalty at L = Lmax (DAPO uses 1.0 with Lbuf = 4096 of Lmax = 20480)."""
    format_penalty: float = 0.0
    """Subtracted when reasoning tags are malformed; 0 subtracts nothing, but the check still runs:
    ``reward/malformed_frac`` is still reported and the length penalty still spares malformed responses."""
    require_reasoning_tags: bool = False
    """If True, a response without the tags counts as malformed (else only wrongly nested ones do)."""
    open_tag: str = "<think>"
    """Opening reasoning tag."""
    close_tag: str = "</think>"
    """Closing reasoning tag."""
    length_coef: float = 0.0
    """Length penalty at L = Lmax for correct, well-formed responses; 0 disables it."""

    def __post_init__(self):
        if self.max_response_len <= 0:
            raise ValueError(f"max_response_len must be > 0, got {self.max_response_len}")
        if not 0 <= self.overlong_buffer_len <= self.max_response_len:
            raise ValueError(
                f"overlong_buffer_len must be in [0, max_response_len={self.max_response_len}], "
                f"got {self.overlong_buffer_len}"
            )
        for name in ("overlong_penalty_factor", "format_penalty", "length_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (it is subtracted), got {getattr(self, name)}")


def overlong_penalty(
    lengths: torch.Tensor, *, max_response_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO soft overlong penalty. ``lengths: [B]`` response tokens -> ``[B]`` float penalties <= 0.

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_response_len=20, buffer_len=4, factor=1.0)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    expected = max_response_len - buffer_len
    penalty = -(lengths.to(torch.float32) - expected) / buffer_len * factor
    return penalty.clamp(min=-factor, max=0.0) + 0.0  # + 0.0 turns -0.0 into 0.0


def reasoning_well_formed(response: str, *, open_tag: str, close_tag: str, required: bool) -> bool:
    """Whether ``response`` has at most one ``open_tag ... close_tag`` block, properly ordered.

    The prompt template may already contain the opening tag (as Qwen3/DeepSeek-R1 templates do), so a
    response with only a closing tag is well formed. Two blocks, a dangling opening tag, or a close
    before the open are not. With ``required`` the closing tag must be present.

    >>> cases = ["<think>a</think>b", "a</think>b", "<think>a", "b", "</think><think>", "<think></think>" * 2]
    >>> [reasoning_well_formed(r, open_tag="<think>", close_tag="</think>", required=True) for r in cases]
    [True, True, False, False, False, False]
    """
    n_open, n_close = response.count(open_tag), response.count(close_tag)
    if n_open == 0 and n_close == 0:
        return not required
    if n_close != 1 or n_open > 1:
        return False
    return n_open == 0 or response.index(open_tag) < response.index(close_tag)


def length_penalty(
    lengths: torch.Tensor, correct: torch.Tensor, well_formed: torch.Tensor, *, max_response_len: int,
    coef: float,
) -> torch.Tensor:
    """``-coef * min(L, Lmax) / Lmax`` where correct and well formed, else 0. All ``[B]``.

    >>> length_penalty(torch.tensor([5, 10, 10]), torch.tensor([True, True, False]),
    ...                torch.tensor([True, True, True]), max_response_len=10, coef=0.2)
    tensor([-0.1000, -0.2000, -0.0000])
    """
    frac = lengths.to(torch.float32).clamp(max=max_response_len) / max_response_len
    return -coef * frac * (correct & well_formed).to(torch.float32)


def shape_rewards(
    scores: torch.Tensor, correct: torch.Tensor, lengths: torch.Tensor, responses: list[str], *,
    config: ShapingConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Shaped reward = verifier score + penalties.

    Args:
        scores: ``[B]`` verifier scores (±1). correct: ``[B]`` bool. lengths: ``[B]`` response tokens.
        responses: the ``B`` decoded responses (for the format check).
    Returns:
        ``[B]`` float32 rewards and detached per-component means (``reward/overlong_penalty``,
        ``reward/format_penalty``, ``reward/length_penalty``, ``reward/malformed_frac``).
    """
    assert scores.shape == correct.shape == lengths.shape == (len(responses),)
    well_formed = torch.tensor(
        [
            reasoning_well_formed(
                r, open_tag=config.open_tag, close_tag=config.close_tag,
                required=config.require_reasoning_tags,
            )
            for r in responses
        ],
        dtype=torch.bool,
    )
    overlong = overlong_penalty(
        lengths, max_response_len=config.max_response_len, buffer_len=config.overlong_buffer_len,
        factor=config.overlong_penalty_factor,
    )
    fmt = -config.format_penalty * (~well_formed).to(torch.float32)
    length = length_penalty(
        lengths, correct.bool(), well_formed, max_response_len=config.max_response_len,
        coef=config.length_coef,
    )
    total = scores.to(torch.float32) + overlong + fmt + length
    metrics = {
        "reward/overlong_penalty": overlong.mean(),
        "reward/format_penalty": fmt.mean(),
        "reward/length_penalty": length.mean(),
        "reward/malformed_frac": (~well_formed).to(torch.float32).mean(),
    }
    return total, metrics
