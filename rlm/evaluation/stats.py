"""Statistics for the evaluation report: intervals, pass^k and summaries of spread.

Every function here is pure arithmetic on counts or floats; nothing reads files.
"""
from __future__ import annotations

import math

#: The two-sided 95% quantile of the standard normal distribution.
Z95 = 1.959964


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Score interval for a binomial proportion (Wilson 1927, JASA 22:209-212).

    ``successes`` of ``n`` trials passed; ``z`` is the normal quantile (1.959964
    gives a 95% interval). Returns ``(low, high)``, both within [0, 1] and with
    ``low <= p <= high``, where ``p = successes/n``:
    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)``.
    Unlike the plain normal interval it stays inside [0, 1] and does not collapse
    to a point at 0 or n successes. With ``n == 0`` nothing is known: ``(0.0, 1.0)``.

    Raises ValueError when ``n < 0`` or ``successes`` is outside ``0..n``.
    """
    _check_counts(successes, n)
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # The interval holds p exactly; rounding can put an end a hair past it (4 of 4 gave a
    # high of 0.9999999999999999), which a plot's error bar reads as negative.
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def pass_hat_k(successes: int, n: int, k: int) -> float:
    """Unbiased estimate of the chance that ``k`` independent trials all pass.

    ``successes`` of ``n`` repeated trials of one task passed; returns
    ``C(successes, k) / C(n, k)``, the pass^k estimator of tau-bench (Yao et al.
    2024, arXiv 2406.12045), a float in [0, 1]. pass^1 is the plain accuracy.

    Raises ValueError when ``k < 1``, ``k > n``, or the counts are inconsistent.
    """
    _check_counts(successes, n)
    if k < 1:
        raise ValueError(f"pass^k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass^k needs k <= n trials, got k={k} with n={n}")
    return math.comb(successes, k) / math.comb(n, k)


def describe(values: list[float]) -> dict:
    """Mean, median and 90th percentile of ``values`` (in their own unit).

    Returns ``{"mean": float, "median": float, "p90": float}``; every value is
    None for an empty list. Percentiles interpolate linearly between order
    statistics (Hyndman & Fan 1996, definition 7; numpy's default and
    ``statistics.quantiles(method="inclusive")``).
    """
    data = sorted(float(v) for v in values)
    if not data:
        return {"mean": None, "median": None, "p90": None}
    return {"mean": math.fsum(data) / len(data),
            "median": quantile(data, 0.5),
            "p90": quantile(data, 0.9)}


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of a non-empty ascending list, linearly interpolated.

    Position ``h = (len - 1) * q``; the result lies between the order statistics
    either side of ``h`` (Hyndman & Fan 1996, definition 7). Raises ValueError on
    an empty list or ``q`` outside [0, 1].
    """
    if not sorted_values:
        raise ValueError("quantile of an empty list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be within [0, 1], got {q}")
    h = (len(sorted_values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def _check_counts(successes: int, n: int) -> None:
    if n < 0:
        raise ValueError(f"the number of trials must be >= 0, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..n={n}, got {successes}")
