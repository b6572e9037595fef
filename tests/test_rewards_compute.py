"""From responses to shaped reward tensors, in the pool and in-process; import lightness."""
import subprocess
import sys

import torch

from megatron_credit.rewards.compute import score_responses
from megatron_credit.rewards.pool import RewardPool, RewardPoolConfig
from megatron_credit.rewards.shaping import ShapingConfig


def test_pool_and_in_process_agree_and_shape():
    responses = ["<think>ok</think>Answer: 4", "Answer: 5", "<think>so \\boxed{\\frac{1}{2}}", " 7", " 8 x"]
    gts = ["4", "4", "0.5", "7", "9"]
    sources = ["math_dapo", "math_dapo", "math", "synthetic_arith", "synthetic_arith"]
    lens = torch.tensor([5, 12, 19, 2, 20])
    shaping = ShapingConfig(max_response_len=20, overlong_buffer_len=8, format_penalty=0.5, length_coef=0.2)
    local = score_responses(
        None, responses=responses, ground_truths=gts, data_sources=sources, response_lens=lens, shaping=shaping
    )
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=30.0)) as pool:
        pooled = score_responses(
            pool, responses=responses, ground_truths=gts, data_sources=sources, response_lens=lens, shaping=shaping
        )
    assert pooled.records == local.records
    torch.testing.assert_close(pooled.rewards, local.rewards, rtol=0, atol=0)
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
    assert pooled.metrics["reward_pool/items"] == 5 and pooled.metrics["reward_pool/timeouts"] == 0
    assert torch.isclose(local.metrics["reward/accuracy"], torch.tensor(0.6))


def test_packages_import_light():
    code = (
        "import sys, megatron_credit.rewards, megatron_credit.data, megatron_credit.rewards.math, "
        "megatron_credit.rewards.pool, megatron_credit.data.dataset, megatron_credit.data.microbatch, "
        "megatron_credit.data.synthetic, megatron_credit.data.tokenizer\n"
        "heavy = [m for m in ('torch', 'math_verify', 'sympy', 'pyarrow', 'sentencepiece', 'megatron') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
