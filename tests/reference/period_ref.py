"""Slow, loop-based reference of the §3.2 period score, written from algorithm.md (no prefix sums)."""

from __future__ import annotations

import math


def reference_search_period(x: list[float]) -> int:
    """Direct transcription of algorithm.md §3.2 steps 1–5 on a list of squared gradients."""
    n = len(x)
    cands = [p for p in range(1, n) if n % p == 0 and n // p >= 4]
    if not cands:
        return 1
    logs = [math.log(v + 1e-12) for v in x]
    scores = []
    for p in cands:
        means = [sum(logs[b * p : (b + 1) * p]) / p for b in range(n // p)]
        diffs = [abs(means[b + 1] - means[b]) for b in range(len(means) - 1)]
        scores.append(sum(diffs) / len(diffs))
    best = None
    for k in range(1, len(cands) - 1):
        p = cands[k]
        if p <= 8 or p == cands[-1]:
            continue
        if scores[k] > scores[k - 1] and scores[k] > scores[k + 1]:
            if best is None or (scores[k], p) > best:
                best = (scores[k], p)
    if best is None:
        return 1
    period = best[1]
    if period > 1024:
        period = min(q for q in range(1025, period + 1) if period % q == 0)
    return period
