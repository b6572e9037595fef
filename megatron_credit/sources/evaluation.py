"""Evaluation metrics over k samples per problem: Avg@k, Cons@k, Pass@k (``tools/evaluate.py`` and the
trainer's validation, ``megatron_credit.sources.sync.SyncSource.validate``, use this module).

For a problem with ``n`` samples of which ``c`` are correct:

* **Avg@k** = ``c / n``: the mean pass@1 over the k = n samples;
* **Cons@k**: majority vote over the verifier's extracted answers (responses without an extracted
  answer do not vote; a tie goes to the answer seen first); 1 when the winning answer is correct;
* **Pass@k**: the unbiased estimator ``1 - C(n - c, k) / C(n, k)`` of Chen et al. (2021, "Evaluating
  Large Language Models Trained on Code", eq. 1) for any ``k <= n``, computed as a product (no big
  binomials).

Dataset numbers are the means over problems.

>>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=2), pass_at_k(n=4, c=0, k=4)
(0.25, 0.5, 0.0)
>>> majority_answer(["3", None, "4", "4", "3"])
'3'
>>> p = ProblemResult(uid="a", ground_truth="4", answers=("4", "5", "4", None), correct=(True, False, True, False))
>>> {name: round(v, 4) for name, v in problem_metrics(p, pass_ks=(1, 2)).items()}  # pass@2 = 1 - 1/6
{'avg': 0.5, 'cons': 1.0, 'pass@1': 0.5, 'pass@2': 0.8333}
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Any, Iterable, Optional, Sequence


def pass_at_k(*, n: int, c: int, k: int) -> float:
    """Unbiased pass@k of ``c`` correct among ``n`` samples: ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_answer(answers: Sequence[Optional[str]]) -> Optional[str]:
    """The most frequent answer (None ignored; ties: the one seen first), or None when none was extracted."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemResult:
    """The k graded samples of one problem."""

    uid: str
    """The prompt's id."""
    ground_truth: str
    """The reference answer."""
    answers: tuple
    """``[k]`` extracted answers (None: nothing extracted)."""
    correct: tuple
    """``[k]`` verifier verdicts."""
    response_lens: tuple = ()
    """``[k]`` response tokens."""

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return sum(bool(c) for c in self.correct)

    def majority(self) -> Optional[str]:
        return majority_answer(self.answers)

    def majority_correct(self) -> bool:
        """Whether the majority answer is one the verifier accepted (answers equal as strings share a verdict)."""
        winner = self.majority()
        return winner is not None and any(bool(c) for a, c in zip(self.answers, self.correct) if a == winner)


def problem_metrics(p: ProblemResult, *, pass_ks: Iterable[int]) -> dict[str, float]:
    """``avg``, ``cons`` and ``pass@k`` for each k of ``pass_ks`` (all must be <= the samples ``p.n``)."""
    out = {"avg": p.num_correct / p.n, "cons": float(p.majority_correct())}
    for k in pass_ks:
        out[f"pass@{k}"] = pass_at_k(n=p.n, c=p.num_correct, k=k)
    return out


def default_pass_ks(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself.

    >>> default_pass_ks(12)
    (1, 2, 4, 8, 12)
    """
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return tuple(ks + [n])


def metric_sums(problems: Sequence[ProblemResult], *, k: int) -> dict[str, float]:
    """Sums over problems of ``avg@k``, ``cons@k``, ``pass@k`` and the problem count (``num_problems``):
    what data-parallel ranks add up before dividing (:func:`means_from_sums`)."""
    sums = {f"avg@{k}": 0.0, f"cons@{k}": 0.0, f"pass@{k}": 0.0, "num_problems": float(len(problems))}
    for p in problems:
        if p.n != k:
            raise ValueError(f"problem {p.uid!r} has {p.n} samples, expected k={k}")
        m = problem_metrics(p, pass_ks=(k,))
        sums[f"avg@{k}"] += m["avg"]
        sums[f"cons@{k}"] += m["cons"]
        sums[f"pass@{k}"] += m[f"pass@{k}"]
    return sums


def means_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """Divide every sum of :func:`metric_sums` by the problem count."""
    count = max(sums["num_problems"], 1.0)
    return {name: value / count for name, value in sums.items() if name != "num_problems"}


def summarize(problems: Sequence[ProblemResult], *, pass_ks: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The dataset report: ``avg@k``, ``cons@k``, ``pass@j`` for each j of ``pass_ks`` (default
    :func:`default_pass_ks`), problem and sample counts, mean response length."""
    if not problems:
        raise ValueError("no problems to summarise")
    k = problems[0].n
    if any(p.n != k for p in problems):
        raise ValueError("every problem must have the same number of samples")
    pass_ks = tuple(pass_ks or default_pass_ks(k))
    rows = [problem_metrics(p, pass_ks=pass_ks) for p in problems]
    report: dict[str, Any] = {"num_problems": len(problems), "k": k,
                              f"avg@{k}": sum(r["avg"] for r in rows) / len(rows),
                              f"cons@{k}": sum(r["cons"] for r in rows) / len(rows)}
    for j in pass_ks:
        report[f"pass@{j}"] = sum(r[f"pass@{j}"] for r in rows) / len(rows)
    lens = [n for p in problems for n in p.response_lens]
    if lens:
        report["response_length/mean"] = sum(lens) / len(lens)
    return report


def sample_and_grade(engine, tokenizer, records, *, k: int, sampling, verifier_workers=None,
                     batch_prompts: Optional[int] = None, progress=None, first_group: int = 0,
                     scoring=contextlib.nullcontext) -> list[ProblemResult]:
    """``k`` samples of every prompt record from ``engine`` (``sampling``: a ``SamplingParams`` whose ``n``
    is replaced by ``k``), decoded and graded by the records' verifiers (in ``verifier_workers`` when given).

    ``batch_prompts``: prompts per engine call (None: all at once); ``progress(num_done)`` is called after
    each call. Sampling seeds are ``sampling.seed + call index``, so results do not depend on the
    progress bar, only on ``batch_prompts``. The ``i``-th record of a call is group ``first_group + i`` of
    the engine's seeds (the trainer's validation, one call per engine: each engine samples its slice of
    one list as the whole list would be). Each call's grading runs inside ``scoring()`` (a rollout pool beats
    there)."""
    from megatron_credit.rewards.shaping import ShapingConfig
    from megatron_credit.rollout.episode_scores import score_samples
    from megatron_credit.rollout.multi_turn import generate

    records = list(records)
    step = batch_prompts or max(len(records), 1)
    out: list[ProblemResult] = []
    for call, start in enumerate(range(0, len(records), step)):
        chunk = records[start:start + step]
        params = dataclasses.replace(sampling, n=k, seed=None if sampling.seed is None else sampling.seed + call)
        rollout = generate(engine, [list(r.prompt_ids) for r in chunk], params,
                           group_ids=range(first_group, first_group + len(chunk)), records=chunk)
        with scoring():
            owner = [chunk[i // k] for i in range(len(rollout.samples))]
            scored = score_samples(tokenizer, rollout.samples, ground_truths=[r.ground_truth for r in owner],
                                   data_sources=[r.data_source for r in owner], workers=verifier_workers,
                                   shaping=ShapingConfig(max_response_len=sampling.max_new_tokens))
        for g, rec in enumerate(chunk):
            sl = slice(g * k, (g + 1) * k)
            out.append(ProblemResult(uid=rec.uid, ground_truth=rec.ground_truth,
                                     answers=tuple(r.extracted for r in scored.verified.records[sl]),
                                     correct=tuple(bool(c) for c in scored.verified.correct[sl]),
                                     response_lens=tuple(scored.lengths[sl])))
        if progress is not None:
            progress(len(chunk))
    return out


def problem_table(problems: Sequence[ProblemResult], *, pass_ks: Optional[Sequence[int]] = None) -> str:
    """A tab-separated per-problem table: uid, ground truth, correct / k, majority answer, cons, pass@j."""
    if not problems:
        return ""
    pass_ks = tuple(pass_ks or default_pass_ks(problems[0].n))
    head = ["uid", "ground_truth", "correct", "k", "majority_answer", "cons"] + [f"pass@{j}" for j in pass_ks]
    lines = ["\t".join(head)]
    for p in problems:
        m = problem_metrics(p, pass_ks=pass_ks)
        cells = [p.uid, p.ground_truth, str(p.num_correct), str(p.n), str(p.majority()), f"{m['cons']:.0f}"]
        cells += [f"{m[f'pass@{j}']:.4f}" for j in pass_ks]
        lines.append("\t".join(c.replace("\t", " ").replace("\n", " ") for c in cells))
    return "\n".join(lines) + "\n"
