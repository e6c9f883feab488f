"""How far apart two transports may really be, given the spread of the runs."""

from __future__ import annotations

import random
import statistics


def ratio_interval(b: list, a: list, draws: int = 2000) -> list[float]:
    """A 95 % bootstrap interval of median(b) / median(a)"""
    rng = random.Random(0)
    return _middle_95(
        statistics.median(rng.choices(b, k=len(b)))
        / statistics.median(rng.choices(a, k=len(a)))
        for _ in range(draws)
    )


def paired_ratio_interval(ratios: list, draws: int = 2000) -> list[float]:
    """A 95 % bootstrap interval of the median of paired ratios"""
    rng = random.Random(0)
    return _middle_95(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws)
    )


def _middle_95(estimates) -> list[float]:
    """Where the middle 95 % of the bootstrap's estimates lie"""
    estimates = sorted(estimates)
    n = len(estimates)
    return [estimates[int(0.025 * n)], estimates[int(0.975 * n) - 1]]
