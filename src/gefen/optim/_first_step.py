"""A parameter's first step before any state exists: its period (algorithm.md §3.2) and the codebook learned from
the first gradients (§4.2-4.3), with the ``nonfinite`` check of those gradients folded into the reads they make.

Nothing here changes an optimizer: the caller keeps the results, or drops them when a gradient was unusable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.amp import usable_bound
from gefen.kernels import group_backend, native_status
from gefen.kernels.native import histogram_ as native_histogram_
from gefen.math.codebook import CODEBOOK_SIZE, HISTOGRAM_BINS, accumulate_histogram_, fit_codebook
from gefen.math.period import find_period, first_period, per_element_blocks, row_aligned_period
from gefen.optim._base import WorkItem
from gefen.sharding import all_reduce_, collective_device, gather_rows

__all__ = ["checkable_in_histogram", "learn_codebook", "search_periods"]


def checkable_in_histogram(item: WorkItem) -> bool:
    """Whether the native codebook histogram can check ``item``'s first gradient (see :func:`learn_codebook`): a
    contiguous fp32 CPU gradient of an unsharded parameter, with the native library loaded."""
    grad = item.grad
    return (
        item.shard is None
        and grad.device.type == "cpu"
        and grad.dtype == torch.float32
        and grad.is_contiguous()
        and native_status().available
    )


def search_periods(
    fresh: list[tuple[WorkItem, Mapping[str, Any]]], unchecked: frozenset[int] = frozenset()
) -> tuple[dict[int, int], list[str]]:
    """Period of every parameter starting now, from its first non-zero gradient.

    A parameter whose gradient is exactly zero everywhere carries no information for the period search or
    the codebook: it gets no state yet (its first moment and second moment would both stay 0) and starts at
    its first non-zero gradient. The search runs natively (its scores from the C library) where the group's
    backend is ``"auto"`` or ``"native"`` and the library loaded, and on torch's ops (the reference) for
    ``"eager"`` and ``"compiled"``.

    Args:
        fresh: ``(item, group)`` of the parameters without state, in step order.
        unchecked: ``id`` of the parameters whose gradients the preflight did not check (see
            :func:`learn_codebook`): a NaN/Inf the search meets in one of them is reported, not raised. Every
            other gradient was checked finite by the preflight.

    Returns:
        ``(periods, bad)``: ``{id(param): period}`` (row-aligned, see
        :func:`gefen.math.period.row_aligned_period`) for the parameters with a non-zero gradient; ``bad`` the
        names of the ``unchecked`` parameters whose gradient holds a NaN or an Inf (no period for them).

    Raises:
        ValueError: a NaN/Inf in a gradient that is not in ``unchecked``.
    """
    periods, bad = {}, []
    sizes = [item.grad.numel() for item, _ in fresh if item.shard is None and item.grad.device.type == "cpu"]
    # one scratch buffer for every native search of this step (a fresh one per tensor costs page faults)
    workspace = torch.empty(max(sizes) + 1, dtype=torch.float64) if sizes and native_status().available else None
    for item, group in fresh:
        shape = tuple(item.param.shape)
        if item.shard is None and per_element_blocks(shape):  # biases, norm weights: nothing to search
            if bool(item.grad.any()):  # NaN counts as non-zero: the histogram finds it
                periods[id(item.param)] = 1
        elif item.shard is None:
            backend = "torch" if group_backend(group) in ("eager", "compiled") else "auto"
            try:
                period = first_period(item.grad, backend=backend, workspace=workspace)
            except ValueError:  # a NaN or an Inf
                if id(item.param) not in unchecked:
                    raise
                bad.append(item.name)
                continue
            if period is not None:
                periods[id(item.param)] = row_aligned_period(period, shape)
    sharded = [item for item, _ in fresh if item.shard is not None]
    if sharded:  # the same search on the full gradient on every rank, the same row rule
        shard = sharded[0].shard
        assert shard is not None
        nonzero = torch.tensor([bool(item.grad.any()) for item in sharded], dtype=torch.int64)
        nonzero = all_reduce_(nonzero.to(collective_device(shard)), shard.group, "max")
        for item, flag in zip(sharded, nonzero.tolist()):
            if flag:
                assert item.shard is not None
                shape = tuple(item.param.shape)
                if per_element_blocks(shape, sharded=True):
                    periods[id(item.param)] = 1
                    continue
                full = gather_rows(item.grad.to(torch.float32), item.shard)
                periods[id(item.param)] = row_aligned_period(find_period(full), shape, sharded=True)
    return periods, bad


def learn_codebook(
    starting: list[WorkItem], periods: Mapping[int, int], unchecked: frozenset[int] = frozenset()
) -> tuple[Tensor | None, str | None, list[str]]:
    """The codebook of the first step's gradients, the warning to give when it is published (if any), and the
    unusable gradients among ``unchecked``.

    The histogram reads every starting gradient once; for a parameter in ``unchecked`` (see
    :func:`checkable_in_histogram`) that read is also its ``nonfinite`` check, the preflight's rule
    (:func:`gefen.amp.usable_bound`: a NaN, an Inf, or a value whose square sums would overflow fp32), so the first
    step reads those gradients once fewer.

    Args:
        starting: the parameters starting now with a non-zero gradient, in step order.
        periods: their row-aligned periods, by ``id(param)``.
        unchecked: ``id`` of the parameters whose gradients are checked here.

    Returns:
        ``(codebook, warning, bad)``: ``codebook`` (256,) fp32 (algorithm.md §4.3), or ``None`` when ``bad``
        (names, in ``starting`` order) is not empty: then nothing should be kept.
    """
    device = starting[0].grad.device
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=device)
    bad = []
    for item in starting:
        period = periods[id(item.param)]
        if id(item.param) in unchecked:
            grad = item.grad.detach()
            if not native_histogram_(counts, grad.reshape(-1), period, usable_bound(grad.numel())):
                bad.append(item.name)
        else:
            accumulate_histogram_(counts, item.grad.to(device), period)
    if bad:
        return None, None, bad
    shard = starting[0].shard
    if shard is not None:  # blocks lie inside rows, so the summed histogram is the full tensors' histogram
        counts = all_reduce_(counts.to(collective_device(shard)), shard.group, "sum").to(device)
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
    return fit_codebook(counts), warning, []
