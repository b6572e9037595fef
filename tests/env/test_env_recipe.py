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


BROKEN_ENV = '''
from megatron_credit.env import ENVIRONMENTS, Environment, StepResult


@ENVIRONMENTS.register("broken")
class Broken(Environment):
    def start(self, record):
        raise KeyError("ground_truth")

    def step(self, state, action):
        return StepResult(observation="", reward=0.0, done=True)
'''


@pytest.mark.dist
@pytest.mark.parametrize("mode", [[], ["rollout.mode=one_step_off", "rollout.ranks=1"]], ids=["sync", "one_step_off"])
def test_dynamic_sampling_that_the_environment_starved_stops_on_the_environments_line(tmp_path, mode):
    """An environment failing on every trajectory leaves no group with mixed accuracy: under DAPO's dynamic
    sampling the run stops on the environment's reason (summed over the engines: sync's, or the rollout pool's
    batch facts), not on the line that asks for more draws."""
    import yaml

    from tests.support.paths import ROOT

    with open(f"{ROOT}/examples/tool_calc_cpu.yaml") as f:
        recipe = yaml.safe_load(f)
    recipe["env"] = {"name": "broken", "max_turns": 3, "max_total_tokens": 40}
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    proc = run_pretrain_rl("--config", tmp_path / "broken.yaml", "--plugin", tmp_path / "broken_env.py",
                           "--output-dir", tmp_path / "run", "algorithm.name=dapo", "algorithm.dynamic_sampling=true",
                           "algorithm.max_draws=2", "train.steps=1", "warmup.steps=0", "train.val_every=0",
                           "rollout.prompts_per_step=4", "logging.progress=false", *mode, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]  # the user's to fix: exit 2
    assert errors[0] == ("error: dynamic sampling kept no group: the environment failed on every trajectory of "
                         "algorithm.max_draws=2 draws (64, ended by the abort rule and scored as wrong): environment "
                         "start raised KeyError: 'ground_truth'; fix the environment")
