"""The feedback demo (``examples/reasoning_gym_feedback_tiny_cpu.yaml``, docs/multi_turn.md): a reasoning-gym
task read by the tiny actor through the synthetic tokenizer with byte fallback, warm-up traces that retry
after the feedback environment's answer, and the recipe run in miniature."""
import dataclasses
import os

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is the test extra's (pip install -e '.[test]')")

from megatron_credit.recipe.config import load_recipe  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.runs import metrics_rows, run_pretrain_rl  # noqa: E402

RECIPE = os.path.join(ROOT, "examples", "reasoning_gym_feedback_tiny_cpu.yaml")


def test_the_warm_up_trace_retries_after_the_environment_s_answer(tmp_path):
    """With ``retry_prob`` 1 every trace is: a wrong attempt and EOS (trained), the feedback observation as the
    environment writes it (not trained), the right answer and EOS (trained), after the prompt (not trained)."""
    from megatron_credit.data.setup import build_data
    from megatron_credit.env import build_environment
    from megatron_credit.trainer.warmup import supervised_batch

    r = load_recipe(RECIPE)
    tok, stream, _, task = build_data(r.data, seed=r.seed, model_path=None, val_every=0, val_prompts=0)
    env = build_environment(r.env.name, r.env.options)
    batch = supervised_batch(task, tok, [0, 1], retry_prob=1.0, env=env, seed=0)
    rec = stream.take(1)[0]
    assert rec.messages[-1].content.startswith("Calculate ") and tok.decode(list(rec.prompt_ids)) == (
        f"<|user|>{rec.messages[-1].content}<|assistant|>")
    row = batch.input_ids[0, : int(batch.seq_lens[0])].tolist()
    p = len(rec.prompt_ids)
    assert row[:p] == list(rec.prompt_ids)
    eos = [i for i, t in enumerate(row) if t == tok.eos_token_id]
    assert len(eos) == 2 and eos[1] == len(row) - 1
    wrong, obs_and_answer = tok.decode(row[p:eos[0]]), row[eos[0] + 1:eos[1]]
    answer = str(task.dataset[0]["answer"])
    observation = r.env.config().incorrect_text.format(answer=wrong)
    assert wrong != answer and len(wrong) == len(answer)
    assert tok.decode(obs_and_answer) == observation + answer
    trained = batch.loss_mask[0].tolist()  # label space: position t scores token t + 1
    n_obs = len(tok.encode(observation))
    assert [trained[t - 1] for t in range(p, len(row))] == (
        [True] * (eos[0] - p + 1) + [False] * n_obs + [True] * (len(row) - eos[0] - 1 - n_obs))
    assert not any(trained[: p - 1])


def test_a_warm_up_that_retries_needs_an_environment():
    r = load_recipe(RECIPE)
    assert r.problems(r.model.hf_config(), world_size=1) == []
    r = dataclasses.replace(r, env=dataclasses.replace(r.env, name="none", options={}))
    assert r.problems(r.model.hf_config(), world_size=1) == [
        "warmup.retry_prob=0.5 needs an environment (env.name) that answers the wrong first attempts of the "
        "warm-up's traces"]


@pytest.mark.slow
@pytest.mark.dist  # a pretrain_rl.py process
def test_the_recipe_runs_in_miniature(tmp_path):
    """Two iterations of the recipe, shrunk (a 20-step warm-up, 8 prompts x 4): the feedback environment
    answers wrong attempts (observations in the trajectories, more than one attempt on average), the
    first-attempt accuracy never exceeds the accuracy after feedback, and the credit per attempt is logged
    for the first three attempts."""
    run = tmp_path / "run"
    proc = run_pretrain_rl("--config", RECIPE, "--output-dir", run, "train.steps=2", "train.val_every=0",
                           "rollout.prompts_per_step=8", "rollout.n=4", "warmup.steps=20",
                           f"warmup.cache_dir={tmp_path / 'warmup'}", "logging.progress=false", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["accuracy/first_turn"] <= r["accuracy/mean"] <= 1.0
        assert 1.0 < r["rollout/turns_mean"] <= 3.0 and 0.0 < r["rollout/env_token_frac"] < 1.0
        assert r["env/errors"] == 0 and all(f"advantage/turn_{k}_abs_mean" in r for k in range(3))


def test_a_warm_up_needs_a_source_whose_task_writes_traces():
    from megatron_credit.recipe.config import recipe_from_dict
    from tests.support.runs import TINY

    data = os.path.join(ROOT, "examples", "data", "smollm2_add1.jsonl")
    r = recipe_from_dict(TINY, overrides=["data.source=dataset", f"data.train_path={data}"])
    assert [p for p in r.problems(r.model.hf_config(), world_size=1) if p.startswith("warmup.")] == [
        "warmup.steps > 0 needs a data.source whose task writes warm-up traces (['reasoning_gym', 'synthetic_arith', "
        "'synthetic_chain', 'synthetic_tool']), got 'dataset' (real runs start from a pretrained checkpoint)"]
