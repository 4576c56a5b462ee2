"""``gefen capacity``'s model family and its search for the largest model that fits a memory budget.

Pure bookkeeping, no processes and no tensors: :func:`model_family` lists the candidate models,
:func:`largest_fitting` finds the boundary from the outcomes of a ``probe`` callable (in the command, a training
run in a child process: :mod:`gefen.cli._capacity_probe`). Tests drive the search with made-up probes.

The family is the demo's architecture (:class:`gefen.cli._model.ByteTransformer`: byte vocabulary, RoPE, SwiGLU,
untied head) with heads of 64 channels, ``d_ff`` the SwiGLU width ``8/3 · d_model`` rounded up to a multiple of
64, and every ``(d_model, n_layers)`` whose aspect ratio ``d_model / n_layers`` lies in ``[32, 128]`` (GPT-2 small
is 64, Llama-2 7B 128), ordered by parameter count and thinned so that each model has at least 2 % more
parameters than the one before: neighbours differ by 2 to 5 % above 100M parameters (the resolution of the
answer), by up to 12 % at a few million, where widths in steps of 64 leave fewer shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "FamilyMember",
    "Outcome",
    "SearchResult",
    "largest_fitting",
    "model_family",
    "predicted_index",
]

HEAD_DIM = 64
_ASPECT = (32, 128)
_MIN_GROWTH = 1.02
_MAX_WIDTH = 16384
_MAX_LAYERS = 256
_VOCAB = 256


def swiglu_width(d_model: int) -> int:
    """SwiGLU hidden width of the family: ``ceil(8/3 · d_model / 64) · 64`` (a multiple of 64)."""
    return -(-(8 * d_model // 3) // 64) * 64


def parameter_count(d_model: int, n_layers: int, vocab_size: int = _VOCAB) -> int:
    """Parameters of a :class:`gefen.cli._model.ByteTransformer` of the family (embedding, blocks, norm, head)."""
    d_ff = swiglu_width(d_model)
    per_block = 4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model  # q/k/v/o, gate/up/down, two RMSNorms
    return 2 * vocab_size * d_model + n_layers * per_block + d_model


@dataclass(frozen=True)
class FamilyMember:
    """One candidate model: its shape and parameter count.

    Attributes:
        index: position in :func:`model_family` (0 = smallest).
        d_model: width (a multiple of 64); ``n_heads = d_model // 64``.
        n_layers: transformer blocks.
        d_ff: SwiGLU hidden width.
        params: parameter count.
    """

    index: int
    d_model: int
    n_layers: int
    d_ff: int
    params: int

    @property
    def n_heads(self) -> int:
        """Attention heads (of 64 channels each)."""
        return self.d_model // HEAD_DIM

    @property
    def label(self) -> str:
        """``"612M (d=1600, L=20)"``: parameters in millions (billions from 10 B) and the shape."""
        return f"{format_params(self.params)} (d={self.d_model}, L={self.n_layers})"


def format_params(params: int) -> str:
    """Three significant digits: ``123456789`` → ``"123M"``, ``19_512_345`` → ``"19.5M"``, ``1_234_567_890`` →
    ``"1.23B"``, ``278_912`` → ``"0.279M"`` (neighbours of the family never print alike)."""
    value, unit = (params / 1e9, "B") if params >= 10**9 else (params / 1e6, "M")
    digits = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{value:.{digits}f}{unit}"


@functools.cache
def model_family() -> tuple[FamilyMember, ...]:
    """The candidate models, smallest first (from ~0.2M to hundreds of billions of parameters).

    Returns:
        every ``(d_model, n_layers)`` with ``d_model`` a multiple of 64 up to 16384, ``n_layers`` up to 256 and
        ``32 <= d_model / n_layers <= 128``, ordered by parameter count, keeping a model only when it has at
        least 2 % more parameters than the last one kept.
    """
    shapes = sorted(
        (parameter_count(d, layers), d, layers)
        for d in range(2 * HEAD_DIM, _MAX_WIDTH + 1, HEAD_DIM)
        for layers in range(1, _MAX_LAYERS + 1)
        if _ASPECT[0] <= d / layers <= _ASPECT[1]
    )
    kept: list[FamilyMember] = []
    for params, d, layers in shapes:
        if not kept or params >= kept[-1].params * _MIN_GROWTH:
            kept.append(FamilyMember(len(kept), d, layers, swiglu_width(d), params))
    return tuple(kept)


Status = Literal["fit", "over_budget", "oom", "killed", "timeout", "error"]


@dataclass(frozen=True)
class Outcome:
    """What one candidate did in its training run.

    Attributes:
        member: the model.
        status: ``"fit"`` (3 steps done, finite losses, peak measured), ``"over_budget"`` (stopped by the
            watchdog when its peak passed ``limit_bytes``), ``"oom"`` (an allocation failed: CUDA or CPU
            allocator out of memory), ``"killed"`` (killed by a signal it did not get from us, e.g. the
            kernel's OOM killer), ``"timeout"`` or ``"error"`` (anything else: ``detail`` says what).
        peak_bytes: peak memory (CPU: resident-set high-water mark; CUDA: ``max_memory_allocated``); for a
            stopped run the level reached when it stopped (a lower bound), ``None`` if unknown.
        limit_bytes: the budget it ran under (the watchdog's or the allocator's limit), in bytes.
        state_bytes: optimizer-state bytes after the last step (``None`` unless ``fit``).
        steps: optimizer steps completed.
        losses: the training losses of those steps.
        seconds: wall time of the run, process start to exit.
        phase: where it stopped (``"build"``, ``"optimizer"``, ``"step 1"``, ... ``"done"``).
        detail: one line for a failure (the error), empty otherwise.
        extra: other measurements of the child (CUDA: ``max_memory_reserved``).
    """

    member: FamilyMember
    status: Status
    peak_bytes: int | None
    limit_bytes: int
    state_bytes: int | None = None
    steps: int = 0
    losses: tuple[float, ...] = ()
    seconds: float = 0.0
    phase: str = ""
    detail: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def fits(self, budget: int) -> bool | None:
        """Whether this run shows the model fits ``budget`` bytes (``True``), does not (``False``), or neither
        (``None``: stopped at a lower limit than ``budget``, or failed for a reason other than memory)."""
        if self.phase == "done" and self.peak_bytes is not None and self.status in ("fit", "over_budget"):
            return self.peak_bytes <= budget  # a completed run's peak is exact: it decides every budget
        if self.status in ("over_budget", "oom", "killed"):
            return False if budget <= self.limit_bytes else None
        return None


@dataclass
class SearchResult:
    """The answer for one optimizer and one budget.

    Attributes:
        budget_bytes: the budget.
        largest: the largest model that trained within it (its :class:`Outcome`), ``None`` if none did.
        next_larger: the run of the next model of the family, which did not fit (``None`` when ``largest`` is
            the family's last model or the search stopped on an error).
        error: why the search stopped early (a run failed for a reason other than memory), else ``None``.
        probes: how many training runs this budget's search started (runs reused from other budgets excluded).
    """

    budget_bytes: int
    largest: Outcome | None = None
    next_larger: Outcome | None = None
    error: Outcome | None = None
    probes: int = 0


def predicted_index(
    family: tuple[FamilyMember, ...], outcomes: list[Outcome], budget: int, prior_bytes_per_param: float
) -> int:
    """The family index expected at the boundary of ``budget``: the largest model whose predicted peak fits.

    The peak is modelled as ``base + slope · params``: the line through the measured peaks of the two completed
    runs farthest apart; with one completed run, the prior slope through its peak (intercept clamped at >= 0);
    with none, ``prior_bytes_per_param · params``.

    Args:
        family: :func:`model_family`.
        outcomes: this optimizer's runs so far (any budget).
        budget: bytes.
        prior_bytes_per_param: the slope to assume before two runs have completed (bytes per parameter).

    Returns:
        an index into ``family`` (0 when even the smallest model is predicted not to fit).
    """
    points = sorted({(o.member.params, o.peak_bytes) for o in outcomes if o.phase == "done" and o.peak_bytes})
    if len(points) >= 2 and points[-1][0] > points[0][0]:
        (n0, p0), (n1, p1) = points[0], points[-1]
        slope = max((p1 - p0) / (n1 - n0), 1.0)
        base = p0 - slope * n0
    elif points:
        n0, p0 = points[0]
        slope, base = prior_bytes_per_param, max(0.0, p0 - prior_bytes_per_param * n0)
    else:
        slope, base = prior_bytes_per_param, 0.0
    target = (budget - base) / slope
    index = 0
    for member in family:
        if member.params <= target:
            index = member.index
    return index


def largest_fitting(
    probe: Callable[[FamilyMember, int], Outcome],
    budget: int,
    outcomes: list[Outcome],
    prior_bytes_per_param: float,
    family: tuple[FamilyMember, ...] | None = None,
    max_probes: int = 24,
) -> SearchResult:
    """Find the largest family model that trains within ``budget`` bytes, by measurement.

    Each step runs the model the peak line predicts at the boundary (:func:`predicted_index`), kept strictly
    between the largest known fit and the smallest known non-fit (stepping down from a non-fit when a run has
    refuted the prediction, see :func:`_next_index`), until a fit and a non-fit are neighbours in the family.
    Runs already in ``outcomes`` (other budgets' runs) are reused where they decide this budget: a completed
    run's peak decides every budget, a run stopped at a limit decides the budgets at or below it.

    Args:
        probe: ``probe(member, budget)`` trains ``member`` under a limit of ``budget`` bytes and returns its
            :class:`Outcome`.
        budget: bytes.
        outcomes: this optimizer's earlier runs; new runs are appended.
        prior_bytes_per_param: expected peak bytes per parameter before runs say more (bytes).
        family: the candidates (default :func:`model_family`).
        max_probes: stop after this many new runs (the boundary is then as far as it was narrowed: an honest
            partial answer, never an extrapolation).

    Returns:
        the :class:`SearchResult`. A run that fails for a reason other than memory stops the search with
        ``error`` set.
    """
    family = model_family() if family is None else family
    result = SearchResult(budget)

    while result.probes < max_probes:
        fit_at = [o.member.index for o in outcomes if o.fits(budget) is True]
        fail_at = [o.member.index for o in outcomes if o.fits(budget) is False]
        low = max(fit_at, default=-1)
        high = min((i for i in fail_at if i > low), default=len(family))
        if high == low + 1:
            break
        index = _next_index(family, outcomes, budget, prior_bytes_per_param, low, high)
        outcome = probe(family[index], budget)
        outcomes.append(outcome)
        result.probes += 1
        if outcome.fits(budget) is None:  # failed for a reason other than memory (or timed out): stop here
            result.error = outcome
            break
    fit_at = [o for o in outcomes if o.fits(budget) is True]
    if fit_at:
        result.largest = max(fit_at, key=lambda o: (o.member.index, -(o.peak_bytes or 0)))
        above = [o for o in outcomes if o.fits(budget) is False and o.member.index == result.largest.member.index + 1]
        result.next_larger = above[-1] if above else None
    return result


def _next_index(
    family: tuple[FamilyMember, ...], outcomes: list[Outcome], budget: int, prior: float, low: int, high: int
) -> int:
    """The next model to run, strictly between the known fit ``low`` and non-fit ``high`` (-1 and
    ``len(family)`` when unknown): the smallest model first (it measures the fixed cost, and whether anything
    fits at all), then the predicted boundary. Where runs have already refuted the prediction: the neighbour
    above the known fit, or fewer parameters than the known non-fit, 7 % after one non-fit above the known fit
    and the step squared with each further one (7 %, 13.5 %, 25 %, 44 %): a prior far off costs a few quick
    non-fits (they stop as soon as they pass the budget), and the first fit near the boundary fixes the line."""
    completed = any(o.phase == "done" for o in outcomes)
    if not completed and not any(o.member.index == 0 and o.fits(budget) is not None for o in outcomes):
        return 0  # nothing measured yet, or only runs stopped at smaller budgets: the fixed cost first
    guess = predicted_index(family, outcomes, budget, prior)
    if low < guess < high:
        return guess
    if guess <= low:
        return low + 1
    misses = sum(1 for o in outcomes if o.member.index > low and o.fits(budget) is False)
    target = family[high].params * 0.93 ** (2 ** max(0, misses - 1))
    below = max((m.index for m in family[:high] if m.params <= target), default=0)
    return min(high - 1, max(low + 1, below))


def round_down_budget(free_bytes: int, fraction: float = 0.9) -> int:
    """``fraction`` of ``free_bytes`` rounded down to 1/4 GiB (the default CPU budget), in bytes."""
    quarter = 2**28
    return max(quarter, math.floor(free_bytes * fraction / quarter) * quarter)
