"""AdamW on fp32 master weights: plain AdamW for fp32 models, exact fp32 arithmetic for bf16 ones, and a
bf16 run that resumes bit-identically (the masters travel in the checkpoint)."""
from __future__ import annotations

import json
import os

import torch

from megatron_credit.trainer.optimizer import MasterWeightsAdamW


def _grads(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 1e-3 for _ in range(6)]


def test_fp32_model_is_plain_adamw_bit_for_bit():
    a = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MasterWeightsAdamW([{"params": [a], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.99))
    ref = torch.optim.AdamW([{"params": [b], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.99))
    assert not ours.mixed and ours.masters[0] is a
    for g in _grads(1, (5, 3)):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step(), ref.step()
        ours.zero_grad(), ref.zero_grad()
        assert torch.equal(a, b)


def test_bf16_model_steps_fp32_masters_and_keeps_small_updates():
    init = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.02
    w = torch.nn.Parameter(init.to(torch.bfloat16))
    master_ref = torch.nn.Parameter(w.detach().float().clone())  # fp32 AdamW fed the same grads
    plain = torch.nn.Parameter(w.detach().clone())  # plain AdamW on the bf16 weights
    ours = MasterWeightsAdamW([{"params": [w]}], lr=1e-6, weight_decay=0.0)
    ref = torch.optim.AdamW([master_ref], lr=1e-6, weight_decay=0.0)
    bad = torch.optim.AdamW([plain], lr=1e-6, weight_decay=0.0)
    start = w.detach().clone()
    for step in range(60):
        g = torch.ones(64).to(torch.bfloat16)
        w.grad, master_ref.grad, plain.grad = g.clone(), g.float(), g.clone()
        ours.step(), ref.step(), bad.step()
        ours.zero_grad(), ref.zero_grad(), bad.zero_grad()
        assert torch.equal(ours.masters[0], master_ref)  # exact fp32 AdamW
        assert torch.equal(w, master_ref.detach().to(torch.bfloat16))  # the model holds the rounded master
    assert (w != start).sum() > 10  # 60 updates of 1e-6 survive in the masters and reach the weights
    assert torch.equal(plain, start)  # ...while plain bf16 AdamW rounds every one of them away


def test_bf16_run_resumes_bit_identically(tmp_path):
    from tests.test_trainer_e2e import CLI_TINY, _cli, _lines, _stable

    args = [*CLI_TINY, "model.params_dtype=bfloat16"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert _cli("--output-dir", a, *args, "train.steps=4").returncode == 0
    assert _cli("--output-dir", b, *args, "train.steps=2").returncode == 0
    proc = _cli("--output-dir", b, *args, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    assert _stable(_lines(a)) == _stable(_lines(b))
    with open(os.path.join(b, "checkpoints", "iter_0000004", "meta.json")) as f:
        assert json.load(f)["step"] == 4
