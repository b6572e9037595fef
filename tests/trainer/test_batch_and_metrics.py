"""The trainer's pure modules against loops: ``batch/train_batch.py`` (label space, the GAE reward position,
global denominators, micro-batch cut / pad / CP split) and ``metrics/`` (sums, minima and
maxima across micro-batches, the documented metrics from them, ``metrics.jsonl`` and its truncation on
resume). No process groups: these run inside ``make mutation`` too."""
from __future__ import annotations

import json
import math
import types

import pytest
import torch

from megatron_credit.batch.train_batch import (TOKEN_FIELDS, make_microbatch, round_up, step_denominators,
                                           train_batch_from_rollout)
from megatron_credit.metrics.sums import StatSums, finalize
from megatron_credit.metrics.writer import MetricsWriter, read_metrics, truncate_metrics

PAD = 3
CPU = torch.device("cpu")


def _padded(seed=0, b=5, t=9):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4, (b,), generator=g)
    resp = torch.randint(0, 5, (b,), generator=g)
    resp[1] = 0  # a row without a response token
    ids = torch.full((b, t), PAD, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    logp = torch.zeros(b, t)
    for i in range(b):
        n = int(prompt[i] + resp[i])
        ids[i, :n] = torch.randint(10, 50, (n,), generator=g)
        mask[i, int(prompt[i]):n] = True
        logp[i, int(prompt[i]):n] = -torch.rand(int(resp[i]), generator=g)
    return types.SimpleNamespace(input_ids=ids, response_mask=mask, rollout_logprobs=logp, prompt_lens=prompt,
                                 response_lens=resp, group_ids=torch.arange(b) // 2)


def _batch(seed=0, b=5, t=9):
    p = _padded(seed, b, t)
    rewards = torch.linspace(-1.0, 1.0, b, dtype=torch.float64)
    return p, train_batch_from_rollout(p, rewards=rewards, correct=rewards > 0, pad_id=PAD)


def test_train_batch_is_in_label_space():
    p, tb = _batch()
    b, t = p.input_ids.shape
    for i in range(b):
        for j in range(t):
            nxt = j + 1 < t
            assert tb.labels[i, j] == (p.input_ids[i, j + 1] if nxt else PAD)
            assert bool(tb.loss_mask[i, j]) == (bool(p.response_mask[i, j + 1]) if nxt else False)
            assert tb.rollout_logp[i, j] == (p.rollout_logprobs[i, j + 1] if nxt else 0.0)
    assert torch.equal(tb.input_ids, p.input_ids) and torch.equal(tb.group_ids, p.group_ids)
    assert tb.seq_lens.tolist() == [int(a + r) for a, r in zip(p.prompt_lens, p.response_lens)]
    assert tb.rewards.dtype == torch.float32 and tb.correct.dtype == torch.bool and tb.size == b
    assert tb.correct.tolist() == [r > 0 for r in torch.linspace(-1.0, 1.0, b).tolist()]
    assert tb.loss_mask.sum() == p.response_mask.sum()  # every response token is scored exactly once
    for name in ("labels", "loss_mask", "rollout_logp"):  # shifted, not grown
        assert getattr(tb, name).shape == p.input_ids.shape, name


def test_token_rewards_sit_on_the_position_scoring_the_last_token():
    p, tb = _batch(seed=1)
    out = tb.token_rewards()
    ref = torch.zeros(out.shape)
    for i in range(tb.size):
        scored = [j for j in range(out.shape[1]) if tb.loss_mask[i, j]]
        if scored:
            ref[i, scored[-1]] = float(tb.rewards[i])
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert out[1].abs().sum() == 0 and int((out != 0).sum()) >= 3  # row 1 has no response; others do


def test_step_denominators_count_tokens_rows_and_each_rows_tokens():
    _, tb = _batch(seed=2, b=6)
    den = step_denominators(tb.loss_mask, norm_length=7, device=CPU)
    assert float(den.global_num_tokens) == float(tb.loss_mask.sum()) and float(den.global_num_seqs) == 6.0
    assert den.global_num_tokens.dtype == torch.float32 and den.norm_length == 7
    kw = den.for_rows(tb.loss_mask[2:5])
    assert kw["seq_num_tokens"].tolist() == [int(tb.loss_mask[i].sum()) for i in range(2, 5)]
    assert kw["global_num_tokens"] is den.global_num_tokens and kw["global_num_seqs"] is den.global_num_seqs
    assert kw["norm_length"] == 7 and set(kw) == {"global_num_tokens", "global_num_seqs", "norm_length",
                                                  "seq_num_tokens"}


def _with_fields(tb, k=3):
    g = torch.Generator().manual_seed(5)
    b, t = tb.input_ids.shape
    tb.old_logp = -torch.rand(b, t, generator=g)
    tb.advantages = torch.randn(b, t, generator=g)
    tb.extras = {"topk_idx": torch.randint(0, t, (b, t, k), generator=g),  # side channels of [B, T, K]
                 "topk_w": torch.rand(b, t, k, generator=g)}
    tb.routed_experts = torch.randint(0, 4, (b, t, 2, 2), generator=g, dtype=torch.int16)  # [B, T, layers, top-k]
    return tb


@pytest.mark.parametrize("seq_len", [6, 7, 12])  # cut (rows are 9 long; odd lengths need no CP) and padded
def test_make_microbatch_cuts_pads_and_fills_like_a_loop(seq_len):
    _, tb = _batch(seed=3, b=6)
    tb = _with_fields(tb)
    rows, num_rows = [4, 0, 2], 5
    mb = make_microbatch(tb, rows, seq_len=seq_len, num_rows=num_rows, pad_id=PAD, device=CPU)
    assert mb.rows == (4, 0, 2) and mb.num_rows == num_rows and mb.seq_len == seq_len
    assert set(mb.tensors) == ({f for f in TOKEN_FIELDS if getattr(tb, f) is not None} | set(tb.extras)
                               | {"routed_experts"})
    for name, t in mb.tensors.items():
        src = tb.extras[name] if name in tb.extras else getattr(tb, name)
        fill = PAD if name in ("input_ids", "labels") else -1 if name == "routed_experts" else 0
        assert t.shape[:2] == (num_rows, seq_len) and t.shape[2:] == src.shape[2:] and t.dtype == src.dtype, name
        for i in range(num_rows):
            for j in range(seq_len):
                want = src[rows[i], j] if i < len(rows) and j < src.shape[1] else torch.full_like(src[0, 0], fill)
                assert torch.equal(t[i, j], want), (name, i, j)
    assert torch.equal(mb.whole_loss_mask, mb.tensors["loss_mask"])
    assert mb.position_ids.shape == (num_rows, seq_len) and all(mb.position_ids[i].tolist() == list(range(seq_len))
                                                                 for i in range(num_rows))
    assert mb.position_ids.dtype == torch.long
    scored = [j for j in range(seq_len) if mb.whole_loss_mask[:, j].any()]
    assert mb.query_start == (scored[0] if scored else seq_len)


def test_make_microbatch_splits_for_context_parallelism_in_the_load_balanced_chunk_order():
    _, tb = _batch(seed=4, b=4)
    tb = _with_fields(tb)
    whole = make_microbatch(tb, [0, 1, 3], seq_len=12, num_rows=3, pad_id=PAD, device=CPU)
    # cp = 2: 4 chunks of 3; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    for rank, chunks in ((0, (0, 3)), (1, (1, 2))):
        pos = [c * 3 + i for c in chunks for i in range(3)]
        mb = make_microbatch(tb, [0, 1, 3], seq_len=12, num_rows=3, pad_id=PAD, device=CPU, cp_size=2, cp_rank=rank)
        assert mb.seq_len == 12 and torch.equal(mb.whole_loss_mask, whole.tensors["loss_mask"])
        assert mb.position_ids.tolist() == [pos] * 3
        for name, t in mb.tensors.items():
            assert torch.equal(t, whole.tensors[name][:, pos]), name
        assert mb.query_start == whole.query_start  # computed from the whole rows on every rank
        assert mb.position_ids.dtype == torch.long
    default = make_microbatch(tb, [0, 1, 3], seq_len=12, num_rows=3, pad_id=PAD, device=CPU, cp_size=2)  # cp_rank 0
    assert default.position_ids[0].tolist() == [0, 1, 2, 9, 10, 11]


def test_a_micro_batch_of_padding_rows_only():
    # (uniform pipeline shapes): no rows of the batch, every position padding and masked
    _, tb = _batch(seed=6)
    mb = make_microbatch(tb, [], seq_len=4, num_rows=2, pad_id=PAD, device=CPU)
    assert mb.rows == () and mb.tensors["input_ids"].tolist() == [[PAD] * 4] * 2
    assert not mb.tensors["loss_mask"].any() and mb.query_start == 4


def test_query_start_without_scored_tokens_is_the_length():
    _, tb = _batch(seed=0)
    mb = make_microbatch(tb, [1], seq_len=8, num_rows=2, pad_id=PAD, device=CPU)  # row 1 has no response token
    assert not mb.whole_loss_mask.any() and mb.query_start == 8


def test_round_up():
    assert [round_up(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 4, 4, 4, 8, 8, 12]
    assert round_up(7, 1) == 7 and round_up(13, 13) == 13 and round_up(14, 13) == 26


# --- metrics --------------------------------------------------------------------------------------------

def test_stat_sums_add_sums_minima_maxima_and_ignore_nan_extremes():
    s = StatSums()
    s.add({"sum:a": torch.tensor(1.5), "min:x": torch.tensor(2.0), "max:x": torch.tensor(-1.0)})
    s.add({"sum:a": 2, "min:x": torch.tensor(math.nan), "max:x": torch.tensor(math.nan)})
    s.add({"sum:a": torch.tensor([0.25]), "min:x": torch.tensor(-3.0), "max:x": torch.tensor(4.0)})
    s.add({"sum:a": 0.0, "min:x": torch.tensor(5.0), "max:x": torch.tensor(-5.0)})
    assert float(s.values["sum:a"]) == 3.75 and s.values["sum:a"].dtype == torch.float64
    assert s.values["sum:a"].shape == () and float(s.values["min:x"]) == -3.0 and float(s.values["max:x"]) == 4.0
    first = StatSums()
    first.add({"min:y": torch.tensor(math.nan)})
    first.add({"min:y": torch.tensor(7.0)})
    assert float(first.values["min:y"]) == 7.0  # a NaN first value does not stick either
    assert float(s.get("sum:a")) == 3.75 and float(s.get("sum:missing")) == 0.0 and float(s.get("m", 2.5)) == 2.5
    assert s.get("m").dtype == torch.float64


def test_stat_sums_are_copies_and_merge_keeps_replicated_keys():
    v = torch.tensor(1.0, dtype=torch.float64)
    s = StatSums()
    s.add({"sum:a": v})
    s.add({"sum:a": torch.tensor(2.0)})
    assert float(v) == 1.0  # the caller's tensor is not accumulated into
    s.add({"sum:grad_norm": torch.tensor(0.5)}, replicated=True)
    other = StatSums()
    other.add({"sum:a": torch.tensor(4.0), "sum:b": torch.tensor(1.0)})
    other.add({"sum:grad_norm": torch.tensor(0.25), "sum:critic_norm": torch.tensor(0.5)}, replicated=True)
    s.merge(other)
    assert {k: float(x) for k, x in s.values.items()} == {"sum:a": 7.0, "sum:grad_norm": 0.75, "sum:b": 1.0,
                                                          "sum:critic_norm": 0.5}
    assert s.replicated == {"sum:grad_norm", "sum:critic_norm"}  # replicated keys stay so through a merge
    s.all_reduce(None, device=CPU)  # no group: nothing changes
    assert float(s.values["sum:a"]) == 7.0


def test_finalize_turns_sums_into_the_documented_metrics():
    s = StatSums()
    w = torch.tensor([1.0, 1.1, 1.2, 1.2, 1.05], dtype=torch.float64)
    ret = torch.tensor([0.5, -0.5, 1.0, 0.0, 0.25], dtype=torch.float64)  # variance 0.25 (not 1)
    resid = torch.tensor([0.1, -0.2, 0.3, 0.0, -0.1], dtype=torch.float64)
    s.add({"sum:tokens": 5.0, "sum:pg_loss": 0.6, "sum:opt_steps": 2.0, "sum:entropy": 2.5, "sum:approx_kl": 0.05,
           "sum:fipo_weight/mean": w.sum(), "sum:fipo_weight/dev_sq": ((w - 1) ** 2).sum(),
           "min:fipo_weight/min": torch.tensor(1.0), "max:fipo_weight/max": torch.tensor(math.inf),
           "min:first_minibatch/fipo_weight/min": torch.tensor(0.99, dtype=torch.float64),
           "max:first_minibatch/fipo_weight/max": torch.tensor(1.03, dtype=torch.float64),
           "sum:skipped_steps": 1.0, "sum:ret": ret.sum(), "sum:ret2": (ret * ret).sum(),
           "sum:resid": resid.sum(), "sum:resid2": (resid * resid).sum(),
           "sum:rank_avg/critic/corr": 1.5, "sum:rank_avg_count": 2.0, "sum:gate": 0.0})
    out = finalize(s)
    assert out["actor/pg_loss"] == pytest.approx(0.3) and out["actor/entropy"] == pytest.approx(0.5)
    assert out["actor/ppo_kl"] == pytest.approx(0.01) and out["fipo/weight_mean"] == pytest.approx(float(w.mean()))
    assert out["fipo/weight_std"] == pytest.approx(float(w.std(unbiased=False)), rel=1e-9)
    assert out["fipo/weight_min"] == 1.0 and "fipo/weight_max" not in out  # a non-finite extreme is left out
    assert out["fipo/first_minibatch_max_abs_dev"] == pytest.approx(0.03)  # the larger of 1.03 - 1, 1 - 0.99
    assert out["actor/skipped_steps"] == 1.0 and out["critic/corr"] == 0.75
    assert out["critic/explained_var"] == pytest.approx(float(1 - resid.var(unbiased=False) / ret.var(unbiased=False)))
    assert "comppo/gate_mean" not in out and "critic/value_loss" not in out  # a missing denominator: no metric
    assert finalize(StatSums()) == {}


def test_finalize_guards_zero_denominators():
    s = StatSums()
    s.add({"sum:tokens": 0.0, "sum:entropy": 0.0, "sum:fipo_weight/mean": 0.0, "sum:fipo_weight/dev_sq": 0.0,
           "min:first_minibatch/fipo_weight/min": torch.tensor(math.nan),
           "max:first_minibatch/fipo_weight/max": torch.tensor(1.0)})
    out = finalize(s)
    assert out["actor/entropy"] == 0.0 and out["fipo/weight_std"] == 0.0
    assert "fipo/first_minibatch_max_abs_dev" not in out  # NaN: no valid token
    one = StatSums()
    one.add({"sum:fipo_weight/mean": 1.1, "sum:fipo_weight/dev_sq": 0.01, "sum:tokens": 1.0})  # 0.01 < (1.1 - 1)**2
    assert finalize(one)["fipo/weight_std"] == 0.0  # rounding below 0 is clamped, never NaN
    partial = StatSums()  # a mean without the second moment: no std (and no error)
    partial.add({"sum:fipo_weight/mean": 2.0, "sum:tokens": 2.0, "sum:rank_avg/critic/corr": 0.4,
                 "sum:rank_avg_count": 1.0, "sum:ret": 2.0, "sum:ret2": 4.0, "sum:resid": 0.5, "sum:resid2": 0.25})
    out = finalize(partial)
    assert "fipo/weight_std" not in out and out["fipo/weight_mean"] == 1.0 and out["critic/corr"] == 0.4
    # one scored token: both variances are 0 (its own mean), explained variance 1 - 0 / 1e-12 = 1
    single = StatSums()
    single.add({"sum:tokens": 1.0, "sum:ret": 2.0, "sum:ret2": 4.0, "sum:resid": 0.5, "sum:resid2": 0.25})
    assert finalize(single)["critic/explained_var"] == 1.0


def test_metrics_jsonl_rows_truncation_and_resume(tmp_path):
    run = str(tmp_path)
    w = MetricsWriter(run, resume_step=None, tensorboard=False, wandb_project=None, config={})
    for step in (1, 2, 3, 4):
        w.write(step, {"b": torch.tensor(float(step)), "a": math.nan if step == 2 else 0.5, "c": math.inf})
    w.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert rows[1] == {"step": 2, "a": None, "b": 2.0, "c": None}
    assert list(rows[0]) == ["step", "a", "b", "c"]  # step first, then sorted names
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "a": 0.\n\n')  # a line cut by a crash, and a blank one
    MetricsWriter(run, resume_step=2, tensorboard=False, wandb_project=None, config={})
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    MetricsWriter(run, resume_step=None, tensorboard=False, wandb_project=None, config={})  # a new run
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    missing = tmp_path / "sub"
    missing.mkdir()
    truncate_metrics(str(missing / "metrics.jsonl"), after_step=3)  # nothing to resume: an empty file
    assert (missing / "metrics.jsonl").read_text() == ""
    (missing / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s}) for s in (1, 3, 4)) + "\n\nnot json\n"
                                           + json.dumps({"step": 2}) + "\n")
    truncate_metrics(str(missing / "metrics.jsonl"), after_step=3)
    # unreadable lines are dropped, the lines after them kept
    assert [r["step"] for r in read_metrics(str(missing / "metrics.jsonl"))] == [1, 3, 2]
    assert not (missing / "metrics.jsonl.tmp").exists()


def test_tensorboard_gets_the_finite_scalars_and_plots_one_png_per_group_with_data(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_credit.trainer.plots import plot_metrics

    w = MetricsWriter(str(tmp_path), resume_step=None, tensorboard=True, wandb_project=None, config={})
    for step in (1, 2, 3):
        w.write(step, {"reward/mean": 0.1 * step, "actor/entropy": math.nan if step == 2 else 1.0 / step})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["actor/entropy", "reward/mean"]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.step for e in acc.Scalars("actor/entropy")] == [1, 3]  # NaN is not written
    written = plot_metrics(str(tmp_path))
    assert written == [str(tmp_path / "plots" / "reward.png"), str(tmp_path / "plots" / "entropy.png")]
    assert all((tmp_path / "plots" / f).stat().st_size > 1000 for f in ("reward.png", "entropy.png"))


def test_plots_draw_each_metric_against_its_steps_and_can_be_redrawn(tmp_path, monkeypatch):
    import matplotlib.figure

    from megatron_credit.trainer.plots import plot_metrics

    w = MetricsWriter(str(tmp_path), resume_step=None, tensorboard=False, wandb_project=None, config={})
    for step in (2, 4, 6):
        w.write(step, {"reward/mean": 0.5 * step, "accuracy/mean": None if step == 4 else 0.1 * step})
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    assert plot_metrics(str(tmp_path)) == [str(tmp_path / "plots" / "reward.png")]
    reward, accuracy = figures[0].axes  # one quantity per axis: reward and accuracy apart
    lines = [{ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines} for ax in (reward, accuracy)]
    assert lines == [{"reward of the training samples": ([2, 4, 6], [1.0, 2.0, 3.0])},
                     {"sampled, training prompts": ([2, 6], [0.2, 0.6000000000000001])}]
    assert [t.get_text() for t in accuracy.get_legend().get_texts()] == ["sampled, training prompts"]
    assert accuracy.get_xlabel() == "RL iteration" and accuracy.get_ylim() == (-0.02, 1.02)
    assert plot_metrics(str(tmp_path)) == [str(tmp_path / "plots" / "reward.png")]  # again (tools/plot_metrics.py)


def test_wandb_gets_the_run_and_every_row_and_a_missing_tensorboard_is_said(tmp_path, monkeypatch):
    import sys

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", dict(metrics), step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed: the import fails
    said = []
    w = MetricsWriter(str(tmp_path), resume_step=None, tensorboard=True, wandb_project="proj", config={"seed": 3},
                      log=said.append)
    w.write(7, {"reward/mean": 0.25})
    w.close()
    assert said == ["tensorboard is not installed: no event files (pip install tensorboard)"]
    assert w.tb is None and not (tmp_path / "tensorboard").exists()
    assert calls == [("init", {"project": "proj", "config": {"seed": 3}, "dir": str(tmp_path), "resume": "allow"}),
                     ("log", {"reward/mean": 0.25}, 7), ("finish",)]


def test_plot_look_640x360_px_dots_on_short_series_only_faint_grid_small_legend(tmp_path, monkeypatch):
    import matplotlib.figure
    import matplotlib.image

    from megatron_credit.trainer.plots import plot_metrics

    w = MetricsWriter(str(tmp_path), resume_step=None, tensorboard=False, wandb_project=None, config={})
    for step in range(1, 41):  # 40 points of the reward, 39 of the entropy
        w.write(step, {"reward/mean": 0.01 * step, "actor/entropy": None if step == 1 else 1.0 / step})
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    reward, entropy = plot_metrics(str(tmp_path))
    assert matplotlib.image.imread(entropy).shape[:2] == (360, 640)  # one panel: 6.4 x (1.1 + 2.5) inches, 100 dpi
    assert matplotlib.image.imread(reward).shape[:2] == (360, 640)  # reward only: its accuracy panel has no data
    (r_line,), (e_line,) = figures[0].axes[0].lines, figures[1].axes[0].lines
    assert r_line.get_marker() in ("None", None, "") and e_line.get_marker() == "."  # dots below 40 points
    ax = figures[1].axes[0]
    assert {t.get_fontsize() for t in ax.get_legend().get_texts()} == {8.0}
    assert all(g.get_visible() and g.get_alpha() == 0.3 for g in ax.get_xgridlines())


# ---------------------------------------------------------- reductions over DP groups, ranks as threads
def _reductions_over_pairs():
    """Ranks {0, 1} and {2, 3} of 4 threads: each pair reduces its own stats and denominators."""
    import torch.distributed as dist

    from megatron_credit.batch.microbatch import max_count_across_ranks
    from tests.support.distributed_harness import block_subgroup

    group, _ = block_subgroup(2)
    rank = dist.get_rank()
    s = StatSums()
    s.add({"sum:tokens": torch.tensor(float(rank + 1)), "min:x": torch.tensor(float(10 - rank)),
           "max:x": torch.tensor(float(rank * rank)),
           "min:nan_on_0": torch.tensor(math.nan if rank % 2 == 0 else 5.0 + rank),
           "max:nan_on_0": torch.tensor(math.nan if rank % 2 == 0 else 5.0 + rank)})
    s.add({"sum:grad_norm": torch.tensor(3.0)}, replicated=True)
    s.all_reduce(group, device=CPU)
    only_extremes = StatSums()  # no sum to reduce: the min / max are still reduced
    only_extremes.add({"sum:opt_steps": torch.tensor(1.0)}, replicated=True)
    only_extremes.add({"min:y": torch.tensor(float(rank))})
    only_extremes.all_reduce(group, device=CPU)
    nan_sum = StatSums()
    nan_sum.add({"sum:nan": torch.tensor(math.nan if rank == 0 else 1.0)})
    nan_sum.all_reduce(group, device=CPU)
    counts = max_count_across_ranks(rank + 1, group=group)
    mask = torch.zeros(rank + 1, 5, dtype=torch.bool)
    mask[:, : rank + 2] = True
    den = step_denominators(mask, norm_length=7, device=CPU, dp_group=group)
    return ({k: float(v) for k, v in s.values.items()},
            (float(den.global_num_tokens), float(den.global_num_seqs), den.norm_length),
            {**{k: float(v) for k, v in only_extremes.values.items()}, "sum:nan": float(nan_sum.values["sum:nan"])},
            counts)


def test_stat_sums_and_step_denominators_reduce_over_their_group_only():
    from tests.support.threaded_harness import ThreadedPool

    out = ThreadedPool(world_size=4).run(_reductions_over_pairs)
    for rank, (stats, den, extremes, counts) in enumerate(out):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert extremes["min:y"] == pair[0] and extremes["sum:opt_steps"] == 1.0
        assert math.isnan(extremes["sum:nan"]) == (pair[0] == 0)  # a NaN sum stays NaN (never -inf)
        assert counts == pair[1] + 1  # the micro-batch count's max over the DP group only
        assert stats["sum:tokens"] == sum(r + 1 for r in pair)
        assert stats["min:x"] == min(10 - r for r in pair) and stats["max:x"] == max(r * r for r in pair)
        assert stats["min:nan_on_0"] == stats["max:nan_on_0"] == 5.0 + pair[1]  # NaN never wins
        assert stats["sum:grad_norm"] == 3.0  # replicated: not summed over ranks
        # tokens: rank r has r + 1 rows of r + 2 valid tokens; rows: r + 1
        assert den == (sum((r + 1) * (r + 2) for r in pair), sum(r + 1 for r in pair), 7)


def test_a_separate_critics_skipped_steps_are_reported():
    s = StatSums()
    s.add({"sum:skipped_steps": torch.tensor(1.0), "sum:critic_skipped_steps": torch.tensor(2.0)}, replicated=True)
    out = finalize(s)
    assert out["actor/skipped_steps"] == 1.0 and out["critic/skipped_steps"] == 2.0
    assert "critic/skipped_steps" not in finalize(StatSums())


def _token_count_past_float32():
    # 2^24 + 1 response tokens on each of 3 DP ranks (a 1024 x 20K-token step is past 2^24 tokens).
    mask = torch.ones(1, 2**24 + 1, dtype=torch.bool)
    return float(step_denominators(mask, norm_length=1, device=CPU, dp_group=torch.distributed.group.WORLD).global_num_tokens)


def test_step_token_count_is_summed_over_dp_before_rounding_to_float32():
    # The exact sum 3 * 2^24 + 3 rounds once, to 3 * 2^24 + 4 (float32's spacing there is 4). Summing
    # counts already rounded to float32 (2^24 each) would give 3 * 2^24: 4 tokens lost, i.e. a different
    # token-mean loss scale on every rank.
    from tests.support.threaded_harness import ThreadedPool

    out = ThreadedPool(world_size=3).run(_token_count_past_float32)
    assert out == [float(3 * 2**24 + 4)] * 3


def test_loss_statistics_are_reduced_as_their_tables_declare():
    from megatron_credit.metrics.tables import CORE, FIPO, MAX, MIN, SUM, TOKEN_MEAN, MetricTable, reductions
    from megatron_credit.metrics.sums import loss_statistics

    tables = (CORE, FIPO, MetricTable(reduce={"count": SUM}))
    reduce = reductions(tables)
    stats = {"clipfrac_high": torch.tensor(0.25), "fipo_weight/min": torch.tensor(1.0),
             "fipo_weight/max": torch.tensor(1.2), "count": torch.tensor(3.0)}
    out = loss_statistics(stats, tables, tokens=torch.tensor(8.0), first=True)
    assert {k: float(v) for k, v in out.items()} == {
        "sum:clipfrac_high": 2.0, "min:fipo_weight/min": 1.0, "min:first_minibatch/fipo_weight/min": 1.0,
        "max:fipo_weight/max": pytest.approx(1.2), "max:first_minibatch/fipo_weight/max": pytest.approx(1.2),
        "sum:count": 3.0}
    empty = loss_statistics({"fipo_weight/max": torch.tensor(float("nan")), "clipfrac_high": torch.tensor(float("nan"))},
                            tables, tokens=torch.tensor(0.0))
    assert math.isnan(float(empty["max:fipo_weight/max"])) and float(empty["sum:clipfrac_high"]) == 0.0
    with pytest.raises(ValueError, match="'fipo_weight/p50', which none of the algorithm's metric tables declares"):
        loss_statistics({"fipo_weight/p50": torch.tensor(1.0)}, (CORE,), tokens=torch.tensor(1.0))
    with pytest.raises(ValueError, match="reduced as both 'token_mean' and 'max'"):
        reductions((CORE, MetricTable(reduce={"clipfrac_high": MAX})))
    with pytest.raises(ValueError, match="MetricTable.reduce"):
        MetricTable(reduce={"x": "median"})
    assert (reduce["approx_kl"], reduce["fipo_weight/min"]) == (TOKEN_MEAN, MIN)


def test_the_old_metric_tables_path_warns_and_gives_the_same_objects():
    import megatron_credit.algorithm.metric_tables as old
    from megatron_credit.metrics import tables

    with pytest.warns(DeprecationWarning, match=r"metric_tables\.MetricTable is now megatron_credit\.metrics\.tables"):
        assert old.MetricTable is tables.MetricTable
    with pytest.warns(DeprecationWarning):
        assert old.FIPO is tables.FIPO
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        old.nothing
