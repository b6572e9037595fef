"""Statistics of the credit testbed (``tools/credit_testbed.py``): Student-t intervals, paired
seed-matched differences, per-cell curve summaries. Standard library only (scipy is not a dependency).

The t quantile inverts the Student-t CDF, ``P(T <= t) = 1 - I_x(df/2, 1/2) / 2`` with
``x = df / (df + t^2)`` for ``t > 0``, where ``I`` is the regularized incomplete beta function
(continued fraction, Numerical Recipes 6.4), by bisection to 1e-12.

>>> round(t_quantile(0.975, 4), 3), round(t_quantile(0.975, 1), 3), round(t_quantile(0.975, 29), 3)
(2.776, 12.706, 2.045)
>>> iv = mean_interval([1.0, 2.0, 3.0]); (iv.mean, round(iv.lo, 4), round(iv.hi, 4), iv.n)
(2.0, -0.4841, 4.4841, 3)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
            last = d * c
        if abs(last - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``.

    >>> round(betainc(2.0, 3.0, 0.4), 6)  # 1 - sum_{j<2} C(4,j) 0.4^j 0.6^(4-j)
    0.5248
    """
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t CDF with ``df`` degrees of freedom.

    >>> t_cdf(0.0, 3), round(t_cdf(1.0, 1), 6)  # Cauchy: 1/2 + atan(1)/pi
    (0.5, 0.75)
    """
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interval:
    """Mean of ``n`` values and its two-sided Student-t interval (NaN bounds when ``n < 2``)."""

    mean: float
    lo: float
    hi: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        """``"0.512 [0.431, 0.593]"`` (``"n/a"`` without values, no interval with one value)."""
        if self.n == 0:
            return "n/a"
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.lo > 0 or self.hi < 0)


def mean_interval(values: Sequence[float], *, level: float = 0.95) -> Interval:
    """``mean ± t_{(1+level)/2, n-1} * s / sqrt(n)`` with the sample standard deviation ``s``."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(xs)
    if n == 0:
        return Interval(mean=math.nan, lo=math.nan, hi=math.nan, n=0)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean=mean, lo=math.nan, hi=math.nan, n=1)
    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * s / math.sqrt(n)
    return Interval(mean=mean, lo=mean - half, hi=mean + half, n=n)


def paired_interval(a: Mapping[int, float], b: Mapping[int, float], *, level: float = 0.95) -> Interval:
    """Interval of the seed-matched differences ``a[s] - b[s]`` over the seeds both have.

    >>> paired_interval({1: 0.5, 2: 0.7, 3: 0.4}, {1: 0.4, 2: 0.5, 9: 0.0}).fmt()
    '0.150 [-0.485, 0.785]'
    """
    return mean_interval([a[s] - b[s] for s in sorted(set(a) & set(b))], level=level)


def interaction_interval(cells: Sequence[Mapping[int, float]], *, level: float = 0.95) -> Interval:
    """2x2 interaction ``(a11 - a10) - (a01 - a00)`` per seed, for ``cells = (a11, a10, a01, a00)``."""
    a11, a10, a01, a00 = cells
    seeds = sorted(set(a11) & set(a10) & set(a01) & set(a00))
    return mean_interval([(a11[s] - a10[s]) - (a01[s] - a00[s]) for s in seeds], level=level)


def curve_metrics(times: Sequence[float], accuracy: Sequence[float]) -> dict[str, float]:
    """Summaries of one cell's curve ``accuracy[i]`` at wall time ``times[i]`` (end of iteration i):

    - ``final``: the last iteration's sampled accuracy;
    - ``last20``: the mean over the last 20% of iterations (at least one);
    - ``auc``: the area under accuracy vs wall time, divided by the time span, i.e. the time-averaged
      accuracy (a step function: iteration i's accuracy holds over its own wall time).

    >>> curve_metrics([1.0, 2.0, 4.0, 5.0, 6.0], [0.1, 0.2, 0.3, 0.4, 0.5])
    {'final': 0.5, 'last20': 0.5, 'auc': 0.3}
    """
    if not accuracy:
        return {"final": math.nan, "last20": math.nan, "auc": math.nan}
    k = max(1, math.ceil(0.2 * len(accuracy)))
    prev, area = 0.0, 0.0
    for t, a in zip(times, accuracy):
        area += (t - prev) * a
        prev = t
    return {"final": float(accuracy[-1]), "last20": sum(accuracy[-k:]) / k,
            "auc": area / times[-1] if times[-1] > 0 else math.nan}


def interpolate(xs: Sequence[float], ys: Sequence[float], grid: Sequence[float]) -> list[float]:
    """Step interpolation: the value of the last point with ``x <= g`` (NaN before the first, and after
    the last point's x, so a curve is not extended past where the cell stopped).

    >>> interpolate([1, 3], [0.1, 0.3], [0, 1, 2, 3, 4])
    [nan, 0.1, 0.1, 0.3, nan]
    """
    out, j = [], -1
    for g in grid:
        while j + 1 < len(xs) and xs[j + 1] <= g:
            j += 1
        out.append(math.nan if j < 0 or g > xs[-1] else float(ys[j]))
    return out
