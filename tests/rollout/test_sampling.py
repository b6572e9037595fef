"""CPU tests of the rollout sampling functions and the rollout record, against loop references."""
import math

import pytest
import torch

from megatron_credit.rollout.sampling import ExponentialNoise, filter_logits, noise_block_steps, row_seed, sample_step
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, RolloutSample, SamplingParams


def _filter_reference(row: list[float], top_k: int, top_p: float) -> list[float]:
    """Slow reference: keep top-k (ties kept), then the smallest prefix whose mass reaches top_p."""
    v = len(row)
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(row, reverse=True)[top_k - 1]
        keep = {i for i in range(v) if row[i] >= kth}
    if top_p < 1:
        z = sum(math.exp(row[i]) for i in keep)
        order = sorted(keep, key=lambda i: -row[i])
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += math.exp(row[i]) / z
        keep = nucleus
    return [row[i] if i in keep else -math.inf for i in range(v)]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (1, 0.9), (0, 0.01)])
def test_filter_logits_matches_loop_reference(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(6, 23, generator=g, dtype=torch.float64) * 2
    got = filter_logits(logits, top_k=top_k, top_p=top_p)
    want = torch.tensor([_filter_reference(r, top_k, top_p) for r in logits.tolist()], dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_sample_step_logprobs_match_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 17, generator=g, dtype=torch.float64) * 3
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8, seed=0)
    noise = torch.empty(5, 17, dtype=torch.float64).exponential_(generator=g)
    tok, raw, processed = sample_step(logits, params=params, noise=noise)
    for r in range(5):
        row = [x / 0.7 for x in logits[r].tolist()]
        z = math.log(sum(math.exp(x) for x in row))
        assert raw[r].item() == pytest.approx(row[tok[r]] - z, abs=1e-12)
        kept = _filter_reference(row, 6, 0.8)
        assert kept[tok[r]] > -math.inf, "sampled a filtered-out token"
        zk = math.log(sum(math.exp(x) for x in kept if x > -math.inf))
        assert processed[r].item() == pytest.approx(kept[tok[r]] - zk, abs=1e-12)


def test_greedy_and_top_k_1_take_the_argmax_with_temperature_1_logprobs():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    noise = torch.empty(4, 11).exponential_(generator=torch.Generator().manual_seed(2))
    tok, raw, processed = sample_step(logits, params=SamplingParams(temperature=0), noise=None)
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(raw, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0], rtol=0, atol=1e-12)
    tok1, _, processed1 = sample_step(logits, params=SamplingParams(top_k=1), noise=noise)
    assert torch.equal(tok1, tok)
    assert torch.equal(processed1, torch.zeros(4, dtype=torch.float64))  # one token left: probability 1


def test_sampling_frequencies_follow_the_processed_distribution():
    rows = 6000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -3.0]], dtype=torch.float64).expand(rows, -1)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gens = [torch.Generator().manual_seed(row_seed(3, 0, i)) for i in range(rows)]
    noise = ExponentialNoise(gens, vocab=6, block_steps=1, device=torch.device("cpu")).next()
    tok, _, processed = sample_step(logits, params=params, noise=noise)
    probs = torch.softmax(filter_logits(logits[:1] / 0.8, top_k=0, top_p=0.9), -1)[0]
    freq = torch.bincount(tok, minlength=6).double() / rows
    sigma = (probs * (1 - probs) / rows).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-12).all(), (freq, probs)
    assert freq[probs == 0].sum() == 0
    torch.testing.assert_close(processed, probs.log()[tok], rtol=0, atol=1e-12)


def test_exponential_noise_rows_are_independent_of_the_batch():
    seeds = [row_seed(0, g, 0) for g in range(3)]
    block = noise_block_steps(SamplingParams(max_new_tokens=10), vocab=7)
    assert block == 10 and noise_block_steps(SamplingParams(max_new_tokens=10), vocab=1 << 20) == 1

    def draws(rows):
        gens = [torch.Generator().manual_seed(seeds[r]) for r in rows]
        noise = ExponentialNoise(gens, vocab=7, block_steps=4, device=torch.device("cpu"))
        return torch.stack([noise.next() for _ in range(9)], 1)  # [R, 9 steps, V]: crosses block edges

    all_rows, alone = draws([0, 1, 2]), draws([1])
    assert torch.equal(all_rows[1], alone[0])
    assert (all_rows > 0).all() and not torch.equal(all_rows[0], all_rows[2])
    assert abs(all_rows.mean().item() - 1.0) < 0.2  # Exp(1) has mean 1 (189 draws)


def test_selected_rows_keep_their_own_streams():
    # Rows leaving the batch mid-block (compaction): the kept rows draw on as if nothing had left.
    def noise(rows):
        gens = [torch.Generator().manual_seed(row_seed(0, g, 0)) for g in rows]
        return ExponentialNoise(gens, vocab=5, block_steps=3, device=torch.device("cpu"))

    full, kept = noise([0, 1, 2, 3]), noise([1, 3])
    first = [full.next() for _ in range(2)]
    full.select(torch.tensor([1, 3]), [1, 3])
    later = torch.stack([full.next() for _ in range(4)], 1)  # crosses a block edge after the select
    want = torch.stack([kept.next() for _ in range(6)], 1)
    assert torch.equal(torch.stack(first, 1)[[1, 3]], want[:, :2]) and torch.equal(later, want[:, 2:])
    with pytest.raises(ValueError, match=r"rows \(2\) and indices \(1\) must name the same rows"):
        full.select(torch.tensor([0, 1]), [0])


def test_row_seed_is_stable_and_spreads():
    assert row_seed(0, 0, 0) == row_seed(0, 0, 0)
    seeds = {row_seed(s, g, i) for s in range(3) for g in range(10) for i in range(8)}
    assert len(seeds) == 240 and all(0 <= s < 2**63 for s in seeds)


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"n": 0}, "n"),
                          ({"logprobs_mode": "logits"}, "logprobs_mode")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def _sample(prompt, response, group, index, status=FinishStatus.STOPPED):
    return RolloutSample(prompt_ids=prompt, response_ids=response, logprobs=-torch.arange(1.0, len(response) + 1),
                         status=status, group_id=group, sample_index=index, logprobs_mode="raw")


def test_to_padded_rows():
    batch = RolloutBatch(samples=[_sample([1, 2, 3], [4, 5], 7, 0),
                                  _sample([6], [7, 8, 9], 7, 1, FinishStatus.TRUNCATED),
                                  _sample([2, 2], [], 8, 0, FinishStatus.FAILED)], wall_s=2.0)
    p = batch.to_padded(pad_token_id=-1)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, -1], [2, 2, -1, -1, -1]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert p.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert p.rollout_logprobs.tolist() == [[0, 0, 0, -1, -2], [0, -1, -2, -3, 0], [0, 0, 0, 0, 0]]
    assert p.prompt_lens.tolist() == [3, 1, 2] and p.response_lens.tolist() == [2, 3, 0]
    assert p.group_ids.tolist() == [7, 7, 8] and p.status.tolist() == [0, 1, 2]
    assert batch.num_response_tokens == 5 and batch.response_tokens_per_s == 2.5
    assert batch.to_padded(pad_token_id=0, max_len=8).input_ids.shape == (3, 8)
    with pytest.raises(ValueError, match="max_len"):
        batch.to_padded(pad_token_id=0, max_len=4)


def test_sample_rejects_misaligned_logprobs():
    with pytest.raises(ValueError, match="one per response token"):
        RolloutSample(prompt_ids=[1], response_ids=[2, 3], logprobs=torch.zeros(3), status=FinishStatus.STOPPED,
                      group_id=0, sample_index=0, logprobs_mode="raw")


def test_greedy_processed_logprobs_ignore_top_k_and_top_p_as_vllm_does():
    # vLLM's greedy path returns log-probs of the unfiltered, unscaled logits, whatever top-k/top-p say;
    # the "hf" engine must report the same numbers so both engines honour one contract.
    logits = torch.randn(5, 13, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    params = SamplingParams(temperature=0, top_k=3, top_p=0.4, logprobs_mode="processed")
    tok, raw, processed = sample_step(logits, params=params, noise=None)
    assert torch.equal(tok, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(raw, expected, rtol=0, atol=1e-12)
    assert torch.equal(processed, raw)
