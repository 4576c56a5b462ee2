"""Step backends of the Gefen optimizers and the one place that chooses between them.

A *backend* runs the per-parameter update of algorithm.md §6.2 (block second moment), §6.4 (factored) and GefenMuon's
quantized momentum (§7.1 step 2) on the state tensors. They share one contract: same inputs (parameter, gradient,
codes, magnitudes, second moment, the codebook's nearest-code tables, the group's hyperparameters and the step
counter), same in-place outputs, and the rounding rules of the eager reference:

* ``"eager"``: the torch reference (``gefen.math.moments``, orchestrated by ``Gefen._update``). Every intermediate
  is fp32; the EMA is torch's lerp (``fma(w, g − m, m)`` for ``w < 0.5``, else ``fma(w − 1, g − m, g)``);
  ``u = m / a`` is a true division; the nearest code is the exact §4.8 rule; the parameter is written once,
  ``fma(d, −η·k, p·(1 − ηλ))``, rounded to nearest even in its own dtype.
* ``"compiled"``: ``torch.compile``\\ d graphs of the same chain (``gefen.kernels.fused``; inductor C++ on CPU, Triton
  on CUDA). Compile time is paid once per parameter signature.
* ``"native"``: the C library of :mod:`gefen.kernels.native` (CPU, SIMD with run-time dispatch, torch's OpenMP
  threads), no compile time.

Every backend gives codes and magnitudes bit-identical to the reference; second moments (and through them the
parameters) may differ by the summation order of their sums, a few ulps (the tests state the bound).

``backend="auto"`` (the default) means: native on CPU where the library loaded, compiled on CUDA (unless
``GEFEN_FUSED=0``), eager otherwise (float64 parameters, other devices, sharded DTensor parameters). The old
``fused`` flag is an alias: ``fused=True`` is ``backend="compiled"``, ``fused=False`` is ``backend="eager"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.kernels.native import NATIVE_DTYPES, native_status

__all__ = ["BACKENDS", "resolve_backend_option", "group_backend", "native_supports", "auto_backend"]

#: The accepted ``backend`` values.
BACKENDS = ("auto", "native", "compiled", "eager")


def resolve_backend_option(kind: str, backend: Any, fused: Any, error: type[Exception]) -> str:
    """The ``backend`` a constructor call asks for, with the ``fused`` alias folded in.

    Args:
        kind: the optimizer's class name (for messages).
        backend: the ``backend`` argument.
        fused: the ``fused`` argument (``None``, ``True`` or ``False``).
        error: exception class for invalid values (``ConfigError``).

    Returns:
        One of :data:`BACKENDS`.

    Raises:
        error: an unknown backend, or ``fused`` contradicting an explicit ``backend``.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise error(f"{kind}: backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}.")
    if fused is None:
        return backend
    alias = "compiled" if fused else "eager"
    if backend not in ("auto", alias):
        raise error(
            f"{kind}: fused={fused!r} means backend={alias!r}, which contradicts backend={backend!r}; "
            "pass only backend= (fused is a deprecated alias)."
        )
    return alias


def group_backend(group: Mapping[str, Any]) -> str:
    """The backend a param group asks for: its ``backend`` key, else its legacy ``fused`` flag, else ``"auto"``."""
    backend = group.get("backend")
    if backend not in (None, "auto"):
        return str(backend)
    fused = group.get("fused")
    if fused is True:
        return "compiled"
    if fused is False:
        return "eager"
    return "auto"


def native_supports(param: Tensor, grad_dtype: torch.dtype) -> str:
    """Why the native backend cannot step this parameter (empty string: it can).

    Args:
        param: the parameter (plain tensor).
        grad_dtype: its gradient's dtype (float64 gradients are cast to fp32 first).
    """
    status = native_status()
    if not status.available:
        return status.reason
    if param.device.type != "cpu":
        return f"the parameter is on {param.device.type} (the native backend is CPU-only)"
    if param.dtype not in NATIVE_DTYPES:
        return f"the parameter is {param.dtype} (native supports float32/bfloat16/float16)"
    if grad_dtype not in NATIVE_DTYPES and grad_dtype != torch.float64:
        return f"the gradient is {grad_dtype}"
    return ""


def auto_backend(param: Tensor, grad_dtype: torch.dtype, compiled_by_default: bool) -> tuple[str, str]:
    """What ``backend="auto"`` runs for one parameter, and why it is not native (for the one fallback warning).

    Returns:
        ``(backend, reason)``: ``backend`` is ``"native"``, ``"compiled"`` or ``"eager"``; ``reason`` says why the
        native library is unavailable, and is empty otherwise (also when a float64 parameter simply runs eagerly).
    """
    if param.device.type == "cpu":
        status = native_status()
        if not status.available:
            return "eager", status.reason
        return ("native", "") if not native_supports(param, grad_dtype) else ("eager", "")
    if param.device.type == "cuda" and compiled_by_default:
        return "compiled", ""
    return "eager", ""
