"""The recipe's ``env`` section: bad values are one line naming the field, at load (the section), in the
recipe's cross-section checks, and from the command line (exit 2, one ``error:`` line)."""
import pytest

from megatron_credit.recipe.config import recipe_from_dict
from tests.support.runs import run_pretrain_rl


@pytest.mark.parametrize("overrides,message", [
    (["env.name=calc"],
     r"env.name: unknown environment 'calc'; valid names: \['none', 'calculator', 'feedback', 'openenv'\]"),
    (["env.name=calculator", "env.options.timeout_s=-1"], r"env.options.timeout_s must be > 0, got -1"),
    (["env.name=calculator", "env.options.bogus=1"], r"unknown field\(s\) \['bogus'\] in env.options"),
    (["env.name=openenv"], r"env.options.env must name the OpenEnv environment as 'module:factory', got ''"),
    (["env.max_turns=0"], r"env.max_turns must be >= 1"),
    (["env.step_timeout_s=0"], r"env.step_timeout_s must be > 0"),
    (["env.options.workers=2"], r"env.options \['workers'\] given without an environment: set env.name"),
])
def test_bad_env_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict({}, overrides=overrides)


def _problems(overrides):
    r = recipe_from_dict({}, overrides=overrides)
    return r.problems(r.model.hf_config(), world_size=1)


def test_cross_section_checks():
    assert any("env.max_total_tokens=4 must be at least rollout.max_response_len=10" in p
               for p in _problems(["env.name=calculator", "env.max_total_tokens=4", "rollout.max_response_len=10"]))
    assert any("env.max_total_tokens (a trajectory's response) of 4096 tokens is longer than the model's "
               "max_position_embeddings" in p for p in _problems(["env.name=calculator", "env.max_total_tokens=4096"]))
    assert any("data.source=synthetic_tool" in p and "set env.name" in p for p in _problems(["data.source=synthetic_tool"]))
    assert not _problems(["env.name=calculator", "data.source=synthetic_tool", "env.max_total_tokens=40"])


@pytest.mark.dist  # a pretrain_rl.py process
def test_a_stop_text_of_several_tokens_is_one_line(tmp_path):
    """The calculator's ``</call>`` is several tokens under the addition task's tokenizer: refused at start-up."""
    proc = run_pretrain_rl("--config", "examples/demo_cpu.yaml", "--output-dir", tmp_path / "run", "env.name=calculator",
                           "env.max_total_tokens=40", "warmup.steps=0", "train.steps=1", timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "env.options: the environment's stop text '</call>' is" in errors[0] and "a single token of its own" in errors[0]
