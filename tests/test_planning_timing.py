"""The planner's time of one iteration and one save, and the Slurm warning lead (``planning/timing.py``)."""
from __future__ import annotations

import math
import os

import pytest

from megatron_credit.gpu_kinds import GPUS
from megatron_credit.planning.plan import Architecture, resolve_hf_config, total_param_count
from megatron_credit.planning.timing import GPU_SPEEDS, MARGIN, iteration_estimate
from megatron_credit.recipe.config import load_recipe
from tests.support.paths import ROOT


def _recipe(name, *overrides):
    recipe = load_recipe(os.path.join(ROOT, "examples", f"{name}.yaml"), overrides=list(overrides))
    return recipe, resolve_hf_config(recipe.model)


def test_every_gpu_kind_has_speeds():
    assert set(GPU_SPEEDS) == set(GPUS)


def test_the_save_is_weights_master_and_adam_over_the_nodes_disks_and_the_lead_covers_iteration_and_save():
    recipe, hf = _recipe("grpo_qwen25_7b")  # bf16, no critic, no reference
    params = total_param_count(Architecture.from_hf(hf))
    e = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=2e9)
    assert e.checkpoint_bytes == params * (2 + 4 + 8)
    assert e.save_s == pytest.approx(params * 14 / 2e9)
    assert e.lead_s == math.ceil((e.generation_s + e.training_s + e.save_s) * MARGIN / 60) * 60
    assert f"sbatch --signal=USR1@{e.lead_s}" in e.lines()[1]
    two = iteration_estimate(recipe, hf, nodes=2, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=2e9)
    assert two.save_s == pytest.approx(e.save_s / 2) and two.training_s == pytest.approx(e.training_s / 2)
    assert two.generation_s == pytest.approx(e.generation_s / 2, rel=0.05)  # the weights' reads do not halve


def test_longer_responses_a_separate_critic_and_slower_gpus_take_longer():
    recipe, hf = _recipe("grpo_qwen25_7b")
    base = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    longer = iteration_estimate(*_recipe("grpo_qwen25_7b", f"rollout.max_response_len={2 * recipe.rollout.max_response_len}"),
                                nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert longer.generation_s > 2 * base.generation_s and longer.training_s > 1.9 * base.training_s
    slower = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="a100-80gb")
    assert slower.training_s == pytest.approx(base.training_s * 989 / 312)
    ppo, ppo_hf = _recipe("ppo_qwen25_7b", "algorithm.params.critic=separate")
    separate = iteration_estimate(ppo, ppo_hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert separate.checkpoint_bytes == 2 * base.checkpoint_bytes


def test_bad_disk_bandwidth_and_gpu_are_refused():
    recipe, hf = _recipe("grpo_qwen25_7b")
    with pytest.raises(ValueError, match="disk bandwidth"):
        iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=0)
    with pytest.raises(ValueError, match="--gpu"):
        iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="v100")


def test_a_pool_generates_on_its_own_gpus_beside_the_trainer_and_the_slower_side_is_the_iteration():
    """The 32B async recipe on 8 x 8 H100: generation on the pool's 8 engines of TP 4, training on the other 32
    GPUs, the trainer's weight update (``planning.pool.update_seconds``); overlapped, the iteration is the
    slower side; at ``max_staleness: 0`` the two take turns."""
    from megatron_credit.planning.plan import DTYPE_BYTES, _dtype_name
    from megatron_credit.planning.pool import plan_pool
    from megatron_credit.planning.timing import generation_seconds

    recipe, hf = _recipe("fipo_qwen25_32b_async")
    e = iteration_estimate(recipe, hf, nodes=8, gpus_per_node=8, gpu="h100-80gb")
    a = Architecture.from_hf(hf)
    wb = DTYPE_BYTES[_dtype_name(recipe, hf)]
    assert e.generation_s == generation_seconds(recipe, a, engines=8, rtp=4, gpu="h100-80gb", dtype_bytes=wb)
    assert e.update_s == pytest.approx(plan_pool(recipe, hf, nodes=8, gpus_per_node=8, gpu="h100-80gb").update_s)
    sync, sync_hf = _recipe("fipo_qwen25_32b")  # the same model and batch: training on the same 32 GPUs
    s = iteration_estimate(sync, sync_hf, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    assert e.training_s == pytest.approx(s.training_s)
    assert e.overlapped and e.iteration_s == max(e.generation_s, e.training_s + e.update_s) == e.generation_s
    one_node = iteration_estimate(*_recipe("fipo_qwen25_32b_async", "rollout.ranks=8"), nodes=5, gpus_per_node=8,
                                  gpu="h100-80gb")
    assert one_node.generation_s > 3.9 * e.generation_s  # 8 engine GPUs instead of 32
    idle = 1 - (e.training_s + e.update_s) / e.generation_s
    assert e.balance().startswith(f"balance: the trainer waits {100 * idle:.0f}% of each iteration for the pool")
    assert e.lines()[0].startswith("one iteration (estimate): max(generation ")
    assert e.save_s == pytest.approx(s.save_s)  # the trainer's 4 nodes write, not the pool's
    assert e.lead_s == math.ceil((e.iteration_s + e.save_s) * MARGIN / 60) * 60
    turns = iteration_estimate(*_recipe("fipo_qwen25_32b_async", "rollout.max_staleness=0"),
                               nodes=8, gpus_per_node=8, gpu="h100-80gb")
    assert not turns.overlapped and turns.balance() == ""
    assert turns.iteration_s == pytest.approx(e.generation_s + e.training_s + e.update_s)
    fast = iteration_estimate(*_recipe("fipo_qwen25_32b_async", "rollout.ranks=64"),
                              nodes=12, gpus_per_node=8, gpu="h100-80gb")  # 16 engines: the pool outruns the trainer
    assert fast.generation_s < fast.training_s and fast.balance().startswith("balance: the pool waits ")


def test_the_run_counts_its_iterations_and_saves_and_the_disk_its_kept_checkpoints():
    recipe, hf = _recipe("grpo_qwen25_7b", "train.steps=25", "checkpoint.every=10", "checkpoint.keep=2")
    e = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert (e.steps, e.saves, e.keep) == (25, 3, 2)  # at 10, 20 and the end
    assert e.run_s == pytest.approx(25 * e.iteration_s + 3 * e.save_s)
    assert e.disk_bytes == 3 * e.checkpoint_bytes
    assert e.lines()[-1] == (f"the run (estimate): 25 iterations and 3 saves in {e.run_s / 3600:.1f} h; checkpoints on "
                             f"disk: up to {3 * e.checkpoint_bytes / 2**30:,.0f} GiB (2 kept + the one being written)")
    for overrides, saves in ((("checkpoint.every=0",), 1), (("checkpoint.every=5",), 5),
                             (("checkpoint.every=0", "checkpoint.save_at_end=false"), 0)):
        r, h = _recipe("grpo_qwen25_7b", "train.steps=25", *overrides)
        assert iteration_estimate(r, h, nodes=1, gpus_per_node=8, gpu="h100-80gb").saves == saves, overrides


def test_the_collective_timeout_must_be_twice_a_generation_phase_or_the_plan_refuses():
    """``sync``: ranks wait out each generation phase in their groups, so ``distributed.timeout_s`` has at least
    2x the planned generation, or the plan is refused in one line naming the value that would do; a pool's
    trainer waits on silence instead, and is not bound by it."""
    from megatron_credit.planning.report import collective_timeout_line

    recipe, hf = _recipe("fipo_qwen25_32b", "distributed.timeout_s=10800")
    e = iteration_estimate(recipe, hf, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    with pytest.raises(ValueError) as refused:
        collective_timeout_line(recipe, e)
    assert str(refused.value) == (f"distributed.timeout_s=10,800 is within 2x of one generation phase "
                                  f"({e.generation_s:,.0f} s estimated), which ranks wait out in their groups: set "
                                  "distributed.timeout_s=21600 or more")
    shipped, _ = _recipe("fipo_qwen25_32b")  # the recipe carries the 6 h it needs
    assert shipped.distributed.timeout_s == 21600
    assert collective_timeout_line(shipped, e).startswith("collective timeout: distributed.timeout_s=21,600 s, 2.1x")
    pool, pool_hf = _recipe("fipo_qwen25_32b_async")
    p = iteration_estimate(pool, pool_hf, nodes=8, gpus_per_node=8, gpu="h100-80gb")
    assert "on silence" in collective_timeout_line(pool, p)


def test_a_timeout_too_short_for_a_plan_that_fits_is_an_error_line_after_the_report(capsys):
    from megatron_credit.commands.plan import main

    path = os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml")
    assert main(["--config", path, "--skip-preflight", "distributed.timeout_s=10800"]) == 2
    out, err = capsys.readouterr()
    assert "verdict: FITS" in out and err.startswith("error: distributed.timeout_s=10,800 is within 2x")
    assert err.count("\n") == 1


def test_lora_training_skips_the_base_s_weight_gradients_by_hand():
    """The 32B LoRA recipe (full recompute, no KL, one epoch): per sequence, the old log-probs' forward, then
    forward, recompute and a backward of input gradients only for the frozen linears (one forward of them)
    and of both for attention (two of it): 4 forwards less one of the linears' FLOPs, against 4 in full."""
    from megatron_credit.planning.architecture import active_param_count
    from megatron_credit.planning.timing import TRAIN_MFU

    lora, hf = _recipe("fipo_qwen25_32b_lora")
    full, _ = _recipe("fipo_qwen25_32b_lora", "model.lora.rank=0")
    a = Architecture.from_hf(hf)
    seq = lora.data.max_prompt_len + lora.response_budget
    tokens = lora.rollout.prompts_per_step * lora.rollout.n * seq
    linears = 2 * active_param_count(a) * tokens
    attention = 2 * a.num_layers * seq * a.num_heads * a.head_dim * tokens
    forward = linears + attention
    rate = 8 * GPU_SPEEDS["h100-80gb"][0] * TRAIN_MFU
    e = iteration_estimate(lora, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    f = iteration_estimate(full, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert f.training_s == pytest.approx(5 * forward / rate, rel=1e-12)  # old log-probs + 4
    assert e.training_s == pytest.approx((5 * forward - linears) / rate, rel=1e-12)
    assert 0.8 < e.training_s / f.training_s < 0.85 and e.generation_s == f.generation_s
