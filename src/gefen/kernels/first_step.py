"""The first step's operations by backend: period search, codebook histogram and codebook fit.

:mod:`gefen.math` holds the reference of each (pure torch / numpy, importing nothing above it) and takes an
accelerated piece as an argument; this module is the one place that chooses it: the native library's
(:mod:`gefen.kernels.native`) for CPU tensors where it loaded, the reference elsewhere. Same signatures as the
math functions, plus ``backend``: ``"auto"`` (the choice above), ``"native"`` (require the library) or
``"torch"``/``"numpy"`` (the reference).

Source: algorithm.md §3.2 (period scores), §4.2 (histogram), §4.3 and §13.2 (exact k-means fit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gefen.kernels import native
from gefen.math import codebook as _codebook
from gefen.math import period as _period

__all__ = [
    "find_period",
    "first_period",
    "first_periods",
    "accumulate_histogram_",
    "fit_codebook",
    "optimal_partition_centers",
]


def _use_native(backend: str, reference: str, on_cpu: bool, what: str) -> bool:
    """Whether ``backend`` asks for the native library here.

    Raises:
        ValueError: an unknown backend. RuntimeError: ``"native"`` without the library.
    """
    if backend not in ("auto", "native", reference):
        raise ValueError(f"{what}: backend must be 'auto', 'native' or {reference!r}, got {backend!r}")
    if backend == "native":
        if not native.native_status().available:
            raise RuntimeError(f"gefen native backend unavailable: {native.native_status().reason}")
        return True
    return backend == "auto" and on_cpu and native.native_status().available


def find_period(grad: Tensor, shape: tuple[int, ...] | None = None, backend: str = "auto") -> int:
    """:func:`gefen.math.period.find_period` with the native scores (:func:`gefen.kernels.native.period_scores`)
    for CPU gradients (``backend="auto"``), or as asked (``"native"``, ``"torch"``).

    Raises:
        ValueError: as the reference, or an unknown ``backend``. RuntimeError: ``"native"`` without the library.
    """
    use = _use_native(backend, "torch", grad.device.type == "cpu", "find_period")
    return _period.find_period(grad, shape, native.period_scores if use else None)


def first_period(
    grad: Tensor, shape: tuple[int, ...] | None = None, backend: str = "auto", workspace: Tensor | None = None
) -> int | None:
    """:func:`gefen.math.period.first_period` with the backend chosen as :func:`find_period` does."""
    use = _use_native(backend, "torch", grad.device.type == "cpu", "first_period")
    return _period.first_period(grad, shape, native.period_scores if use else None, workspace)


def accumulate_histogram_(
    counts: Tensor, g: Tensor, period: int, backend: str = "auto", checked: bool = False
) -> Tensor:
    """:func:`gefen.math.codebook.accumulate_histogram_` natively for a contiguous fp32 CPU gradient (identical
    counts, :func:`gefen.kernels.native.histogram_`), else the reference (``checked``: as the reference's, no host
    read then).

    Raises:
        ValueError: as the reference (a non-finite value leaves ``counts`` untouched), or an unknown ``backend``.
    """
    flat = g.reshape(-1) if isinstance(g, Tensor) else g
    eligible = (
        isinstance(flat, Tensor)
        and flat.dtype == torch.float32
        and flat.device.type == "cpu"
        and flat.is_contiguous()
        and isinstance(counts, Tensor)
        and counts.device.type == "cpu"
        and counts.is_contiguous()
    )
    if _use_native(backend, "torch", eligible, "accumulate_histogram_") and eligible:
        _codebook.check_histogram_arguments(counts, g, period)
        if not native.histogram_(counts, flat, period):
            raise ValueError("accumulate_histogram_: g has NaN or Inf values; skip or unscale this step.")
        return counts
    return _codebook.accumulate_histogram_(counts, g, period, checked)


def first_periods(grads: Sequence[Tensor], shapes: Sequence[tuple[int, ...]]) -> tuple[list[int | None], list[int]]:
    """:func:`gefen.math.period.first_period` of many first gradients by the reference's torch operations, with one
    host read per device for all of them (:func:`gefen.math.period.period_evidence`), not several per tensor: the
    first step of a model on a GPU.

    Args:
        grads: the first gradients (any devices, shapes and floating dtypes; non-empty each).
        shapes: the parameters' (global) shapes, for the fallback.

    Returns:
        ``(periods, nonfinite)``: per gradient its period, or ``None`` when it is zero everywhere (also for one
        listed in ``nonfinite``); ``nonfinite`` the positions of the gradients holding NaN or Inf.

    Raises:
        ValueError: a selected score is not finite (a finite gradient whose squares overflow), as the reference.
    """
    evidence = [_period.period_evidence(g) for g in grads]
    by_device: dict[torch.device, list[int]] = {}
    for i, e in enumerate(evidence):
        by_device.setdefault(e.device, []).append(i)
    values: list[list[float]] = [[] for _ in grads]
    for indices in by_device.values():
        flat = torch.cat([evidence[i] for i in indices]).cpu().tolist()  # the one read of this device
        offset = 0
        for i in indices:
            size = evidence[i].numel()
            values[i] = flat[offset : offset + size]
            offset += size
    periods: list[int | None] = []
    nonfinite: list[int] = []
    for i, (g, shape) in enumerate(zip(grads, shapes)):
        if not values[i][0]:
            nonfinite.append(i)
            periods.append(None)
        else:
            periods.append(_period.period_from_evidence(values[i], g.numel(), tuple(shape)))
    return periods, nonfinite


def optimal_partition_centers(
    points: np.ndarray, weights: np.ndarray, k: int, force_endpoints: bool = True, backend: str = "auto"
) -> np.ndarray:
    """:func:`gefen.math.codebook.optimal_partition_centers` with the native layers
    (:func:`gefen.kernels.native.kmeans_centres`: identical centres in milliseconds) where the library loaded
    (``"auto"``), or as asked (``"native"``, ``"numpy"``).

    Raises:
        ValueError: as the reference, or an unknown ``backend``. RuntimeError: ``"native"`` without the library.
    """
    use = _use_native(backend, "numpy", True, "optimal_partition_centers")
    solver = native.kmeans_centres if use else None
    return _codebook.optimal_partition_centers(points, weights, k, force_endpoints, solver)


def fit_codebook(counts: Tensor, backend: str = "auto") -> Tensor:
    """:func:`gefen.math.codebook.fit_codebook` with its k-means on the native library where it loaded."""
    use = _use_native(backend, "numpy", True, "fit_codebook")
    return _codebook.fit_codebook(counts, native.kmeans_centres if use else None)


