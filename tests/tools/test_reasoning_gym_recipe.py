"""``examples/reasoning_gym_feedback_cpu.yaml``: a reasoning-gym task with the feedback environment on
SmolLM2-135M-Instruct. The recipe loads; with SmolLM2's tokenizer its prompts fit, and its environment
reads a chat attempt (ended by ``<|im_end|>``) as the verifier does."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is the test extra's (pip install -e '.[test]')")

from megatron_credit.recipe.config import load_recipe  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

RECIPE = os.path.join(ROOT, "examples", "reasoning_gym_feedback_cpu.yaml")


def test_the_recipe_loads():
    r = load_recipe(RECIPE)
    assert (r.data.source, r.data.options["task"], r.env.name, r.env.max_turns) == (
        "reasoning_gym", "basic_arithmetic", "feedback", 3)
    env = r.env.config()
    assert env.end_texts == ("<|im_end|>",) and r.data.options["answer_tag"] is None
    assert os.access(os.path.join(ROOT, "examples", "reasoning_gym_feedback_cpu.sh"), os.X_OK)


def test_its_prompts_fit_and_its_env_reads_smollm2_attempts(smollm2_dir):
    from megatron_credit.data.setup import build_data
    from megatron_credit.env import build_environment

    r = load_recipe(RECIPE)
    d = dataclasses.replace(r.data, tokenizer_path=str(smollm2_dir))
    tok, stream, val, _ = build_data(d, seed=r.seed, model_path=None, val_every=1, val_prompts=8)
    recs = stream.take(16)
    assert all(len(x.prompt_ids) <= d.max_prompt_len for x in recs + val)
    assert tok.decode(list(recs[0].prompt_ids)).endswith("<|im_end|>\n<|im_start|>assistant\n")
    env = build_environment(r.env.name, r.env.options)
    answer = json.loads(recs[0].ground_truth)["answer"]
    state = env.start(recs[0])
    assert env.step(state, f" {answer}<|im_end|>").done  # the attempt without its EOS is the answer
    obs = env.step(state, f"{int(answer) + 1}<|im_end|>").observation
    assert obs.startswith("\n<|im_start|>user\nWrong. Reply with the number only.<|im_end|>")
    assert tok.encode(obs, add_special_tokens=False)[1] == tok.convert_tokens_to_ids("<|im_start|>")
