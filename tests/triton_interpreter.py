"""Triton's interpreter for the tests: the Gefen Triton kernels run on CPU tensors, with a round-once fma.

:func:`interpreted_kernels` checks that the process runs Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before triton is imported, where there is no GPU) and patches the interpreter's fma: triton 3.7.1 computes
``tl.fma`` as ``x * y + z`` in numpy (two roundings, ``InterpreterBuilder.create_fma``); the GPU rounds once.

What the interpreter does NOT show (the GPU check must): the GPU's division and square-root instructions, flush-to-zero
of subnormals, FP contraction, races and memory ordering between programs (they run one after another), integer
atomics under contention, compile-time limits and speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 ``x·y + z`` rounded once: the product is exact in float64 (24 + 24 bits); the float64 sum's error ``e``
    comes from TwoSum; rounding that sum to odd (when ``e != 0`` and its last bit is even, step one float64 ulp
    towards ``e``) and then to fp32 gives the correctly rounded result (53 >= 24 + 2 bits: no double rounding)."""
    with np.errstate(invalid="ignore", over="ignore"):  # Inf/NaN operands: e is NaN, no nudge
        p = x.astype(np.float64) * y.astype(np.float64)
        z64 = z.astype(np.float64)
        s = p + z64
        b = s - p
        e = (p - (s - b)) + (z64 - b)
    nudge = np.isfinite(s) & (e != 0) & ((s.view(np.int64) & 1) == 0)
    return np.where(nudge, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s).astype(np.float32)


@contextmanager
def interpreted_kernels() -> Iterator[object]:
    """The Triton kernels module, running in the interpreter, with the round-once fp32 fma, for the block.

    Raises:
        pytest.skip: the process does not run Triton's interpreter (``TRITON_INTERPRET=1``, which conftest.py sets
            before triton is imported where there is no GPU; a GPU machine compiles the kernels instead).
    """
    from triton.runtime import interpreter

    from gefen.kernels import _triton_kernels as kernels

    if not isinstance(kernels.update_kernel, interpreter.InterpretedFunction):
        pytest.skip("Triton's interpreter is off in this process (a GPU is present: the kernels compile for it)")
    original = interpreter.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):  # type: ignore[no-untyped-def]
        if z.data.dtype == np.float32:
            return interpreter.TensorHandle(fma32(x.data, y.data, z.data), z.dtype.scalar)
        return original(self, x, y, z)

    from gefen.kernels import triton_check

    interpreter.InterpreterBuilder.create_fma = create_fma
    triton_check._VERDICTS.clear()  # verdicts are per process: none taken without the round-once fma is kept
    try:
        yield kernels
    finally:
        interpreter.InterpreterBuilder.create_fma = original
        triton_check._VERDICTS.clear()


class HostReads(TorchDispatchMode):
    """Counts the host reads (``aten._local_scalar_dense``: every ``.item()``, ``bool()``, ``int()`` of a tensor) made
    while it is active: a steady Triton step must make none."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))
