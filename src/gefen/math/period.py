"""Block-period search: how many consecutive elements of a flattened tensor share one second moment and one
first-moment magnitude.

This module owns the period search of algorithm.md §3 in the variant chosen in §13.1: the log-domain
adjacent-block-difference score of §3.2 (at least 4 blocks, strict local maximum with ``p > 8``, the 1024 cap),
followed by the memory-safe fallback of §3.4 whenever the score selects 1 for a tensor of at least 8 elements.
The variant name is :data:`PERIOD_SEARCH_VARIANT`; checkpoints record it, and a restored period is never
re-predicted (that is the optimizer's business, not this module's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "layout_period",
    "is_short_rowed",
    "spans_rows",
    "SHORT_ROW",
    "PERIOD_SEARCH_VARIANT",
    "MIN_BLOCKS",
    "PERIOD_CAP",
    "FALLBACK_PERIOD_CAP",
    "divisors",
    "largest_divisor_at_most",
    "period_scores",
    "period_scores_tensor",
    "period_evidence",
    "period_from_evidence",
    "search_period",
    "fallback_period",
    "find_period",
    "first_period",
]

#: Name of the period-search variant, written into every checkpoint (algorithm.md §13.1).
PERIOD_SEARCH_VARIANT = "log-adjacent-diff+memory-safe-fallback/v1"
#: Minimum number of blocks a candidate period must leave (algorithm.md §3.2 step 1, "DMNB").
MIN_BLOCKS = 4
#: Periods above this are split to the smallest divisor that exceeds it (algorithm.md §3.2 step 5).
PERIOD_CAP = 1024
#: Largest single block the memory-safe fallback creates (algorithm.md §3.4).
FALLBACK_PERIOD_CAP = 2048
#: Smallest period the score may select; candidates ``p <= 8`` are skipped (algorithm.md §3.2 step 4).
_MIN_SELECTED_PERIOD = 8
#: Offset inside the logarithm, ``ln(x + delta)`` (algorithm.md §3.2).
_LOG_DELTA = 1e-12


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` excluding ``n`` itself, ascending.

    Args:
        n: a positive integer.

    Returns:
        Ascending list, e.g. ``12 -> [1, 2, 3, 4, 6]``, ``13 -> [1]``, ``1 -> []``.

    Raises:
        ValueError: ``n < 1``.

    Source: algorithm.md §2.1.
    """
    if n < 1:
        raise ValueError(f"divisors(n) needs n >= 1, got n={n}")
    return list(_divisors(n))


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    """:func:`divisors` as a tuple, cached: a model repeats a few shapes, and the loop runs to ``sqrt(n)``."""
    small: list[int] = []
    large: list[int] = []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return tuple(d for d in small + large[::-1] if d != n)


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` (``n`` itself allowed) that is ``<= cap``; at least 1.

    Args:
        n: a positive integer.
        cap: upper bound, ``>= 1``.

    Returns:
        An integer ``d`` with ``n % d == 0`` and ``1 <= d <= max(cap, 1)``.

    Source: algorithm.md §2.2 (FX variant).
    """
    if n <= cap:
        return n
    best = 1
    for d in divisors(n):
        if d <= cap:
            best = d
    return best


def period_scores(x: Tensor, candidates: list[int]) -> list[float]:
    """Log-domain adjacent-block-difference score ``S(p)`` of every candidate period at once.

    ``l_i = ln(x_i + 1e-12)``; ``m_b`` = mean of ``l`` over block ``b`` of ``p`` consecutive elements;
    ``S(p) = mean_b |m_{b+1} - m_b|``; exactly 0 for every ``p`` when all ``x_i`` are equal (as in exact
    arithmetic: the rounding of the centring would otherwise leave noise for the selection to pick). All
    candidates are scored from one float64 prefix sum of the (mean-centred) logs, so the cost is
    ``O(N + sum_p N/p)`` instead of ``O(N · #candidates)``.

    Args:
        x: squared gradient, any shape, real floating dtype, ``N = x.numel()``; non-negative.
        candidates: periods ``p`` dividing ``N`` with ``N / p >= 2``.

    Returns:
        One float per candidate, in the same order (one host read: :func:`period_scores_tensor` reads none).

    Source: algorithm.md §3.2 step 3.
    """
    return period_scores_tensor(x, candidates).tolist()


def period_scores_tensor(x: Tensor, candidates: list[int]) -> Tensor:
    """:func:`period_scores` as a ``(len(candidates),)`` float64 tensor on ``x``'s device, computed without reading
    anything on the host (the constant case is selected on the device), so that many tensors' scores can be read
    at once."""
    n = x.numel()
    if not candidates:
        return torch.zeros(0, dtype=torch.float64, device=x.device)
    flat = x.reshape(-1)
    constant = (flat == flat[0]).all()  # every score is then exactly 0 (rounding noise must not pick a period)
    logs = torch.log(flat.to(torch.float64) + _LOG_DELTA)
    logs.sub_(logs.mean())  # centring keeps the prefix sum small, so block means stay accurate
    prefix = torch.zeros(n + 1, dtype=torch.float64, device=x.device)
    torch.cumsum(logs, dim=0, out=prefix[1:])
    # Two work buffers reused by every candidate (in-place operations, no fresh N-sized tensors: on the CPU the
    # page faults of those cost more than the arithmetic); the same IEEE operations as a fresh diff() chain.
    blocks = n // min(candidates)
    means_buf, diffs_buf = logs[:blocks], torch.empty(max(blocks - 1, 1), dtype=torch.float64, device=x.device)
    scores = []
    for p in candidates:
        edges = prefix[::p]  # prefix sums at every block boundary: (N/p + 1,)
        b = edges.numel() - 1
        means = torch.sub(edges[1:], edges[:-1], out=means_buf[:b]).div_(p)
        diffs = torch.sub(means[1:], means[:-1], out=diffs_buf[: b - 1]).abs_()
        scores.append(diffs.mean())
    stacked = torch.stack(scores)
    return torch.where(constant, torch.zeros_like(stacked), stacked)


def _candidates(n: int, max_period: int | None = None) -> list[int]:
    """The candidate periods of §3.2 step 1: divisors of ``n`` leaving at least :data:`MIN_BLOCKS` blocks."""
    return [p for p in divisors(n) if n // p >= MIN_BLOCKS and (max_period is None or p <= max_period)]


def _needed(cands: list[int]) -> list[int]:
    """Positions in ``cands`` whose scores the selection of §3.2 step 4 reads: every eligible interior candidate
    (``p > 8``, not the last) and its two neighbours. The others (the small ``p`` whose scores cost the most) are
    never computed."""
    needed: set[int] = set()
    for k in range(1, len(cands) - 1):
        if cands[k] > _MIN_SELECTED_PERIOD and cands[k] != cands[-1]:
            needed.update((k - 1, k, k + 1))
    return sorted(needed)


@functools.lru_cache(maxsize=256)
def _search_plan(n: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """``(candidates, needed positions, their periods)`` of a tensor of ``n`` elements (cached per ``n``: a model
    has few distinct sizes; the lists are read, never changed)."""
    cands = _candidates(n)
    needed = _needed(cands)
    return cands, needed, tuple(cands[k] for k in needed)


def _select(cands: list[int], scores: dict[int, float]) -> int:
    """§3.2 steps 4-5 on the scores by position (every position :func:`_needed` lists): the period, or 1."""
    best: tuple[float, int] | None = None
    for k in range(1, len(cands) - 1):
        p = cands[k]
        if p <= _MIN_SELECTED_PERIOD or p == cands[-1]:
            continue
        if scores[k] > scores[k - 1] and scores[k] > scores[k + 1]:
            if best is None or (scores[k], p) > best:
                best = (scores[k], p)
    if best is None:
        return 1
    if not math.isfinite(best[0]):
        raise ValueError(f"period search selected a non-finite score {best[0]} (non-finite gradient?)")
    period = best[1]
    if period > PERIOD_CAP:
        period = min(q for q in divisors(period) + [period] if q > PERIOD_CAP)
    return period


def search_period(x: Tensor, max_period: int | None = None) -> int:
    """Select a period from the squared gradient by the log-domain adjacent-block score (no fallback).

    The reference (torch) implementation; only the scores the selection reads are computed.

    Args:
        x: squared gradient ``g**2``, any shape, real floating dtype; finite and non-negative.
        max_period: optional extra cap on the candidates (off by default).

    Returns:
        ``1`` or a divisor ``P >= 9`` of ``N = x.numel()``; a selection above 1024 is split to the smallest
        divisor of it that exceeds 1024.

    Raises:
        ValueError: the selected score is not finite (non-finite input).

    Source: algorithm.md §3.2.
    """
    cands = _candidates(x.numel(), max_period)
    needed = _needed(cands)
    if not needed:  # fewer than 3 candidates, or none above 8 in the interior
        return 1
    scores = dict(zip(needed, period_scores(x, [cands[k] for k in needed])))
    return _select(cands, scores)


def fallback_period(numel: int, shape: tuple[int, ...]) -> int:
    """Memory-safe period for a tensor whose score selected 1: one block per row or per <=2048 elements.

    Args:
        numel: number of elements ``N`` of the (local) tensor.
        shape: the parameter's (global) shape.

    Returns:
        ``max`` of the last dimension (when the tensor is at least 2-D, that dimension is ``>= 8`` and divides
        ``N``) and the largest divisor of ``N`` that is ``<= 2048`` (when ``>= 8``); ``N`` itself (one block)
        when neither qualifies; ``1`` when ``N < 8``.

    Source: algorithm.md §3.4, with §13.1 (never per-element storage for ``N >= 8``) deciding the last case.
    """
    if numel < 8:
        return 1
    cands = []
    if len(shape) >= 2 and shape[-1] >= 8 and numel % shape[-1] == 0:
        cands.append(shape[-1])
    cap = largest_divisor_at_most(numel, FALLBACK_PERIOD_CAP)
    if cap >= 8:
        cands.append(cap)
    # §13.1: no tensor of >= 8 elements is stored per element. When nothing above qualifies (a prime numel
    # above 2048, or e.g. 3 x prime), the whole tensor is one block rather than 9 bytes/param.
    return max(cands) if cands else numel


#: An accelerated score function (e.g. :func:`gefen.kernels.native.period_scores`): ``(flat fp32 contiguous
#: gradient, candidate periods, optional float64 workspace) -> (scores or None, any non-zero)``; ``None`` scores
#: leave the decision to the reference. Raises ValueError for a non-finite gradient.
ScoreFunction = Callable[[Tensor, list[int], "Tensor | None"], tuple["list[float] | None", bool]]


def _searched_period(
    grad: Tensor, scores: ScoreFunction | None, want_nonzero: bool, workspace: Tensor | None = None
) -> tuple[int, bool]:
    """The §3.2 period of a gradient of ``N >= 2`` elements (before the fallback) and whether it is non-zero
    anywhere (always ``True`` unless ``want_nonzero``); with ``scores``, the candidates are scored by it."""
    if scores is not None:
        # the accelerated scores read the elements in memory order, whatever the shape: a contiguous fp32 gradient
        # goes as it is (each detach / reshape / to costs ~5-10 us of dispatch, ~1 ms over a model's first step)
        plain = grad.dtype == torch.float32 and grad.is_contiguous()
        flat = grad if plain else grad.detach().reshape(-1).to(torch.float32).contiguous()
        cands, needed, periods = _search_plan(flat.numel())
        values, nonzero = scores(flat, list(periods), workspace)
        if values is not None:  # None: some g * g overflows fp32, where the reference's rounding decides
            return (_select(cands, dict(zip(needed, values))) if needed else 1), nonzero
    g32 = grad.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(g32).all()):
        raise ValueError("find_period needs a finite gradient; got NaN or Inf values")
    nonzero = bool(g32.any()) if want_nonzero else True
    return search_period(g32.square()), nonzero


def period_evidence(grad: Tensor) -> Tensor:
    """Everything the period search of a first gradient reads, as one float64 tensor on ``grad``'s device, computed
    without a host read: ``[finite, non-zero, S(p) for each p the selection reads]`` (1.0/0.0 flags, then the scores
    of :func:`period_scores_tensor` for :func:`_search_plan`'s periods). Many gradients' evidence can be read in one
    transfer and decided on the host by :func:`period_from_evidence`.

    Args:
        grad: a first gradient, any shape, real floating dtype, ``N >= 1`` elements.

    Returns:
        ``(2 + k,)`` float64, ``k`` the number of scores the selection of a tensor of ``N`` elements reads.
    """
    g32 = grad.detach().reshape(-1).to(torch.float32)
    flags = torch.stack([torch.isfinite(g32).all(), g32.ne(0).any()]).to(torch.float64)
    periods = _search_plan(g32.numel())[2] if g32.numel() >= 2 else ()
    if not periods:
        return flags
    return torch.cat([flags, period_scores_tensor(g32.square(), list(periods))])


def period_from_evidence(evidence: list[float], numel: int, shape: tuple[int, ...]) -> int | None:
    """:func:`first_period`'s answer from :func:`period_evidence` (read on the host).

    Args:
        evidence: the values of :func:`period_evidence` of a gradient of ``numel`` elements.
        numel: ``N``; shape: the parameter's (global) shape, for the fallback.

    Returns:
        ``None`` when the gradient is zero everywhere, else the period (§3.2 search, §3.4 fallback).

    Raises:
        ValueError: the gradient holds NaN or Inf values, or a selected score is not finite.
    """
    if not evidence[0]:
        raise ValueError("find_period needs a finite gradient; got NaN or Inf values")
    if not evidence[1]:
        return None
    if numel == 1:
        return 1
    cands, needed, _ = _search_plan(numel)
    period = _select(cands, dict(zip(needed, evidence[2:]))) if needed else 1
    return period if period != 1 else fallback_period(numel, shape)


#: Rows of at most this many elements are too short to share anything: the search itself never selects a period of
#: 8 or less (algorithm.md §3.2 step 4), and a block of ``P`` elements costs ``8/P`` bytes per element on top of the
#: codes (block second moment), so blocks of a few elements would bring back AdamW's per-element cost.
SHORT_ROW = 8


def is_short_rowed(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` has rows too short to hold a block (:data:`SHORT_ROW` elements or fewer per
    dim-0 slice): 1-D tensors, ``(R, 1)`` columns, thin ``(R, C <= 8)`` matrices, ``(C, 1, 1, 1)`` or ``(C, 2, 2)``
    tensors. 0-D and single-element tensors are not (they have one element, nothing to share)."""
    numel = math.prod(shape)
    return len(shape) > 0 and numel > 1 and numel // shape[0] <= SHORT_ROW


def layout_period(period: int, shape: tuple[int, ...]) -> int:
    """The one layout rule: the period a parameter of ``shape`` keeps, given the period of its flattened first
    gradient (the §3.2 search with the §3.4 fallback, :func:`first_period`). Every shape gets blocks of more than
    :data:`SHORT_ROW` elements (or the whole tensor, when it has fewer), so its state is ``1 + 8/P`` bytes/element
    (block second moment; ``1 + 4/P`` momentum only) plus the counters: about one byte, whatever the shape.

    * **Rows long enough** (``L = numel / shape[0] > 8``, every ordinary weight): a block never straddles a row
      (a slice along dim 0, the unit FSDP2's ``Shard(0)`` splits ranks by, so the block geometry is the same on 1
      or N ranks). The searched period is kept when it divides ``L``; one spanning whole rows becomes ``L`` (one
      block per row); one that does not tile rows becomes the largest divisor of ``L`` below it, unless that
      divisor is ``<= 8`` (a prime factor in ``L``: ``(1024, 34)`` with a searched 16 would get blocks of 2), in
      which case the block is the whole row.
    * **Rows too short** (:func:`is_short_rowed`: 1-D biases and norm weights, ``(4096, 1)`` per-row scales,
      ``(R, 2)``, ``(C, 1, 1, 1)``): cutting the period to the row would leave blocks of ``<= 8`` elements (9
      bytes/element for one-element rows, more than AdamW's 8), so the tensor is treated as flattened: it keeps the
      period of its flattened gradient, and its blocks span rows. Such a tensor has the block second moment (its
      Adafactor row/column statistics would cost ``4(R + C)/N >= 4`` bytes/element, see
      :func:`gefen.state.is_factorable`). Under FSDP2 its blocks are sharded by blocks instead of rows
      (:mod:`gefen.sharding`), so its state is the same on 1 or N ranks too.

    A checkpoint carries each parameter's period: a state saved under an earlier rule (e.g. the one-element blocks
    gefen gave 1-D parameters up to 65,536 elements) loads and keeps its own period, never re-predicted.

    Args:
        period: the flattened gradient's period (:func:`first_period`), dividing ``numel``.
        shape: the parameter's (global) shape.

    Returns:
        ``P`` dividing ``numel``: ``period`` itself for short-rowed, 0-D and single-element shapes, else a
        divisor of ``L`` above 8 or ``L``.

    Source: algorithm.md §3 and §13.1 (no per-element storage for a tensor of 8 elements or more), with the
    row-aligned blocks of Gefen's sharding design.
    """
    numel = math.prod(shape)
    if len(shape) == 0 or numel <= 1 or is_short_rowed(shape):
        return period
    row_length = numel // shape[0]
    if row_length % period == 0:
        kept = period
    elif period > row_length:
        kept = row_length
    else:
        kept = largest_divisor_at_most(row_length, period)
    return kept if kept > SHORT_ROW else row_length


def spans_rows(shape: tuple[int, ...], period: int) -> bool:
    """Whether blocks of ``period`` elements of a parameter of ``shape`` straddle its rows (dim-0 slices): the
    flattened layout of a short-rowed shape (:func:`layout_period`), or a period saved under gefen's earlier free
    rule. Such a state is sharded by blocks under FSDP2, a row-aligned one by rows."""
    if len(shape) == 0 or shape[0] == 0:
        return False
    return (math.prod(shape) // shape[0]) % period != 0


def first_period(
    grad: Tensor,
    shape: tuple[int, ...] | None = None,
    scores: ScoreFunction | None = None,
    workspace: Tensor | None = None,
) -> int | None:
    """:func:`find_period` for a parameter's first gradient, or ``None`` when that gradient is zero everywhere.

    An all-zero gradient carries no information for the search (nor for the codebook): the optimizer starts such
    a parameter at its first non-zero gradient. ``workspace``: optional float64 CPU scratch of at least
    ``grad.numel() + 1`` elements for the accelerated ``scores``, reused across calls (saves the page faults of a
    fresh buffer per tensor). Other arguments, errors and source as :func:`find_period`.
    """
    n = grad.numel()
    if n == 0:
        raise ValueError("find_period needs a non-empty gradient (zero-numel parameters are skipped)")
    shape = tuple(grad.shape if shape is None else shape)
    if n == 1 or scores is None:  # the reference: one host read (period_evidence)
        return period_from_evidence(period_evidence(grad).tolist(), n, shape)
    period, nonzero = _searched_period(grad, scores, want_nonzero=True, workspace=workspace)
    if not nonzero:
        return None
    return period if period != 1 else fallback_period(n, shape)


def find_period(grad: Tensor, shape: tuple[int, ...] | None = None, scores: ScoreFunction | None = None) -> int:
    """Period of one parameter from its first gradient: the §3.2 score, then the §3.4 fallback.

    Args:
        grad: the parameter's first gradient, any shape, real floating dtype, finite values.
        shape: the parameter's global shape (defaults to ``grad.shape``); used only by the fallback.
        scores: ``None`` for the reference's scores (:func:`search_period`), or an accelerated score function of the
            same programme (:data:`ScoreFunction`; :func:`gefen.kernels.first_step.find_period` passes the native
            library's, whose scores agree with the reference's to about 1e-12 relative, so only a near-exact tie
            between two candidates can be decided differently).

    Returns:
        ``P`` dividing ``grad.numel()``: ``1`` for ``N < 8``, otherwise the searched period or the fallback,
        never 1.

    Raises:
        ValueError: ``grad`` is empty or has non-finite values.

    Source: algorithm.md §3.2, §3.4 and §13.1.
    """
    n = grad.numel()
    if n == 0:
        raise ValueError("find_period needs a non-empty gradient (zero-numel parameters are skipped)")
    if n == 1:
        return 1
    period, _ = _searched_period(grad, scores, want_nonzero=False)
    if period == 1:
        period = fallback_period(n, tuple(grad.shape if shape is None else shape))
    return period
