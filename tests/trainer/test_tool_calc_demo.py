"""The multi-turn demo (``examples/tool_calc_cpu.yaml``, docs/multi_turn.md) learns to call the calculator, in
``sync`` and with a rollout pool rank (``one_step_off``): validation accuracy reaches 0.8 and the tool calls per
trajectory rise; no environment step fails."""
import pytest

from tests.support.runs import metrics_rows, run_pretrain_rl

pytestmark = [pytest.mark.slow, pytest.mark.dist]  # a pretrain_rl.py process (the sandbox workers, the pool rank)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warmup")  # both modes start from the same warmed-up policy


@pytest.mark.parametrize("mode", [[], ["rollout.mode=one_step_off", "rollout.ranks=1"]], ids=["sync", "one_step_off"])
def test_the_tool_demo_learns_to_call_the_calculator(tmp_path, cache, mode):
    run = tmp_path / "run"
    proc = run_pretrain_rl("--config", "examples/tool_calc_cpu.yaml", "--output-dir", run, "train.steps=20",
                           "train.val_every=20", "train.val_prompts=128", f"warmup.cache_dir={cache}",
                           "checkpoint.every=0", "logging.progress=false", "logging.tensorboard=false", *mode,
                           timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = metrics_rows(run)
    assert len(rows) == 20
    first, last = rows[:3], rows[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "rollout/tool_calls_mean") > mean(first, "rollout/tool_calls_mean") + 0.2
    assert mean(last, "accuracy/mean") > mean(first, "accuracy/mean") + 0.2
    assert rows[-1]["val/accuracy"] >= 0.8
    assert all(r["env/errors"] == 0 for r in rows)
    assert all(1.0 <= r["rollout/turns_mean"] <= 3.0 and 0 < r["rollout/env_token_frac"] < 0.5 for r in rows)
    assert all("advantage/turn_0_abs_mean" in r for r in rows)
    if mode:
        assert max(r["rollout/staleness_max"] for r in rows) == 1
