"""Slow, obviously-correct references for the codebook math, written from algorithm.md §4 (no fast paths).

* ``reference_histogram``: §4.2 with Python loops and numpy float32 scalars.
* ``reference_dp_centers``: the §4.3 programme exactly as written, ``O(K·A²)`` Python loops, strict ``<``.
* ``vectorised_reference_dp_centers``: the same programme and arithmetic, each (cluster, end) row's scan over
  every start ``s`` done by numpy (``argmin`` = first minimum); for inputs too large for Python loops.
* ``brute_force_partition``: every segmentation, costs in exact rational arithmetic.
* ``reference_nearest_code``: arg-min of the float32 distance over all codes, lowest index on ties.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import torch


def reference_histogram(g: torch.Tensor, period: int) -> list[int]:
    """§4.2 histogram of one tensor: per block a = max|g|, u = g/a (0 if a == 0), bin floor((u+1)·2048)."""
    values = g.detach().double().cpu().numpy().reshape(-1).astype(np.float32).tolist()
    counts = [0] * 4096
    for start in range(0, len(values), period):
        block = [np.float32(v) for v in values[start : start + period]]
        a = max(abs(v) for v in block)
        for v in block:
            u = v / a if a > 0 else np.float32(0.0)
            b = math.floor(float((u + np.float32(1.0)) * np.float32(2048.0)))
            counts[min(max(b, 0), 4095)] += 1
    return counts


def _prefix(points, weights) -> tuple[list[float], list[float], list[float]]:
    W, X, Q = [0.0], [0.0], [0.0]
    for z, n in zip(points, weights, strict=True):
        z, n = float(z), float(n)
        W.append(W[-1] + n)
        X.append(X[-1] + n * z)
        Q.append(Q[-1] + n * z * z)
    return W, X, Q


def reference_dp_centers(points, weights, k: int, force_endpoints: bool = True) -> list[float]:
    """§4.3 verbatim: F[c][e] = min over s = c..e of F[c-1][s-1] + cost_c(s, e), strict < (first minimum)."""
    A = len(points)
    W, X, Q = _prefix(points, weights)

    def cost(c: int, s: int, e: int) -> float:
        w, x, q = W[e] - W[s - 1], X[e] - X[s - 1], Q[e] - Q[s - 1]
        if force_endpoints and c == 1:
            return q + 2 * x + w
        if force_endpoints and c == k:
            return q - 2 * x + w
        return q - x * x / w

    F = [[math.inf] * (A + 1) for _ in range(k + 1)]
    arg = [[0] * (A + 1) for _ in range(k + 1)]
    F[0][0] = 0.0
    for c in range(1, k + 1):
        for e in range(c, A + 1):
            best, best_s = math.inf, -1
            for s in range(c, e + 1):
                v = F[c - 1][s - 1] + cost(c, s, e)
                if v < best:
                    best, best_s = v, s
            F[c][e], arg[c][e] = best, best_s
    return _backtrack(W, X, A, k, force_endpoints, lambda c, e: arg[c][e])


def _backtrack(W, X, A: int, k: int, force_endpoints: bool, start_of) -> list[float]:
    centres, e = [], A
    for c in range(k, 0, -1):
        s = start_of(c, e)
        if force_endpoints and c == 1:
            centres.append(-1.0)
        elif force_endpoints and c == k:
            centres.append(1.0)
        else:
            centres.append((X[e] - X[s - 1]) / (W[e] - W[s - 1]))
        e = s - 1
    return sorted(centres)


def vectorised_reference_dp_centers(points, weights, k: int, force_endpoints: bool = True) -> list[float]:
    """§4.3 with each row's scan over s vectorised (same float64 operations; ``argmin`` = first minimum).

    Rows are the ends ``e = c .. A - k + c`` (the others cannot be on a path to ``(A, k)``); every start
    ``s = c .. e`` of each row is scanned.
    """
    A = len(points)
    W, X, Q = (np.array(v) for v in _prefix(points, weights))
    F = np.full(A + 1, np.inf)  # F[c-1][.] indexed by s - 1
    F[0] = 0.0
    args = {}
    for c in range(1, k + 1):
        ends = np.arange(c, A - k + c + 1) if c < k else np.array([A])
        new_F = np.full(A + 1, np.inf)
        arg = np.zeros(A + 1, dtype=np.int64)
        for chunk in range(0, ends.size, 128):
            e = ends[chunk : chunk + 128, None]
            s = np.arange(c, e[-1, 0] + 1)[None, :]  # every start up to the chunk's last end
            w, x, q = W[e] - W[s - 1], X[e] - X[s - 1], Q[e] - Q[s - 1]
            with np.errstate(divide="ignore", invalid="ignore"):
                if force_endpoints and c == 1:
                    cost = q + 2 * x + w
                elif force_endpoints and c == k:
                    cost = q - 2 * x + w
                else:
                    cost = q - x * x / w
            vals = np.where(s <= e, F[s - 1] + cost, np.inf)
            best = np.argmin(vals, axis=1)
            new_F[e[:, 0]] = vals[np.arange(e.shape[0]), best]
            arg[e[:, 0]] = s[0, best]
        F = new_F
        args[c] = arg
    return _backtrack(W, X, A, k, force_endpoints, lambda c, e: int(args[c][e]))


def brute_force_partition(points, weights, k: int, force_endpoints: bool = True):
    """Best segmentation over all ``C(A-1, k-1)`` cut sets, costs exact (``Fraction``).

    Returns ``(centres, gap)``: the optimal centres (float64, ascending) and the relative gap between the best
    and the second-best total cost (``inf`` if there is one segmentation); a tiny gap means a near tie.
    """
    A = len(points)
    z = [Fraction(float(p)) for p in points]
    n = [Fraction(float(w)) for w in weights]

    def segment(c: int, s: int, e: int) -> tuple[Fraction, Fraction]:
        w = sum(n[s:e])
        mean = sum(n[i] * z[i] for i in range(s, e)) / w
        centre = Fraction(-1) if force_endpoints and c == 0 else mean
        centre = Fraction(1) if force_endpoints and c == k - 1 else centre
        return sum(n[i] * (z[i] - centre) ** 2 for i in range(s, e)), centre

    results = []
    for cuts in itertools.combinations(range(1, A), k - 1):
        bounds = (0, *cuts, A)
        parts = [segment(c, bounds[c], bounds[c + 1]) for c in range(k)]
        results.append((sum(p[0] for p in parts), [float(p[1]) for p in parts]))
    results.sort(key=lambda r: r[0])
    best = results[0]
    gap = math.inf
    if len(results) > 1:
        gap = float((results[1][0] - best[0]) / max(abs(best[0]), Fraction(1, 10**30)))
    return sorted(best[1]), gap


def reference_nearest_code(u: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Arg-min over every code of ``|u - c|`` in float32, the lowest index among equal distances."""
    values = u.detach().cpu().numpy().astype(np.float32).reshape(-1)
    codes = codebook.detach().cpu().numpy().astype(np.float32)
    out = np.empty(values.size, dtype=np.int64)
    for i, v in enumerate(values):
        dist = np.abs(np.float32(v) - codes)  # float32 arithmetic, one distance per code
        out[i] = int(np.flatnonzero(dist == dist.min())[0])
    return torch.from_numpy(out.reshape(tuple(u.shape)))
