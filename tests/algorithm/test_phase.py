"""CompPO's phase controller on scripted metric sequences (the paper's Table 14 / App. C.2)."""
import json
import math

import pytest

from megatron_credit.algorithm.phase import PHASE_TABLE, PHASES, PhaseController, PhaseSettings, PhaseThresholds

CALM = {"actor/entropy": 9.0, "actor/clipfrac_high": 0.01, "actor/clipfrac_low": 0.0, "actor/ppo_kl": 0.001,
        "actor/kl_ref": 0.1, "actor/grad_norm": 1.0, "response/truncated_frac": 0.0}
"""A step in which no signal requests anything (entropy above every level)."""


def run(controller, steps):
    return [controller.step(m) for m in steps]


def test_phase_table_is_the_papers():
    columns = {  # the paper's Table 14, column by column: stable, warning, strong, hard_stop
        "kl_coef": (0.0020, 0.0035, 0.0045, 0.0070), "clip": (0.20, 0.16, 0.14, 0.09),
        "actor_lr": (1e-6, 7e-7, 5e-7, 2e-7), "value_clip": (0.5, 0.4, 0.3, 0.2),
        "critic_lr_mult": (1.0, 0.9, 0.7, 0.5), "adv_clip": (5.0, 4.0, 3.5, 2.5),
        "grad_clip": (1.0, 0.8, 0.7, 0.5), "epochs": (2, 2, 2, 1),
    }
    assert tuple(PHASE_TABLE) == PHASES == ("stable", "warning", "strong", "hard_stop")
    for name, values in columns.items():
        assert tuple(getattr(PHASE_TABLE[p], name) for p in PHASES) == values, name
    assert isinstance(PHASE_TABLE["stable"], PhaseSettings)


# Every request row: (metrics on a fresh controller, the signal, the phase index it requests).
ROWS = [
    ({"actor/entropy": 8.0}, "entropy", 0), ({"actor/entropy": 7.99}, "entropy", 1),
    ({"actor/entropy": 7.5}, "entropy", 1), ({"actor/entropy": 7.49}, "entropy", 2),
    ({"actor/entropy": 6.5}, "entropy", 2), ({"actor/entropy": 6.49}, "entropy", 3),
    ({"actor/clipfrac_high": 0.13, "actor/clipfrac_low": 0.0}, "clipfrac", 0),
    ({"actor/clipfrac_high": 0.14}, "clipfrac", 1),
    ({"actor/clipfrac_high": 0.125, "actor/clipfrac_low": 0.0625}, "clipfrac", 2),  # the SUM 0.1875 counts
    ({"actor/clipfrac_low": 0.18}, "clipfrac", 2), ({"actor/clipfrac_high": 0.25}, "clipfrac", 3),
    ({"actor/ppo_kl": 0.0799}, "ppo_kl", 0), ({"actor/ppo_kl": 0.08}, "ppo_kl", 1),
    ({"actor/ppo_kl": 0.12}, "ppo_kl", 2), ({"actor/ppo_kl": 0.22}, "ppo_kl", 3),
    ({"actor/kl_ref": 2.84}, "kl_loss", 0), ({"actor/kl_ref": 2.85}, "kl_loss", 1),
    ({"actor/kl_ref": 3.2}, "kl_loss", 2), ({"actor/kl_ref": 4.0}, "kl_loss", 3),
    ({"actor/grad_norm": 39.9}, "grad_norm", 0), ({"actor/grad_norm": 40.0}, "grad_norm", 1),
    ({"actor/grad_norm": 80.0}, "grad_norm", 2), ({"actor/grad_norm": 1e9}, "grad_norm", 2),  # never hard-stop
    ({"response/truncated_frac": 0.64}, "truncated_frac", 0),
    ({"response/truncated_frac": 0.65}, "truncated_frac", 3),
]


@pytest.mark.parametrize("metrics,signal,level", ROWS)
def test_each_request_row(metrics, signal, level):
    c = PhaseController()
    requests = c.requests(metrics)
    assert requests[signal] == level
    assert all(v == 0 for k, v in requests.items() if k != signal)  # no other signal fires
    # and through step(): two consecutive such steps escalate iff something was requested
    assert run(PhaseController(), [metrics, metrics]) == ["stable", "warning" if level else "stable"]


@pytest.mark.parametrize("accuracies,level", [
    ([0.5, 0.47], 0), ([0.5, 0.46], 1), ([0.5, 0.42], 2), ([0.5, 0.3], 3),
    ([0.5, 0.625, 0.5625], 1),   # measured from the running best 0.625, not from the first 0.5
    ([0.625, 0.5, 0.5625], 1),   # a recovery below the best still counts as a drop
])
def test_validation_drop_from_running_best(accuracies, level):
    c = PhaseController()
    for acc in accuracies[:-1]:
        c.step({"val/accuracy": acc})
        c.step({})  # steps without validation leave the best alone
    assert c.requests({"val/accuracy": accuracies[-1]})["val_drop"] == level


def test_first_validation_requests_nothing():
    assert PhaseController().requests({"val/accuracy": 0.0})["val_drop"] == 0


@pytest.mark.parametrize("second,extra,level", [
    (10.5, {"actor/ppo_kl": 0.08}, 2),        # drop 1.5 with the PPO KL at warning -> strong
    (10.5, {"actor/clipfrac_high": 0.14}, 2),  # ... or the clip fraction at warning
    (9.0, {"actor/ppo_kl": 0.08}, 3),          # drop 3.0 -> hard-stop
    (9.0, {"actor/ppo_kl": 0.0799}, 0),        # neither in warning territory: the drop is not checked
    (9.0, {"actor/clipfrac_high": 0.1399}, 0),
    (9.0, {}, 0),
    (10.6, {"actor/ppo_kl": 0.08}, 0),         # drop 1.4: nothing
])
def test_entropy_drop_only_in_warning_territory(second, extra, level):
    c = PhaseController(entropy_ema=0.0)  # EMA = the raw value, so drops are exact
    c.step({"actor/entropy": 12.0})
    requests = c.requests({"actor/entropy": second, **extra})
    assert requests["entropy_drop"] == level
    assert requests["entropy"] == 0  # entropy itself stays above 8.0


def test_entropy_drop_is_from_the_highest_ema():
    c = PhaseController(entropy_ema=0.5)
    for e in (10.0, 14.0, 12.0):  # EMA 10, 12, 12: highest 12
        c.step({"actor/entropy": e})
    # EMA -> 0.5 * 12 + 0.5 * 9 = 10.5: a drop of exactly 1.5 from 12
    assert c.requests({"actor/entropy": 9.0, "actor/ppo_kl": 0.1})["entropy_drop"] == 2


def test_entropy_is_an_ema():
    c = PhaseController()  # decay 0.9, started at the first value
    ema = None
    for e, want in ((9.0, 0), (5.0, 0), (5.0, 0), (5.0, 1)):
        ema = e if ema is None else 0.9 * ema + 0.1 * e  # 9.0, 8.6, 8.24, 7.916
        assert c.requests({"actor/entropy": e})["entropy"] == want, ema
    assert c.state_dict()["entropy_ema"] == pytest.approx(ema, abs=1e-12)


def test_escalation_needs_two_consecutive_trigger_steps():
    hot = {**CALM, "actor/ppo_kl": 0.1}
    assert run(PhaseController(), [hot, CALM, hot, CALM, hot, {}, hot]) == ["stable"] * 7
    assert run(PhaseController(), [hot, hot]) == ["stable", "warning"]
    c = PhaseController()
    run(c, [hot, hot])
    # at warning, a warning request is neither a trigger nor clear: it resets the count
    assert run(c, [{**CALM, "actor/ppo_kl": 0.22}, hot, {**CALM, "actor/ppo_kl": 0.22}]) == ["warning"] * 3
    assert c.step({**CALM, "actor/ppo_kl": 0.22}) == "strong"


def test_escalate_after_is_a_parameter():
    hot = {"actor/ppo_kl": 0.1}
    assert run(PhaseController(escalate_after=3), [hot] * 3) == ["stable", "stable", "warning"]
    assert run(PhaseController(escalate_after=1), [hot]) == ["warning"]


def test_multi_step_escalation_to_hard_stop_one_phase_at_a_time():
    c = PhaseController()
    fire = {**CALM, "response/truncated_frac": 0.9}
    assert run(c, [fire] * 7) == ["stable", "warning", "warning", "strong", "strong", "hard_stop", "hard_stop"]
    assert c.settings == PHASE_TABLE["hard_stop"]
    assert c.last_requests["truncated_frac"] == 3


def test_deescalation_after_exactly_five_clear_steps():
    c = PhaseController()
    run(c, [{"actor/kl_ref": 3.5}] * 4)
    assert c.phase == "strong"
    warning_level = {**CALM, "actor/grad_norm": 50.0}
    strong_level = {**CALM, "actor/grad_norm": 90.0}
    assert run(c, [warning_level] * 4) == ["strong"] * 4
    assert c.step(strong_level) == "strong"  # resets the 4 clear steps
    assert run(c, [CALM] * 4) == ["strong"] * 4
    assert c.step(warning_level) == "warning"  # exactly the 5th consecutive clear step
    assert c.settings == PHASE_TABLE["warning"]
    assert run(c, [CALM] * 5) == ["warning"] * 4 + ["stable"]
    assert run(c, [CALM] * 6) == ["stable"] * 6  # never below stable
    assert run(PhaseController(deescalate_after=1), [{"actor/ppo_kl": 0.1}] * 2 + [CALM]) == [
        "stable", "warning", "stable"]


def test_a_trigger_interrupts_the_clear_count():
    c = PhaseController()
    run(c, [{"actor/ppo_kl": 0.1}] * 2)
    assert c.phase == "warning"
    assert run(c, [CALM] * 4 + [{"actor/ppo_kl": 0.15}] + [CALM] * 4) == ["warning"] * 9
    assert c.step(CALM) == "stable"


def test_missing_and_non_finite_metrics_are_not_checked():
    c = PhaseController()
    assert all(v == 0 for v in c.requests({}).values())
    assert all(v == 0 for v in c.requests({"actor/grad_norm": math.nan, "actor/ppo_kl": math.inf,
                                           "actor/entropy": math.nan}).values())
    assert c.state_dict()["entropy_ema"] is None  # a NaN entropy does not poison the EMA
    assert run(c, [{}] * 10) == ["stable"] * 10


def test_state_dict_round_trip_continues_identically():
    script = ([{**CALM, "actor/entropy": 12.0, "val/accuracy": 0.6}]
              + [{**CALM, "actor/ppo_kl": 0.13, "actor/entropy": 10.0 - i} for i in range(3)]
              + [{**CALM, "val/accuracy": 0.5}] * 2 + [CALM] * 7 + [{**CALM, "response/truncated_frac": 0.7}] * 3)
    whole = PhaseController()
    phases = run(whole, script)
    assert len(set(phases)) >= 3  # the script moves the phase up and down
    first = PhaseController()
    run(first, script[:5])
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON
    second = PhaseController()
    second.load_state_dict(state)
    assert second.state_dict() == first.state_dict()
    assert phases[:5] + run(second, script[5:]) == phases
    assert second.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="phase="):
        PhaseController().load_state_dict({**state, "phase": "panic"})


def test_thresholds_override_and_validation():
    th = PhaseThresholds(ppo_kl=[0.01, 0.02, None], grad_norm=(10, 20, 30))  # YAML lists accepted
    assert th.ppo_kl == (0.01, 0.02, None) and th.grad_norm == (10.0, 20.0, 30.0)
    c = PhaseController(th)
    assert c.requests({"actor/ppo_kl": 5.0})["ppo_kl"] == 2
    assert c.requests({"actor/grad_norm": 30.0})["grad_norm"] == 3
    with pytest.raises(ValueError, match="thresholds.clipfrac"):
        PhaseThresholds(clipfrac=(0.3, 0.2, 0.1))
    with pytest.raises(ValueError, match="thresholds.entropy_below"):
        PhaseThresholds(entropy_below=(6.0, 7.0, 8.0))
    with pytest.raises(ValueError, match="thresholds.kl_loss"):
        PhaseThresholds(kl_loss=(1.0, 2.0))
    for kwargs, field in (({"entropy_ema": 1.0}, "entropy_ema"), ({"escalate_after": 0}, "escalate_after"),
                          ({"deescalate_after": 0}, "deescalate_after")):
        with pytest.raises(ValueError, match=field):
            PhaseController(**kwargs)


# ------------------------------------------------------------------- mutation killers
def test_a_fresh_controller_has_an_empty_history():
    c = PhaseController()
    assert c.last_requests == {}
    assert c.state_dict() == {"phase": "stable", "events": 0, "clear": 0, "entropy_ema": None,
                              "entropy_ema_max": None, "val_best": None}


@pytest.mark.parametrize("name", ["escalate_after", "deescalate_after"])
def test_bad_hysteresis_counts_are_named(name):
    with pytest.raises(ValueError, match=rf"^phase {name} must be >= 1, got 0$"):
        PhaseController(**{name: 0})


def test_a_threshold_is_reached_at_exactly_its_tolerance():
    from megatron_credit.algorithm.phase import REACH_TOL

    th = PhaseThresholds(entropy_below=(None, None, None), grad_norm=(2.0, None, None))
    c = PhaseController(th)
    assert c.requests({"actor/grad_norm": 2.0 - REACH_TOL})["grad_norm"] == 1
    assert c.requests({"actor/grad_norm": 2.0 - 2 * REACH_TOL})["grad_norm"] == 0


def test_a_step_without_a_signal_requests_nothing_for_it():
    # The entropy EMA is kept across steps, but a step that reports no entropy (or no clip fraction) must
    # not be judged on an older value (or on a clip fraction of 0 it never reported).
    th = PhaseThresholds(entropy_below=(2.0, None, None), clipfrac=(0.0, None, None))
    c = PhaseController(th)
    assert c.requests({"actor/entropy": 1.0, "actor/clipfrac_high": 0.0})["entropy"] == 1
    assert c.requests({"actor/grad_norm": 0.1}) == {k: 0 for k in c.requests({})}
    assert c.requests({"actor/clipfrac_low": 0.0})["clipfrac"] == 1  # a reported 0 does reach a 0 threshold


@pytest.mark.parametrize("signal,key", [("clipfrac", "actor/clipfrac_high"), ("ppo_kl", "actor/ppo_kl")])
def test_the_entropy_drop_is_judged_only_past_the_warning_threshold_itself(signal, key):
    # entropy_drop counts while clip fraction or PPO KL is at or above its *warning* threshold: a signal
    # whose warning level is off (None) never opens it, even when its strong level is reached.
    th = PhaseThresholds(entropy_below=(None, None, None), entropy_drop=(0.1, None, None),
                         **{signal: (None, 0.3, None)})
    c = PhaseController(th)
    c.requests({"actor/entropy": 1.0, key: 0.35})
    r = c.requests({"actor/entropy": 0.0, key: 0.35})  # EMA 0.9: a drop of 0.1 from its best
    assert r["entropy_drop"] == 0 and r[signal] == 2
    opened = PhaseController(PhaseThresholds(entropy_below=(None, None, None), entropy_drop=(0.1, None, None),
                                             **{signal: (0.3, 0.3, None)}))
    opened.requests({"actor/entropy": 1.0, key: 0.35})
    assert opened.requests({"actor/entropy": 0.0, key: 0.35})["entropy_drop"] == 1


def test_threshold_order_errors_say_which_way():
    with pytest.raises(ValueError, match=r"^phase thresholds\.clipfrac must be non-decreasing, got \(0\.3, 0\.2, 0\.1\)$"):
        PhaseThresholds(clipfrac=(0.3, 0.2, 0.1))
    with pytest.raises(ValueError, match=r"^phase thresholds\.entropy_below must be non-increasing, got \(6\.0, 7\.0, 8\.0\)$"):
        PhaseThresholds(entropy_below=(6.0, 7.0, 8.0))
