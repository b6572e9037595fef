"""From responses to shaped reward tensors, in the verifier workers and in-process; import lightness."""
import subprocess
import sys

import pytest
import torch

from megatron_credit.rewards.compute import score_responses
from megatron_credit.rewards.verifier_workers import VerifierWorkers, VerifierWorkersConfig
from megatron_credit.rewards.shaping import ShapingConfig


@pytest.mark.spawn
def test_the_verifier_workers_and_in_process_agree_and_shape():
    responses = ["<think>ok</think>Answer: 4", "Answer: 5", "<think>so \\boxed{\\frac{1}{2}}", " 7", " 8 x"]
    gts = ["4", "4", "0.5", "7", "9"]
    sources = ["math_dapo", "math_dapo", "math", "synthetic_arith", "synthetic_arith"]
    lens = torch.tensor([5, 12, 19, 2, 20])
    shaping = ShapingConfig(max_response_len=20, overlong_buffer_len=8, format_penalty=0.5, length_coef=0.2)
    local = score_responses(
        None, responses=responses, ground_truths=gts, data_sources=sources, response_lens=lens, shaping=shaping
    )
    with VerifierWorkers(VerifierWorkersConfig(num_workers=1, timeout_s=30.0)) as workers:
        in_workers = score_responses(
            workers, responses=responses, ground_truths=gts, data_sources=sources, response_lens=lens, shaping=shaping
        )
    assert in_workers.records == local.records
    torch.testing.assert_close(in_workers.rewards, local.rewards, rtol=0, atol=0)
    assert local.correct.tolist() == [True, False, True, True, False]
    # Reference from the formulas: score + overlong + format + length (correct & well-formed only).
    want = []
    for i, (ok, n) in enumerate(zip(local.correct.tolist(), lens.tolist())):
        well_formed = i != 2  # "<think>" never closed
        v = (1.0 if ok else -1.0) + min(0.0, max(-1.0, -(n - 12) / 8))
        v += 0.0 if well_formed else -0.5
        v -= 0.2 * n / 20 if (ok and well_formed) else 0.0
        want.append(v)
    torch.testing.assert_close(local.rewards.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    assert in_workers.metrics["verifier/items"] == 5 and in_workers.metrics["verifier/timeouts"] == 0
    assert torch.isclose(local.metrics["reward/accuracy"], torch.tensor(0.6))


@pytest.mark.spawn
def test_packages_import_light():
    code = (
        "import sys, megatron_credit.rewards, megatron_credit.data, megatron_credit.rewards.math, "
        "megatron_credit.rewards.verifier_workers, megatron_credit.data.dataset, megatron_credit.batch.microbatch, "
        "megatron_credit.data.synthetic, megatron_credit.data.tokenizer\n"
        "heavy = [m for m in ('torch', 'math_verify', 'sympy', 'pyarrow', 'sentencepiece', 'megatron') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------- mutation killers
def test_scored_batch_metrics_by_hand():
    # A correct, a wrong and a blank-ground-truth response, scored in-process: the trainer logs these names.
    import pytest

    shaping = ShapingConfig(max_response_len=8, overlong_buffer_len=4, format_penalty=0.5, length_coef=0.1)
    out = score_responses(None, responses=["Answer: 3", "Answer: 4 <think>", "Answer: 5"],
                          ground_truths=["3", "3", " "], data_sources=["math_dapo"] * 3,
                          response_lens=torch.tensor([2, 8, 6]), shaping=shaping)
    assert out.scores.dtype == torch.float32 and out.correct.dtype == torch.bool
    assert out.scores.tolist() == [1.0, -1.0, -1.0] and out.correct.tolist() == [True, False, False]
    assert [r.status for r in out.records] == ["ok", "ok", "bad_ground_truth"]
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["reward/accuracy"] == pytest.approx(1 / 3) and m["reward/score_mean"] == pytest.approx(-1 / 3)
    assert m["reward/bad_ground_truths"] == 1.0
    # overlong: L = 8 and 6 in the last 4 of 8 tokens -> -1 and -0.5; format: the dangling <think> -> -0.5;
    # length: only the correct, well-formed response -> -0.1 * 2 / 8
    assert m["reward/overlong_penalty"] == pytest.approx(-1.5 / 3)
    assert m["reward/format_penalty"] == pytest.approx(-0.5 / 3)
    assert m["reward/length_penalty"] == pytest.approx(-0.025 / 3)
    empty = score_responses(None, responses=[], ground_truths=[], data_sources=[],
                            response_lens=torch.zeros(0, dtype=torch.long), shaping=shaping)
    e = {k: float(v) for k, v in empty.metrics.items()}
    assert (e["reward/accuracy"], e["reward/score_mean"], e["reward/bad_ground_truths"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):  # one ground truth per response
        score_responses(None, responses=["a", "b"], ground_truths=["1"], data_sources=["math_dapo"] * 2,
                        response_lens=torch.tensor([1, 1]), shaping=shaping)


def test_shaping_config_bounds():
    import pytest

    ShapingConfig(max_response_len=1)
    ShapingConfig(max_response_len=8, overlong_buffer_len=8)  # the whole response may be the soft window
    with pytest.raises(ValueError, match=r"^max_response_len must be > 0, got 0$"):
        ShapingConfig(max_response_len=0)


def test_an_incorrect_record_by_default():
    from megatron_credit.rewards.base import RewardRecord, incorrect

    assert incorrect() == RewardRecord(score=-1.0, correct=False, extracted=None, status="ok")
