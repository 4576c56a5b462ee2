"""A parameter's first step before any state exists: its period (algorithm.md §3.2) and the codebook learned from
the first gradients (§4.2-4.3), with the ``nonfinite`` check of those gradients folded into the reads they make.

Nothing here changes an optimizer: the caller keeps the results, or drops them when a gradient was unusable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from gefen.amp import usable_bound
from gefen.kernels import group_backend, native_status
from gefen.kernels.first_step import accumulate_histogram_, find_period, first_period, first_periods, fit_codebook
from gefen.kernels.native import histogram_ as native_histogram_
from gefen.math.codebook import CODEBOOK_SIZE, HISTOGRAM_BINS
from gefen.math.period import layout_period
from gefen.optim._base import WorkItem
from gefen.sharding import BlockShard, all_reduce_, collective_device, gather_rows, state_shard

__all__ = ["FirstHistogram", "checkable_in_histogram", "search_periods"]


def checkable_in_histogram(item: WorkItem) -> bool:
    """Whether the native codebook histogram can check ``item``'s first gradient (see :class:`FirstHistogram`): a
    contiguous fp32 CPU gradient of an unsharded parameter, with the native library loaded."""
    grad = item.grad
    return (
        item.shard is None
        and grad.device.type == "cpu"
        and grad.dtype == torch.float32
        and grad.is_contiguous()
        and native_status().available
    )


class FirstHistogram:
    """The codebook histogram of the first step's gradients (algorithm.md §4.2), one parameter at a time, and the
    codebook fitted to it (§4.3).

    :func:`search_periods` adds each parameter right after its period search, while its gradient is still in the
    CPU's last-level cache. For a parameter in ``unchecked`` (see :func:`checkable_in_histogram`) the histogram's
    read is also its ``nonfinite`` check, the preflight's rule (:func:`gefen.amp.usable_bound`: a NaN, an Inf, or a
    value whose square sums would overflow fp32), so the first step reads those gradients once fewer.

    Attributes:
        bad: names of the ``unchecked`` parameters found unusable, in the order they were added.
    """

    def __init__(self, unchecked: frozenset[int] = frozenset()) -> None:
        self.unchecked = unchecked
        self.bad: list[str] = []
        self._counts: Tensor | None = None

    def add(self, item: WorkItem, period: int) -> None:
        """Add ``item``'s gradient, in blocks of ``period`` elements (its row-aligned period). An unusable gradient
        of an ``unchecked`` parameter is recorded in :attr:`bad` (the counts then mean nothing).

        Raises:
            ValueError: a NaN/Inf in a gradient the preflight checked (it cannot happen then).
            RuntimeError: the native library rejected the arguments.
        """
        if self._counts is None:
            self._counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=item.grad.device)
        if id(item.param) in self.unchecked:
            grad = item.grad  # read in memory order by the library: no reshape (checkable_in_histogram)
            if not native_histogram_(self._counts, grad, period, usable_bound(grad.numel())):
                self.bad.append(item.name)
        else:  # the preflight checked it finite: no host read here (a first step on a GPU)
            accumulate_histogram_(self._counts, item.grad.to(self._counts.device), period, checked=True)

    def codebook(self, starting: list[WorkItem]) -> tuple[Tensor, str | None]:
        """The codebook ((256,) fp32) of every gradient added, and the warning to give when it is published.

        Args:
            starting: the parameters added (their number and sizes go into the warning). Row-sharded ones sum
                their histograms over the ranks here: a collective, so every rank calls this alike.
        """
        assert not self.bad
        # none added on this rank: a sharded rank holding no block of any parameter starting now
        counts = self._counts if self._counts is not None else torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
        shard = starting[0].shard
        if shard is not None:  # blocks lie inside rows, so the summed histogram is the full tensors' histogram
            counts = all_reduce_(counts.to(collective_device(shard)), shard.group, "sum").to(counts.device)
        counts = counts.cpu()  # the one read of the histogram, for the warning and the fit
        active = int((counts > 0).sum())
        warning = None
        if active < CODEBOOK_SIZE - 1:
            n_elements = sum(item.param.numel() for item in starting)
            warning = (
                f"Gefen learned its codebook from the first step's gradients of only {len(starting)} parameter(s) "
                f"({n_elements} elements), which fill {active} of the 4096 histogram bins: the 8-bit first moment "
                f"will have only about {active + 2} distinct levels for the whole run. Make the first step() see "
                "representative gradients of all the parameters you train (the codebook is frozen after it)."
            )
        return fit_codebook(counts), warning


def search_periods(
    fresh: list[tuple[WorkItem, Mapping[str, Any]]], histogram: FirstHistogram | None = None
) -> tuple[dict[int, int], list[str]]:
    """Period of every parameter starting now, from its first non-zero gradient.

    A parameter whose gradient is exactly zero everywhere carries no information for the period search or
    the codebook: it gets no state yet (its first moment and second moment would both stay 0) and starts at
    its first non-zero gradient. The search runs natively (its scores from the C library) for CPU gradients where
    the group's backend is ``"auto"`` or ``"native"`` and the library loaded; every other gradient (a GPU's,
    ``"eager"``, ``"compiled"``) takes the reference's torch operations, all of them at once with one host read per
    device (:func:`gefen.kernels.first_step.first_periods`); their histogram adds read nothing either.

    Args:
        fresh: ``(item, group)`` of the parameters without state, in step order.
        histogram: when the codebook is still to be learned, each parameter with a period is added to it right
            after its search. A NaN/Inf the search meets in one of its ``unchecked`` parameters is reported, not
            raised; every other gradient was checked finite by the preflight.

    Returns:
        ``(periods, bad)``: ``{id(param): period}`` (after the layout rule,
        :func:`gefen.math.period.layout_period`) for the parameters with a non-zero gradient; ``bad`` the
        names of the unchecked parameters whose gradient is unusable, in step order (then nothing should be kept).

    Raises:
        ValueError: a NaN/Inf in a gradient that is not unchecked.
    """
    unchecked = histogram.unchecked if histogram is not None else frozenset()
    periods, bad = {}, []

    def found(item: WorkItem, period: int) -> None:
        periods[id(item.param)] = period
        if histogram is not None:
            histogram.add(item, period)
            if histogram.bad:
                bad.append(histogram.bad.pop())

    # not asked when nothing starts (a capturable step traced by torch.compile calls this with nothing fresh)
    native = any(item.shard is None for item, _ in fresh) and native_status().available
    searched_natively = [  # CPU gradients under "auto"/"native": the library's scores, one tensor at a time
        item
        for item, group in fresh
        if item.shard is None
        and native
        and item.grad.device.type == "cpu"
        and group_backend(group) not in ("eager", "compiled")
    ]
    # one scratch buffer for every native search of this step (a fresh one per tensor costs page faults)
    sizes = [item.grad.numel() for item in searched_natively]
    workspace = torch.empty(max(sizes) + 1, dtype=torch.float64) if sizes else None
    for item in searched_natively:
        try:
            period = first_period(item.grad, backend="native", workspace=workspace)
        except ValueError:  # a NaN or an Inf
            if id(item.param) not in unchecked:
                raise
            bad.append(item.name)
            continue
        if period is not None:
            found(item, layout_period(period, tuple(item.param.shape)))
    native_ids = {id(item) for item in searched_natively}
    batch = [item for item, _ in fresh if item.shard is None and id(item) not in native_ids]
    if batch:  # the reference's torch operations for all the others at once: one host read per device (GPUs)
        searched, nonfinite = first_periods([item.grad for item in batch], [tuple(item.param.shape) for item in batch])
        for position, (item, period) in enumerate(zip(batch, searched)):
            if position in nonfinite:
                if id(item.param) not in unchecked:
                    raise ValueError(f"find_period needs a finite gradient; {item.name} has NaN or Inf values")
                bad.append(item.name)
            elif period is not None:
                found(item, layout_period(period, tuple(item.param.shape)))
    sharded = [item for item, _ in fresh if item.shard is not None]
    if sharded:  # the same search on the full gradient on every rank, the same layout rule
        shard = sharded[0].shard
        assert shard is not None
        nonzero = torch.tensor([bool(item.grad.any()) for item in sharded], dtype=torch.int64)
        nonzero = all_reduce_(nonzero.to(collective_device(shard)), shard.group, "max")
        for item, flag in zip(sharded, nonzero.tolist()):
            if flag:
                assert item.shard is not None
                full = gather_rows(item.grad.to(torch.float32), item.shard)
                period = layout_period(find_period(full), tuple(item.param.shape))
                split = state_shard(item.shard, period)
                if isinstance(split, BlockShard):  # the histogram sums this rank's blocks, as it holds them
                    start, stop = split.elements
                    periods[id(item.param)] = period
                    if histogram is not None and stop > start:  # (a trailing rank may hold no block)
                        histogram.add(replace(item, grad=full.reshape(-1)[start:stop]), period)
                else:
                    found(item, period)
    position = {item.name: k for k, (item, _) in enumerate(fresh)}
    return periods, sorted(bad, key=lambda name: position.get(name, len(position)))
