"""The CPU-testable half of ``tools/gpu_check_profile.py`` (part ``profile`` of ``tools/gpu_check.sh``): the
sync counting (what ``torch.cuda.set_sync_debug_mode("warn")`` reports, by phase and owner), the kernel
summary (busy time as a union, host gaps, top kernels) on hand-made intervals and on a real CPU profile,
the report lines, the timed generation and its deadline with a tiny model on the CPU, the demo recipe
(planned with ``--dry-run``) and the Qwen2.5-1.5B shape (built on the meta device). The numbers themselves
exist on a GPU only."""
from __future__ import annotations

import doctest
import warnings

import pytest
import torch

from tools import gpu_check_profile as P


def test_tool_doctests():
    # make test collects doctests of megatron_credit/ only; this tool's examples run here.
    assert doctest.testmod(P).failed == 0


def test_sync_site_owners():
    assert P.sync_site([("/v/torch/nn/functional.py", 3), ("/v/megatron/core/models/gpt.py", 7),
                        ("/r/megatron_credit/trainer/actor.py", 1)]) == ("megatron-core", "megatron/core/models/gpt.py:7")
    assert P.sync_site([("/v/transformers/masking_utils.py", 273), ("/r/megatron_credit/x.py", 2)]) \
        == ("transformers", "transformers/masking_utils.py:273")
    assert P.sync_site([("/r/pretrain_rl.py", 40)]) == ("project", "pretrain_rl.py:40")
    assert P.sync_site([("/r/run.py", 5)]) == ("other", "run.py:5")
    assert P.sync_site([]) == ("other", "?:0")


def _sync(times: int) -> None:
    for _ in range(times):  # one line: the filter must show each, not once per location
        warnings.warn(f"{P.SYNC_MESSAGE} (Triggered internally at c10/cuda/CUDAFunctions.h:1.)", UserWarning)


def test_the_counter_takes_each_sync_warning_by_phase_and_lets_others_through(recwarn):
    counter = P.SyncCounter()
    with counter.counting():
        with counter.phase("update"):
            _sync(3)
            with counter.phase("logprob"):
                _sync(1)
        _sync(2)
        warnings.warn("something else", UserWarning)
    _sync(1)  # after counting: an ordinary warning again
    assert counter.count() == 6 and counter.count(phase="update") == 3 and counter.count(phase="logprob") == 1
    assert counter.count(phase="other") == 2 and counter.count(owner="other") == 6
    (owner, site, n), = counter.sites()
    assert owner == "other" and site.startswith("test_gpu_check_profile.py:") and n == 6
    assert [str(w.message) for w in recwarn][0] == "something else" and len(recwarn) == 2
    lines = P.format_syncs(counter, {"update": 3, "logprob": 1}, label="t")
    assert lines[:4] == ["- host syncs (t, torch.cuda.set_sync_debug_mode): 6 in all",
                         "  - update: 3 micro-batches, 3 syncs, 1.0 per micro-batch (other 1.0)",
                         "  - old log-probs: 1 micro-batches, 1 syncs, 1.0 per micro-batch (other 1.0)",
                         "  - rollout 0, the rest of the iteration 2"]
    assert P.format_syncs(P.SyncCounter(), {}, label="t")[1] == "  - update: no micro-batch ran"


def test_kernel_summary_clips_to_the_window_and_counts_overlaps_once():
    events = [("gemm", -50, 100), ("gemm", 400, 900), ("copy", 450, 500), ("add", 950, 960), ("late", 990, 2000)]
    s = P.kernel_summary(events, (0, 1000), top=2)
    # busy: [0, 100] + [400, 900] + [950, 960] + [990, 1000]; idle 300 + 50 + 30 (gaps of 100 us and more: one)
    assert s["busy_us"] == 620.0 and s["wall_us"] == 1000.0 and s["idle"] == pytest.approx(0.38)
    assert s["gaps"] == {"count": 1, "total_us": 300.0, "largest_us": 300.0} and s["count"] == 5
    assert s["kernels"] == [("gemm", 2, 600.0), ("copy", 1, 50.0)]
    empty = P.kernel_summary([], (0, 500))
    assert empty["busy_us"] == 0 and empty["idle"] == 1.0 and empty["gaps"]["largest_us"] == 500.0


def test_a_real_cpu_profile_goes_through_the_same_functions():
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("gpu_check/iteration"):
            for _ in range(3):
                x = torch.mm(x, x).tanh()
    window = P.window_of(prof, "gpu_check/iteration")
    assert window is not None and window[1] > window[0] and P.window_of(prof, "absent") is None
    assert P.profile_events(prof) == []  # no CUDA events on a CPU profile
    host = P.profile_events(prof, device="cpu")
    ops = dict((n, c) for n, c, _ in P.host_ops(host, window, top=10))
    assert ops["aten::mm"] == 3 and ops["aten::tanh"] == 3
    summary = P.kernel_summary([e for e in host if e[0] == "aten::mm"], window)
    assert summary["count"] == 3 and 0 < summary["busy_us"] <= summary["wall_us"]
    lines = P.format_profile(summary, label="cpu", host=P.host_ops(host, window))
    assert lines[0].startswith("- profile (cpu): wall ") and lines[3].endswith("| aten::mm")
    assert lines[-1].startswith("  - host ops by wall time: ")


@pytest.fixture(scope="module")
def engine():
    from transformers import Qwen2Config

    from megatron_credit.rollout import HFRolloutEngine

    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return HFRolloutEngine(hf_config=cfg, init_seed=0)


def test_a_timed_generation_and_its_deadline(engine):
    prompts = [[3, 4, 5], [6, 7]]
    run = P.decode_run(engine, prompts=prompts, n=2, new_tokens=5)
    assert (run["steps"], run["rows"], run["tokens"], run["stopped"]) == (5, 4, 20, False)
    assert run["seconds"] >= run["prefill_s"] > 0 and run["decode_ms"] > 0 and engine.between_steps is None
    cut = P.decode_run(engine, prompts=prompts, n=2, new_tokens=5, deadline=0.0)  # long past: stops after a step
    assert (cut["steps"], cut["tokens"], cut["stopped"]) == (1, 4, True) and engine.between_steps is None
    line = P.format_decode(cut, P.decode_syncs_per_step(engine, prompts=prompts, steps=(2, 3)), label="tiny",
                           target=5)
    assert line[0].endswith("(stopped at the part's time limit after 1 of 5 steps)"), line
    assert line[1] == "  - host syncs per decode step: none"  # nothing warns without CUDA


def test_the_demo_recipe_is_the_demo_without_warm_up_and_plans(tmp_path, capsys):
    import yaml

    import pretrain_rl

    path = P.demo_recipe(tmp_path)
    r = yaml.safe_load(path.read_text())
    assert r["train"]["steps"] == P.DEMO_ITERATIONS == 3 and r["warmup"] == {"steps": 0}
    assert r["model"]["params_dtype"] == "bfloat16" and r["rollout"]["engine"] == "hf"
    assert P.PROFILED < P.SYNC_COUNTED <= P.DEMO_ITERATIONS
    capsys.readouterr()
    assert pretrain_rl.main(["--config", str(path), "--dry-run", "--skip-preflight"]) == 0
    assert "dry run: the recipe is valid for this world size" in capsys.readouterr().out


def test_the_decode_model_is_qwen25_1p5b_shaped():
    model = P.qwen15b_model("meta", torch.bfloat16)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (1536, 28, 12, 2, 8960, 151936)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert 1.5e9 < n < 1.6e9 and next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_cuda_the_part_says_why(tmp_path, capsys):
    assert P.main(["all", str(tmp_path)]) == P.SKIP
    assert capsys.readouterr().out.strip().splitlines()[-1] == "skipped: CUDA is not available to torch"
    assert P.main(["profile"]) == 2


def test_a_piece_fails_when_it_raises_or_says_failed(capsys):
    assert P._piece("a", lambda: ["- fine"]) is True
    assert P._piece("b", lambda: ["- x", "failed: iteration 2 was not profiled"]) is False
    assert P._piece("c", lambda: 1 / 0) is False
    assert capsys.readouterr().out.splitlines()[-1] == "failed: c: ZeroDivisionError: division by zero"
