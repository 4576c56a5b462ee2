"""The 256-entry codebook: histogram, exact fit, nearest-code search, encode and decode.

This module owns the codebook math of algorithm.md §4 as amended by §13.2, §13.3 and §13.10: the 4096-bin
histogram of block-normalised gradients, the exact 1-D optimal k-means that turns it into codes (with -1, +1
and exactly 0.0 among them), the nearest-code rule and the block-wise uint8 encode/decode of a first moment.
It leaves to others when a codebook is learned, from which gradients, and where it is stored (optimizer and
checkpoint code); it keeps no state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CODEBOOK_SIZE", "HISTOGRAM_BINS", "accumulate_histogram_", "bin_centers", "optimal_partition_centers",
    "fit_codebook", "nearest_code", "zero_code_index", "encode", "decode", "validate_codebook",
]  # fmt: skip

CODEBOOK_SIZE: int = 256
HISTOGRAM_BINS: int = 4096
_CHUNK_ELEMENTS = 2**22  # elements per chunk in the histogram, encode and decode: bounds transient memory
_U = 2.0**-53  # unit roundoff of float64
_GUIDE_WIDTH = 8  # widest first-round window of the guided layer solver (columns)
_GUIDE_ROUNDS = 8  # repair rounds before the guided solver gives a layer to divide and conquer


@torch.no_grad()
def accumulate_histogram_(counts: Tensor, g: Tensor, period: int, checked: bool = False) -> Tensor:
    """Add the block-normalised values of one gradient to the codebook histogram, in place.

    ``g`` is flattened row-major and viewed as ``(B, period)``. Per block ``a = max |g|`` and
    ``u = g / a`` (``u = 0`` where ``a == 0``), all in float32; value ``u`` goes to bin
    ``clamp(floor((u + 1) * 2048), 0, 4095)``, so ``u = -1`` lands in bin 0, ``0`` in bin 2048 and ``+1`` in
    bin 4095. Blocks are processed in chunks of about 2**22 elements; the result equals the unchunked one.

    Args:
        counts: (4096,) int64 on any device; updated in place.
        g: any floating dtype and shape with ``g.numel() % period == 0``; must be finite.
        period: elements per block, >= 1.
        checked: the caller has checked ``g`` finite: no check here, and no host read at all (the counts are
            accumulated with a scatter-add off the CPU, whose ``bincount`` would read its maximum). Otherwise one
            host read per chunk of about 4M elements, for its check.

    Returns:
        ``counts``, after adding the bin counts of every element of ``g``.

    Raises:
        ValueError: bad ``counts`` dtype/shape, non-float ``g``, ``period`` not a positive divisor of
            ``g.numel()``, or (unless ``checked``) a non-finite value in ``g``. ``counts`` is untouched when this is
            raised.

    Source: algorithm.md §4.2 (histogram), §10.10 (chunking along block boundaries).
    """
    check_histogram_arguments(counts, g, period)
    flat = g.reshape(-1)
    rows = max(1, _CHUNK_ELEMENTS // period)
    total = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=g.device)
    on_cpu = g.device.type == "cpu"
    for start in range(0, g.numel(), rows * period):
        x = flat[start : start + rows * period].view(-1, period).float()
        if not checked and not bool(torch.isfinite(x).all()):  # before a NaN becomes a bin index
            raise ValueError("accumulate_histogram_: g has NaN or Inf values; skip or unscale this step.")
        a = x.abs().amax(dim=1, keepdim=True)
        u = x / torch.where(a > 0, a, torch.ones_like(a))  # an all-zero block divides by 1: u = 0
        scaled = u.add_(1.0).mul_(HISTOGRAM_BINS // 2).floor_()
        if checked:  # never an index out of range, even if the caller's check was wrong (a device assert)
            scaled.nan_to_num_(0.0)
        bins = scaled.clamp_(0, HISTOGRAM_BINS - 1).long().reshape(-1)
        if on_cpu:
            total += torch.bincount(bins, minlength=HISTOGRAM_BINS)
        else:  # integer sums: the same counts in any order, and deterministic (1-D scatter_add_)
            total.scatter_add_(0, bins, torch.ones((), dtype=torch.int64, device=g.device).expand(bins.numel()))
    counts += total.to(counts.device)
    return counts


def check_histogram_arguments(counts: Tensor, g: Tensor, period: int) -> None:
    """The argument checks of :func:`accumulate_histogram_` (for its accelerated twins too).

    Raises:
        ValueError: bad ``counts`` dtype/shape, non-float ``g``, ``period`` not a positive divisor of ``g.numel()``.
    """
    _check_counts(counts, "accumulate_histogram_")
    if not isinstance(g, Tensor) or not g.is_floating_point():
        raise ValueError(f"accumulate_histogram_: g must be a floating-point tensor, got {_describe(g)}.")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1 or g.numel() % period:
        raise ValueError(
            f"accumulate_histogram_: period={period!r} must be a positive int dividing g.numel()={g.numel()}."
        )


def bin_centers() -> Tensor:
    """Centres of the 4096 histogram bins.

    Returns:
        (4096,) float32 ``z_k = -1 + (k + 0.5) / 2048`` (exact in float32), the midpoints of
        ``linspace(-1, 1, 4097)``.

    Source: algorithm.md §4.2.
    """
    k = torch.arange(HISTOGRAM_BINS, dtype=torch.float64)
    return ((k + 0.5) / (HISTOGRAM_BINS // 2) - 1.0).float()


#: An accelerated solver of :func:`optimal_partition_centers`' layers (e.g.
#: :func:`gefen.kernels.native.kmeans_centres`): ``(prefix (3, A + 1) float64, k, force_endpoints, rounding slack)
#: -> (k,) float64 centres`` (any order).
PartitionSolver = Callable[[np.ndarray, int, bool, tuple[float, float]], np.ndarray]


def optimal_partition_centers(
    points: np.ndarray,
    weights: np.ndarray,
    k: int,
    force_endpoints: bool = True,
    solver: PartitionSolver | None = None,
) -> np.ndarray:
    """Exact optimal weighted 1-D k-means of sorted points, bit-identical to the dynamic programme of §4.3.

    The programme: float64 prefix sums ``W, X, Q`` of ``n``, ``n*z``, ``n*z*z``; cluster ``c`` over points
    ``s..e`` costs ``q + 2x + w`` (``c = 1``, centre -1), ``q - 2x + w`` (``c = k``, centre +1), else
    ``q - x*x/w`` (centre ``x/w``); ``F[e][c] = min_s F[s-1][c-1] + cost``, first minimum on ties; backtrack.
    Instead of scanning every ``s`` (``O(k·A²)``), each layer ``c`` finds its row minima through the monotone
    arg-min of this Monge cost: in narrow windows placed by Knuth's bound (``opt[c-1][e] <= opt[c][e]``) and
    then proved, or, where that proof fails, by divide and conquer. Each candidate is computed with the same
    float64 operations as the plain scan, and a window is trusted only when every candidate outside it is
    provably worse than one inside, using a rigorous bound on the rounding error; so the minima, the first
    arg-minima and the centres equal the plain scan's exactly, near-ties included. About 0.4-0.55 s for
    ``A = 4096, k = 255`` on one CPU core (the plain scan: about 2·10⁹ steps).

    Args:
        points: (A,) finite, non-decreasing (the active bin centres ``z``).
        weights: (A,) finite and > 0 (the bin counts ``n``).
        k: number of clusters, ``1 <= k <= A`` (``k >= 2`` when ``force_endpoints``).
        force_endpoints: pin the first centre to -1 and the last to +1 (the optimizer's setting).
        solver: ``None`` for this module's layers (the reference), or an accelerated solver of the same
            programme (:data:`PartitionSolver`; :func:`gefen.kernels.first_step.optimal_partition_centers` passes
            the native library's, identical centres in milliseconds), called with ``k >= 2``.

    Returns:
        (k,) float64 centres, sorted ascending.

    Raises:
        ValueError: shapes, values or ``k`` out of range, or weights so unbalanced that float64 prefix sums
            lose more than half the smallest weight (never for integer counts summing to < 2**51).

    Source: algorithm.md §4.3 (programme, tie rule), §13.2 (fast exact method required).
    """
    z, n = _check_points(points, weights, k, force_endpoints)
    size = z.size
    tx = n * z
    tq = tx * z
    prefix = np.zeros((3, size + 1))
    np.cumsum(n, out=prefix[0, 1:])  # add.accumulate: the same sequential sums as a Python loop
    np.cumsum(tx, out=prefix[1, 1:])
    np.cumsum(tq, out=prefix[2, 1:])
    W, X, Q = prefix
    rows = size - k + 1  # layer c only needs ends e = c .. c + rows - 1 (the others cannot reach (A, k))
    slack = _rounding_slack(z, n, tx, tq, prefix)
    if solver is not None and k >= 2:
        return np.sort(solver(prefix, k, force_endpoints, slack))
    e = np.arange(1, rows + 1)
    F = 0.0 + _cost(W[e] - W[0], X[e] - X[0], Q[e] - Q[0], -1.0 if force_endpoints else None)
    history = {1: (F, None, None)}  # cluster c -> (F, L, R) over ends e = c + j
    for c in range(2, k):
        layer = _Layer(prefix, c, F, 8.0 * (slack[0] + slack[1] * float(np.abs(F).max())))
        solved = _solve_guided(layer, history[c - 1][1]) if c >= 3 else None
        history[c] = solved if solved is not None else _solve_divide_and_conquer(layer)
        F = history[c][0]
    if k == 1:
        return np.array([(X[size] - X[0]) / (W[size] - W[0])])
    centres = np.empty(k)
    s1 = k - 1 + np.arange(rows)  # last cluster: s - 1 = k - 1 + i, e = A
    last = F + _cost(W[size] - W[s1], X[size] - X[s1], Q[size] - Q[s1], 1.0 if force_endpoints else None)
    i = int(np.argmin(last))  # argmin returns the first minimum, as the strict-< scan does
    centres[k - 1] = 1.0 if force_endpoints else (X[size] - X[k - 1 + i]) / (W[size] - W[k - 1 + i])
    for c in range(k - 1, 1, -1):  # row j of cluster c ends at e = c + j; its first arg-min lies in [L, R]
        j = i
        cand = np.arange(history[c][1][j], history[c][2][j] + 1)
        e, s1 = c + j, c - 1 + cand
        vals = history[c - 1][0][cand] + _cost(W[e] - W[s1], X[e] - X[s1], Q[e] - Q[s1], None)
        i = int(cand[np.argmin(vals)])
        centres[c - 1] = (X[e] - X[c - 1 + i]) / (W[e] - W[c - 1 + i])
    centres[0] = -1.0 if force_endpoints else (X[1 + i] - X[0]) / (W[1 + i] - W[0])
    return np.sort(centres)


def _cost(w: np.ndarray, x: np.ndarray, q: np.ndarray, centre: float | None) -> np.ndarray:
    """§4.3 segment cost: pinned centre -1 (``q + 2x + w``), +1 (``q - 2x + w``) or free (``q - x*x/w``)."""
    if centre is None:
        return q - x * x / w
    return q + 2.0 * x + w if centre < 0 else q - 2.0 * x + w


def _cumsum_rounding(terms: np.ndarray, sums: np.ndarray) -> float:
    """Sum of the exact rounding errors of ``sums[i+1] = fl(sums[i] + terms[i])`` (Knuth's TwoSum)."""
    a, s = sums[:-1], sums[1:]
    b = s - a
    return float(np.abs((a - (s - b)) + (terms - b)).sum()) * (1 + 1e-6)


def _rounding_slack(
    z: np.ndarray, n: np.ndarray, tx: np.ndarray, tq: np.ndarray, prefix: np.ndarray
) -> tuple[float, float]:
    """``(c0, c1)`` with ``|computed F[s-1] + cost(s, e) - (F[s-1] + exact SSE(s..e))| <= c0 + c1·max|F|``.

    Covers the rounding of the products, of the prefix sums (their actual errors), of the segment
    differences, of ``x*x/w``, of ``q - x*x/w`` and of the final addition, for every free-centre segment;
    the exact values ``F[s-1] + SSE`` form a Monge array, so this slack is all that can break monotonicity.
    """
    u = _U
    big = 1 + 1e-9
    w_tot, x_abs, q_tot = float(n.sum()) * big, float(np.abs(tx).sum()) * big, float(tq.sum()) * big
    z_max, w_min = float(np.abs(z).max()), float(n.min())
    e_w = _cumsum_rounding(n, prefix[0])
    e_x = _cumsum_rounding(tx, prefix[1]) + 1.01 * u * x_abs
    e_q = _cumsum_rounding(tq, prefix[2]) + 2.01 * u * q_tot
    d_w = 2 * e_w + 1.01 * u * (w_tot + 2 * e_w)  # error of a computed segment weight w, etc.
    d_x = 2 * e_x + 1.01 * u * (x_abs + 2 * e_x)
    d_q = 2 * e_q + 1.01 * u * (q_tot + 2 * e_q)
    if not d_w <= 0.5 * w_min:
        raise ValueError(
            "optimal_partition_centers: weights too unbalanced for float64 prefix sums "
            f"(rounding {d_w:.3g} vs smallest weight {w_min:.3g}); rescale or drop tiny weights."
        )
    mean_sq = z_max * z_max * w_tot + 2 * z_max * d_x + d_x * d_x / w_min  # bounds computed x*x/w by 2x
    c0 = d_q + 2 * (2 * z_max * d_x + z_max * z_max * d_w) + 2 * d_x * d_x / w_min
    c0 += 8 * u * (q_tot + d_q + 2 * mean_sq)
    return 2 * c0, 2 * 8 * u  # safety factor 2


class _Layer:
    """Candidates ``v(i, j) = F_prev[i] + cost(c + i, c + j)`` of free cluster ``c``, for ``i <= j < rows``.

    ``minima(rows, lo, hi)`` returns, per row ``j``, the minimum ``m`` of ``v(i, j)`` over ``lo <= i <= hi``
    and the first and last ``i`` (``L``, ``R``) with ``v <= m + tol``. With ``tol`` at least four times the
    rounding slack, and ``v`` Monge up to that slack, every ``i`` of that window left of ``L`` is strictly
    worse than the minimum for every later row, and every ``i`` right of ``R`` for every earlier row.
    """

    def __init__(self, prefix: np.ndarray, c: int, F_prev: np.ndarray, tol: float) -> None:
        rows = F_prev.size
        self.row = prefix[:, c : c + rows]  # W, X, Q at e = c + j
        self.col = np.vstack([prefix[:, c - 1 : c - 1 + rows], F_prev])  # W, X, Q at s - 1 = c - 1 + i; F
        self.tol = tol
        self.size = rows

    def minima(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
        lens = hi - lo + 1
        ends = np.cumsum(lens)
        starts = ends - lens
        seg = np.repeat(np.arange(rows.size), lens)
        cols = np.arange(int(ends[-1])) + (lo - starts)[seg]
        g = np.take(self.col, cols, axis=1)
        w, x, q = np.take(self.row, rows[seg], axis=1) - g[:3]
        vals = g[3] + (q - x * x / w)  # the reference's arithmetic, operation for operation
        m = np.full(rows.size, np.inf)
        np.minimum.at(m, seg, vals)
        within = vals <= (m + self.tol)[seg]
        seg, cols = seg[within], cols[within]
        L = np.full(rows.size, self.size)
        np.minimum.at(L, seg, cols)
        R = np.full(rows.size, -1)
        np.maximum.at(R, seg, cols)
        return m, L, R


def _solve_divide_and_conquer(layer: _Layer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row minima by divide and conquer on the monotone arg-min, one numpy pass per recursion depth.

    A row's window runs from ``L`` of the nearest solved row above it to ``R`` of the nearest solved row
    below it (by the ``_Layer`` property nothing outside can be a minimum), so near-ties widen windows
    instead of breaking the recursion.
    """
    size = layer.size
    F = np.empty(size)
    L = np.zeros(size + 1, dtype=np.int64)  # entry ``size``: no solved row on that side
    R = np.full(size + 1, size - 1, dtype=np.int64)
    a, b = np.array([0]), np.array([size - 1])
    above, below = np.array([size]), np.array([size])
    while a.size:
        mid = (a + b) // 2
        F[mid], L[mid], R[mid] = layer.minima(mid, L[above], np.minimum(R[below], mid))
        a, b = np.concatenate([a, mid + 1]), np.concatenate([mid - 1, b])
        above, below = np.concatenate([above, mid]), np.concatenate([mid, below])
        keep = a <= b
        a, b, above, below = a[keep], b[keep], above[keep], below[keep]
    return F, L[:size], R[:size]


def _solve_guided(layer: _Layer, l_prev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Row minima in narrow windows guessed from the previous layer, then proved; ``None`` if not proved.

    The guess is Knuth's bound: the optimal start of the last cluster does not move left when a cluster is
    added, so row ``j`` starts the search at ``L`` of the previous layer's row for the same end, ``j + 1``.
    The windows are accepted when ``lo[0] == 0``, ``hi[-1] == size - 1`` and, for every row,
    ``lo[j] <= L[j-1]`` and ``hi[j] >= min(R[j+1], j)``: then any ``i`` outside row ``j``'s window lies,
    following the chain of rows towards the side it is on, inside some row's window beyond that row's
    ``L``/``R``, and is therefore strictly worse at row ``j`` than that row's minimiser (``_Layer``). Failing
    rows, widened by ``2**round`` neighbours on each side, are re-solved with the window spanned by the
    passing rows around them; a layer still failing after a few rounds goes to divide and conquer.
    """
    size = layer.size
    j = np.arange(size)
    guess = np.maximum.accumulate(np.clip(l_prev[np.minimum(j + 1, size - 1)] - 1, 0, j))
    lo = np.clip(np.minimum(np.append(guess[:1], guess[:-1]), guess) - 1, 0, j)
    hi = np.clip(np.maximum(np.append(guess[1:], guess[-1]), guess) + 1, lo, j)
    hi = np.minimum(hi, lo + _GUIDE_WIDTH - 1)
    hi[-1] = size - 1
    F, L, R = layer.minima(j, lo, hi)
    bad = ((L == lo) & (lo > 0)) | ((R == hi) & (hi < j))  # minimum on a cut edge: the guess was off
    for attempt in range(_GUIDE_ROUNDS):
        bad[1:] |= lo[1:] > L[:-1]
        bad[:-1] |= hi[:-1] < np.minimum(R[1:], j[:-1])
        near, reach = np.append(0, np.cumsum(bad)), 2**attempt
        rows = np.flatnonzero(near[np.minimum(j + reach + 1, size)] > near[np.maximum(j - reach, 0)])
        if rows.size == 0:
            return F, L, R
        if rows.size > size // 2:
            return None
        new_run = np.append(True, np.diff(rows) > 1)
        run = np.cumsum(new_run) - 1
        first, last = rows[new_run], rows[np.append(new_run[1:], True)]
        left = np.where(first > 0, L[first - 1], 0)
        right = np.where(last < size - 1, R[np.minimum(last + 1, size - 1)], size - 1)
        lo[rows] = np.minimum(lo[rows], left[run])
        hi[rows] = np.maximum(hi[rows], np.minimum(right[run], rows))
        F[rows], L[rows], R[rows] = layer.minima(rows, lo[rows], hi[rows])
        bad = np.zeros(size, dtype=bool)
    return None


@torch.no_grad()
def fit_codebook(counts: Tensor, solver: PartitionSolver | None = None) -> Tensor:
    """Fit the 256-entry codebook to a histogram.

    Active bins (count > 0) give points ``z_k`` (their centres) with weights ``n_k``. With ``A >= 255`` active
    bins: the exact DP with 255 clusters and pinned ends (-1, +1), cast to float32, plus an exact 0.0. With
    ``A <= 253``: every active centre plus -1, 0.0 and +1, padded at the end with copies of +1 (we keep all
    centres, unlike §4.4, which overwrites the first one). ``A == 254`` (254 centres and three fixed codes
    do not fit): the DP with 254 clusters, plus 0.0, plus one +1 copy. A DP centre that is already exactly
    0.0 is not added twice (one more +1 copy instead), so only trailing +1 codes repeat.

    Args:
        counts: (4096,) int64, non-negative, not all zero; on any device.
        solver: an accelerated solver for :func:`optimal_partition_centers` (``None``: the reference's).

    Returns:
        (256,) float32 on ``counts.device``: non-decreasing, ``c[0] = -1``, ``c[255] = +1``, contains 0.0.

    Raises:
        ValueError: bad dtype/shape, negative counts, or an empty histogram (nothing to learn from).

    Source: algorithm.md §4.2–§4.4, §13.2 (fit, padding), §13.10 (exact zero code).
    """
    _check_counts(counts, "fit_codebook")
    host = counts.detach().cpu().numpy()
    if (host < 0).any():
        raise ValueError("fit_codebook: counts has negative entries; pass a histogram of bin counts.")
    if host.sum() == 0:
        raise ValueError("fit_codebook: the histogram is empty; accumulate at least one gradient first.")
    active = np.flatnonzero(host)
    z = bin_centers().numpy()[active]
    fixed = np.array([-1.0, 0.0, 1.0], dtype=np.float32)
    if active.size + fixed.size <= CODEBOOK_SIZE:
        codes = np.concatenate([z, fixed])
    else:
        k = min(CODEBOOK_SIZE - 1, active.size)
        centres = optimal_partition_centers(z.astype(np.float64), host[active].astype(np.float64), k, True, solver)
        codes = centres.astype(np.float32)
        if not (codes == 0.0).any():
            codes = np.append(codes, np.float32(0.0))
    codes = np.sort(np.append(codes, np.ones(CODEBOOK_SIZE - codes.size, dtype=np.float32)))
    return torch.from_numpy(codes).to(counts.device)


@torch.no_grad()
def nearest_code(u: Tensor, codebook: Tensor) -> Tensor:
    """Index of the codebook entry nearest to each value, exact midpoints to the lower index.

    ``r`` = first index with ``c[r] >= u`` (clamped to ``K - 1``), ``l = max(r - 1, 0)``; the result is ``l``
    if ``|u - c[l]| <= |u - c[r]|`` (float32) else ``r``. So ``u < c[0]`` gives 0 and, for a codebook without
    repeated codes, ``u > c[-1]`` gives ``K - 1``. Among equal codes a ``u`` at or below them gets the first
    one; with trailing copies of +1 (``fit_codebook`` padding) a ``u > 1`` gets the second-to-last index,
    which holds the same value, and ``u <= 1`` (every normalised value) is unaffected. NaN/Inf are undefined.

    Args:
        u: float32, any shape, same device as ``codebook``.
        codebook: (K,) float32, non-decreasing.

    Returns:
        int64 indices, the shape of ``u``.

    Raises:
        ValueError: dtypes not float32, or ``codebook`` not 1-D and non-empty.

    Source: algorithm.md §4.8, §13.3.
    """
    _check_codebook_arg(codebook, "nearest_code")
    if not isinstance(u, Tensor) or u.dtype != torch.float32:
        raise ValueError(f"nearest_code: u must be a float32 tensor, got {_describe(u)}.")
    r = torch.searchsorted(codebook, u.contiguous()).clamp_(max=codebook.numel() - 1)
    left = (r - 1).clamp_(min=0)
    return torch.where((u - codebook[left]).abs() <= (u - codebook[r]).abs(), left, r)


def zero_code_index(codebook: Tensor) -> int:
    """Index that ``nearest_code`` maps 0.0 to, checked to hold exactly 0.0.

    Args:
        codebook: (K,) float32, non-decreasing.

    Returns:
        The index ``i`` with ``nearest_code(0.0) == i`` and ``codebook[i] == 0``.

    Raises:
        ValueError: the codebook has no exact 0.0 code.

    Source: algorithm.md §13.10.
    """
    index = int(nearest_code(torch.zeros(1, dtype=torch.float32, device=codebook.device), codebook)[0])
    if float(codebook[index]) != 0.0:
        raise ValueError("zero_code_index: the codebook has no exact 0.0 code; refit it with fit_codebook.")
    return index


@torch.no_grad()
def encode(m: Tensor, codebook: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize blocks to codebook indices and one magnitude per block.

    ``scale = max |m|`` per row; ``u = m / scale`` (0 for an all-zero row); ``codes = nearest_code(u)``. An
    exact 0 element gets the zero code when the codebook has one. Rows go in chunks of about 2**22 elements,
    so the temporaries (about 40 bytes per element of a chunk) stay bounded; the result equals the unchunked
    one.

    Args:
        m: (B, P) float32 with ``P >= 1``, finite (first moment viewed as blocks).
        codebook: (K,) float32, non-decreasing, ``K <= 256``.

    Returns:
        codes: (B, P) uint8.
        scale: (B,) float32, the block magnitudes.

    Raises:
        ValueError: wrong dtypes or shapes.

    Source: algorithm.md §4.8 (assignment), §6.2 (block magnitude), §10.11 (chunking).
    """
    _check_codebook_arg(codebook, "encode")
    if not isinstance(m, Tensor) or m.dtype != torch.float32 or m.dim() != 2 or m.shape[1] < 1:
        raise ValueError(f"encode: m must be a (B, P) float32 tensor with P >= 1, got {_describe(m)}.")
    if codebook.numel() > CODEBOOK_SIZE:
        raise ValueError(f"encode: codebook has {codebook.numel()} codes; uint8 holds at most 256.")
    codes = torch.empty(m.shape, dtype=torch.uint8, device=m.device)
    scale = torch.empty(m.shape[0], dtype=torch.float32, device=m.device)
    rows = max(1, _CHUNK_ELEMENTS // m.shape[1])
    for start in range(0, m.shape[0], rows):
        block = m[start : start + rows]
        a = scale[start : start + rows] = block.abs().amax(dim=1)
        u = block / torch.where(a > 0, a, torch.ones_like(a))[:, None]  # an all-zero row divides by 1
        codes[start : start + rows] = nearest_code(u, codebook)
    return codes, scale


@torch.no_grad()
def decode(codes: Tensor, scale: Tensor, codebook: Tensor) -> Tensor:
    """Dequantize: ``codebook[codes] * scale[:, None]``, one float32 rounding per element, in row chunks.

    Args:
        codes: (B, P) uint8.
        scale: (B,) float32.
        codebook: (K,) float32.

    Returns:
        (B, P) float32.

    Raises:
        ValueError: wrong dtypes or shapes.

    Source: algorithm.md §6.2 (dequantized first moment).
    """
    _check_codebook_arg(codebook, "decode")
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"decode: codes must be a (B, P) uint8 tensor, got {_describe(codes)}.")
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32 or scale.shape != codes.shape[:1]:
        raise ValueError(f"decode: scale must be float32 of shape ({len(codes)},), got {_describe(scale)}.")
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, codes.shape[1]))
    for start in range(0, codes.shape[0], rows):  # chunks bound the int32 index copy
        block = codes[start : start + rows]
        values = torch.index_select(codebook, 0, block.reshape(-1).int()).view(block.shape)
        torch.mul(values, scale[start : start + rows, None], out=out[start : start + rows])
    return out


def validate_codebook(codebook: object) -> str | None:
    """Check a codebook loaded from outside (e.g. a checkpoint).

    Args:
        codebook: anything.

    Returns:
        ``None`` if it is a (256,) float32 tensor of finite, non-decreasing values with ``c[0] == -1``,
        ``c[-1] == 1`` and an exact 0.0; otherwise a short reason.

    Source: algorithm.md §4.1 (checkpointed codebook), §13.2, §13.10.
    """
    if not isinstance(codebook, Tensor):
        return f"expected a torch.Tensor, got {type(codebook).__name__}"
    if codebook.dtype != torch.float32:
        return f"dtype must be torch.float32, got {codebook.dtype}"
    if tuple(codebook.shape) != (CODEBOOK_SIZE,):
        return f"shape must be ({CODEBOOK_SIZE},), got {tuple(codebook.shape)}"
    c = codebook.detach().cpu()
    if not bool(torch.isfinite(c).all()):
        return "has NaN or Inf values"
    if bool((c[1:] < c[:-1]).any()):
        return "is not sorted non-decreasing"
    if float(c[0]) != -1.0 or float(c[-1]) != 1.0:
        return f"must start at -1 and end at +1, got {float(c[0])} and {float(c[-1])}"
    if not bool((c == 0).any()):
        return "has no exact 0.0 code"
    return None


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _check_counts(counts: object, where: str) -> None:
    if not isinstance(counts, Tensor) or counts.dtype != torch.int64 or counts.shape != (HISTOGRAM_BINS,):
        raise ValueError(f"{where}: counts must be an int64 tensor of shape (4096,), not {_describe(counts)}")


def _check_codebook_arg(codebook: object, where: str) -> None:
    if not isinstance(codebook, Tensor) or codebook.dtype != torch.float32 or codebook.dim() != 1:
        raise ValueError(f"{where}: codebook must be a 1-D float32 tensor, got {_describe(codebook)}.")
    if codebook.numel() == 0:
        raise ValueError(f"{where}: codebook is empty.")


def _check_points(points: object, weights: object, k: object, force_endpoints: bool) -> tuple:
    z = np.asarray(points, dtype=np.float64)
    n = np.asarray(weights, dtype=np.float64)
    where = "optimal_partition_centers"
    if z.ndim != 1 or n.shape != z.shape or z.size == 0:
        raise ValueError(f"{where}: points and weights must be 1-D of equal, non-zero length.")
    if not (np.isfinite(z).all() and np.isfinite(n).all() and (n > 0).all()):
        raise ValueError(f"{where}: points must be finite and weights finite and > 0.")
    if (np.diff(z) < 0).any():
        raise ValueError(f"{where}: points must be sorted non-decreasing.")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= z.size:
        raise ValueError(f"{where}: k={k!r} must be an int in [1, len(points)={z.size}].")
    if force_endpoints and k < 2:
        raise ValueError(f"{where}: force_endpoints needs k >= 2 (one cluster pinned to -1, one to +1).")
    return z, n
