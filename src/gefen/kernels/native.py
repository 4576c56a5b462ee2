"""The native CPU backend: a plain C shared library (``libgefen_kernels``) called through ctypes.

The library (source: ``gefen/kernels/_native/gefen_kernels.c``) holds one Gefen step per parameter (block-shared or
factored second moment, algorithm.md §6.2 / §6.4) and GefenMuon's quantized momentum (§7.1 step 2), for fp32, bf16
and fp16 parameters and gradients, with run-time dispatch on the CPU's features: AVX-512 with VBMI (table look-ups
by byte shuffles), AVX-512 (F/BW/VL, gathers), AVX2 + FMA + F16C, or portable scalar C. It uses no Python C-API
and no torch C++ ABI, so one binary serves every supported Python and torch version; it is given data pointers and
one record per parameter. The record (``gefen_step_args``) and the return codes are declared once, in C: the
library exports the record's field names, offsets, sizes and types and its return codes by name, the records are
built in that layout (:func:`record_dtype`), and a library whose fields differ from the ones :func:`record` fills
is refused at load (:func:`layout_mismatch`). The per-step constants come from
:class:`gefen.kernels.scalars.StepScalars`.

Threads: the library runs its parallel loops on the process's own OpenMP runtime (the one torch loaded; found in
the process's memory map and opened with ``RTLD_NOLOAD``, so a second runtime is never loaded), with
``torch.get_num_threads()`` threads. The work is split into tasks of a fixed size, each block computed by one task,
so results are bit-identical for every thread count. Where no OpenMP runtime is found the loops run serially.

Rounding rules: those of the eager reference (:mod:`gefen.kernels.eager`); codes and magnitudes are
bit-identical to it, second moments differ by the summation order of the block/row/column sums (a few ulps).

Environment: ``GEFEN_NATIVE_LIB`` names another build of the library (the AddressSanitizer test uses it);
``GEFEN_NATIVE=0`` disables the backend (``backend="auto"`` then falls back with one warning).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gefen.kernels.scalars import NATIVE_SCALAR_FIELDS, StepScalars
from gefen.kernels.scalars import as_float32 as as_float32

__all__ = [
    "ABI_VERSION",
    "LIBRARY_ENV",
    "DISABLE_ENV",
    "NATIVE_DTYPES",
    "RECORD_FIELDS",
    "NativeStatus",
    "library_filename",
    "native_status",
    "layout_mismatch",
    "record_dtype",
    "error_codes",
    "kmeans_centres",
    "histogram_",
    "period_scores",
    "cpu_level_name",
    "force_level",
    "native_step",
    "check_arguments",
    "record",
    "run_records",
    "as_float32",
]

#: ABI version the Python side expects from ``gefen_abi_version()``.
ABI_VERSION = 7
#: Environment variable naming another build of the library.
LIBRARY_ENV = "GEFEN_NATIVE_LIB"
#: Environment variable that disables the native backend when set to ``"0"``.
DISABLE_ENV = "GEFEN_NATIVE"
#: Parameter and gradient dtypes the library handles (codes in its ``DT_*`` enum).
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KINDS = {"block": 0, "factored": 1, "momentum": 2}
_LEVELS = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512vbmi"}
#: The fields :func:`record` fills, in the order it fills them; the library's exported layout must list exactly
#: these, in this order (offsets, sizes and types are the library's: see :func:`record_dtype`).
RECORD_FIELDS = (
    ("param", "grad", "codes", "scale", "v", "v_row", "v_col", "out", "codebook", "lut", "thresholds")
    + ("numel", "period", "rows", "cols", "param_dtype", "grad_dtype", "steps", "lerp_high", "kind", "threads")
    + NATIVE_SCALAR_FIELDS[1:]
    + ("grad_bound", "global_rows", "reduce_offset", "counter")
)
#: numpy formats of the exported field types (pointer, int64, fp32).
_FORMATS = {"p": "u8", "q": "i8", "f": "f4"}
#: The return codes :func:`run_records` and the first-step wrappers tell apart, by their C names.
_CODES = ("OK", "ERR_ARGS", "ERR_NOMEM", "ERR_REDUCE", "ERR_NONFINITE", "ERR_OVERFLOW", "ERR_UNUSABLE")


#: The C ``gefen_reduce_fn``: sums a float64 buffer over the ranks in place, returns 0 on success.
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_int64)
#: A null ``gefen_reduce_fn`` (no buffer: a one-process step).
_NO_REDUCE = REDUCE_FN()


def library_filename() -> str:
    """File name of the shared library on this platform (``libgefen_kernels.so``/``.dylib``/``gefen_kernels.dll``)."""
    if sys.platform == "win32":
        return "gefen_kernels.dll"
    return "libgefen_kernels.dylib" if sys.platform == "darwin" else "libgefen_kernels.so"


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native backend can run here, and why not.

    Attributes:
        available: the library loaded and passed its ABI check.
        reason: why it is unavailable (empty when available).
        level: the CPU path it dispatches to (``"avx512vbmi"``, ``"avx512"``, ``"avx2"``,
            ``"scalar"``; empty when unavailable).
        threaded: it found the process's OpenMP runtime (else its loops run on the calling thread).
        path: the library file (empty when none was found).
    """

    available: bool
    reason: str
    level: str = ""
    threaded: bool = False
    path: str = ""


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already loaded into this process (torch's), opened without loading a second one."""
    if not sys.platform.startswith("linux"):
        return None
    names = ("libgomp", "libiomp5", "libomp")
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(n in line for n in names) and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.GOMP_parallel  # noqa: B018  (raises AttributeError when absent)
            lib.omp_get_thread_num  # noqa: B018
            lib.omp_get_num_threads  # noqa: B018
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, NativeStatus]:
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return None, NativeStatus(False, f"disabled by {DISABLE_ENV}=0")
    override = os.environ.get(LIBRARY_ENV, "").strip()
    path = Path(override) if override else Path(__file__).with_name(library_filename())
    if not path.is_file():
        where = f"{LIBRARY_ENV}={override}" if override else f"{path.name} next to {Path(__file__).parent}"
        return None, NativeStatus(
            False,
            f"the native library is missing ({where}); it is built by 'pip install' when a C compiler is present",
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, NativeStatus(False, f"the native library {path} could not be loaded: {exc}", path=str(path))
    try:
        lib.gefen_abi_version.restype = ctypes.c_int
        version = lib.gefen_abi_version()
    except AttributeError:
        return None, NativeStatus(False, f"{path} is not a gefen kernel library", path=str(path))
    if version != ABI_VERSION:
        reason = f"{path} has ABI version {version}, this gefen expects {ABI_VERSION}: reinstall gefen"
        return None, NativeStatus(False, reason, path=str(path))
    reason = layout_mismatch(_exported_fields(lib))
    if reason:
        return None, NativeStatus(False, f"{path}: {reason}; reinstall gefen", path=str(path))
    _ERRORS.update(_exported_codes(lib))
    missing = [name for name in _CODES if name not in _ERRORS]
    if missing:
        return None, NativeStatus(False, f"{path} does not export the return codes {missing}; reinstall gefen")
    lib.gefen_step_many_reduce.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        REDUCE_FN,
        ctypes.c_void_p,
    ]
    lib.gefen_step_many_reduce.restype = ctypes.c_int
    pointer, int64, double = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.gefen_kmeans_centres.argtypes = [pointer] * 3 + [int64] * 3 + [double] * 2 + [pointer, int64]
    lib.gefen_kmeans_centres.restype = ctypes.c_int
    lib.gefen_histogram.argtypes = [pointer, int64, int64, pointer, int64, ctypes.c_float]
    lib.gefen_histogram.restype = ctypes.c_int
    lib.gefen_period_scores.argtypes = [pointer, int64, pointer, int64, pointer, pointer, pointer, int64]
    lib.gefen_period_scores.restype = ctypes.c_int
    lib.gefen_cpu_level.restype = ctypes.c_int
    lib.gefen_force_level.argtypes = [ctypes.c_int]
    lib.gefen_force_level.restype = ctypes.c_int
    lib.gefen_set_threading.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    omp = _openmp_runtime()
    if omp is not None:
        address = ctypes.cast
        lib.gefen_set_threading(
            address(omp.GOMP_parallel, ctypes.c_void_p),
            address(omp.omp_get_thread_num, ctypes.c_void_p),
            address(omp.omp_get_num_threads, ctypes.c_void_p),
        )
    level = _LEVELS.get(lib.gefen_cpu_level(), "scalar")
    return lib, NativeStatus(True, "", level, omp is not None, str(path))


def _exported_fields(lib: ctypes.CDLL) -> list[tuple[str, int, int, str]]:
    """The record's fields as the library declares them: ``(name, offset, size, type)`` in declaration order."""
    lib.gefen_step_field.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.gefen_step_field.restype = ctypes.c_int64
    lib.gefen_step_record_size.restype = ctypes.c_int64
    name, offset, size, kind = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_char()
    refs = [ctypes.byref(x) for x in (name, offset, size, kind)]
    fields = []
    for i in range(lib.gefen_step_field(-1, None, None, None, None)):
        if lib.gefen_step_field(i, *refs) != 0 or name.value is None:
            break
        fields.append((name.value.decode(), offset.value, size.value, kind.value.decode()))
    fields.append(("", lib.gefen_step_record_size(), 0, ""))  # the record's size, as an end marker
    return fields


def _exported_codes(lib: ctypes.CDLL) -> dict[str, int]:
    lib.gefen_error_code.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.gefen_error_code.restype = ctypes.c_int
    name, value, codes = ctypes.c_char_p(), ctypes.c_int(), {}
    i = 0
    while lib.gefen_error_code(i, ctypes.byref(name), ctypes.byref(value)) == 0 and name.value is not None:
        codes[name.value.decode()] = value.value
        i += 1
    return codes


def layout_mismatch(fields: list[tuple[str, int, int, str]]) -> str:
    """Why an exported record layout cannot be filled by :func:`record` (empty string: it can).

    Args:
        fields: ``(name, offset, size, type)`` per field in declaration order, then ``("", record size, 0, "")``.

    Returns:
        A reason naming the first difference: another field name or order than :data:`RECORD_FIELDS`, an unknown
        type, a size that does not fit its type, overlapping fields or a record size that does not hold them.
    """
    *named, (_, total, _, _) = fields
    names = tuple(f[0] for f in named)
    if names != RECORD_FIELDS:
        shorter = min(len(names), len(RECORD_FIELDS))
        diff = next((i for i, (a, b) in enumerate(zip(names, RECORD_FIELDS)) if a != b), shorter)
        have = names[diff] if diff < len(names) else "(end)"
        want = RECORD_FIELDS[diff] if diff < len(RECORD_FIELDS) else "(end)"
        return f"its step record has field {have!r} where this gefen fills {want!r} (field {diff})"
    end = 0
    for name, offset, size, kind in named:
        if kind not in _FORMATS or size != np.dtype(_FORMATS[kind]).itemsize:
            return f"its step record's field {name!r} has type {kind!r} of {size} bytes"
        if offset < end:
            return f"its step record's field {name!r} at offset {offset} overlaps the previous one"
        end = offset + size
    if total < end:
        return f"its step record is {total} bytes, less than its fields' {end}"
    return ""


def record_dtype() -> np.dtype:
    """The numpy dtype of one step record, in the library's exported layout.

    Raises:
        RuntimeError: the library is unavailable.
    """
    return _record_dtype(_require())


@functools.cache
def _record_dtype(lib: ctypes.CDLL) -> np.dtype:
    *named, (_, total, _, _) = _exported_fields(lib)
    return np.dtype(
        {
            "names": [f[0] for f in named],
            "formats": [_FORMATS[f[3]] for f in named],
            "offsets": [f[1] for f in named],
            "itemsize": total,
        }
    )


#: The library's return codes by name (filled when it loads).
_ERRORS: dict[str, int] = {}


def error_codes() -> dict[str, int]:
    """The library's return codes by their C names (``"OK"``, ``"ERR_ARGS"``, ...).

    Raises:
        RuntimeError: the library is unavailable, or does not export a code this module tells apart.
    """
    _require()
    missing = [name for name in _CODES if name not in _ERRORS]
    if missing:
        raise RuntimeError(f"gefen native library does not export the return codes {missing}")
    return _ERRORS


def native_status() -> NativeStatus:
    """Whether the native C backend runs in this process, at which CPU level, and why not when it does not.

    The CPU default (``backend="auto"``) steps every fp32/bf16/fp16 CPU parameter with this library when it is
    available; otherwise those parameters take the eager step (same results, slower) and the optimizer warns
    once, at its first step. Which backend actually ran each parameter's latest step is the ``"backend"``
    entry of ``optimizer.state_report()``.

    The library is loaded (and checked: ABI version, record layout, return codes) on the first call and the
    answer is cached for the process, so ``GEFEN_NATIVE=0`` and ``GEFEN_NATIVE_LIB`` must be set before it.

    Returns:
        :class:`NativeStatus`: ``available`` (bool); ``reason`` (str, empty when available: e.g. "the native
        library is missing (...)", "disabled by GEFEN_NATIVE=0", an ABI mismatch); ``level`` (the CPU path,
        ``"avx512vbmi"``, ``"avx512"``, ``"avx2"`` or ``"scalar"``; empty when unavailable); ``threaded``
        (bool: it runs on torch's OpenMP threads); ``path`` (str: the library file, empty when none was found).
        Never raises.

    Example:
        >>> import gefen
        >>> status = gefen.native_status()
        >>> status.available == (status.reason == "")
        True
    """
    return _load()[1]


def cpu_level_name() -> str:
    """The CPU path in use now (``"avx512vbmi"``, ``"avx512"``, ``"avx2"`` or ``"scalar"``), honouring
    :func:`force_level`.

    Raises:
        RuntimeError: the library is unavailable (see :func:`native_status`).
    """
    lib = _require()
    return _LEVELS[lib.gefen_force_level(_forced[0])]


_forced = [-1]


def force_level(level: str | None) -> str:
    """Use at most the CPU path ``level`` (``"scalar"``, ``"avx2"``, ``"avx512"``, ``"avx512vbmi"``) or the best
    one (``None``).

    For tests and benchmarks: every path the CPU supports can be checked against the reference on one machine.
    A level above what the CPU supports means the best supported one.

    Returns:
        The path now in use.

    Raises:
        RuntimeError: the library is unavailable. ValueError: an unknown level name.
    """
    lib = _require()
    codes = {name: code for code, name in _LEVELS.items()}
    if level is not None and level not in codes:
        raise ValueError(f"unknown CPU level {level!r}; expected one of {sorted(codes)} or None")
    _forced[0] = -1 if level is None else codes[level]
    return _LEVELS[lib.gefen_force_level(_forced[0])]


def _require() -> ctypes.CDLL:
    lib, status = _load()
    if lib is None:
        raise RuntimeError(f"gefen native backend unavailable: {status.reason}")
    return lib


def check_arguments(
    kind: str,
    *,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    tables: tuple[Tensor, Tensor, Tensor],
    steps: int,
    period: int,
    param: Tensor | None = None,
    second: tuple[Tensor, ...] = (),
    out: Tensor | None = None,
    shape: tuple[int, int] = (0, 0),
    **_: object,
) -> None:
    """Refuse any argument that would make the library read or write out of bounds (it trusts its record).

    Raises:
        ValueError: a tensor of the wrong size, dtype, device or layout, or an inconsistent period/shape.
    """

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"native_step({kind!r}): {what}")

    def plain(t: Tensor, name: str, dtype: torch.dtype | None, numel: int) -> None:
        need(t.device.type == "cpu" and t.is_contiguous(), f"{name} must be a contiguous CPU tensor")
        need(dtype is None or t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
        need(t.numel() == numel, f"{name} has {t.numel()} elements, expected {numel}")

    need(kind in _KINDS, f"unknown kind {kind!r}")
    numel = grad.numel()
    need(numel > 0 and period > 0 and numel % period == 0, f"period {period} must divide numel {numel} > 0")
    need(grad.dtype in NATIVE_DTYPES, f"grad dtype {grad.dtype} is not supported")
    plain(grad, "grad", None, numel)
    plain(codes, "codes", torch.uint8, numel)
    plain(scale, "scale", torch.float32, numel // period)
    codebook, lut, thresholds = tables
    plain(codebook, "codebook", torch.float32, 256)
    plain(lut, "lut", torch.int32, 4097)
    plain(thresholds, "thresholds", torch.float32, 255 + steps)
    need(0 <= steps <= 255, f"steps {steps} out of range")
    if kind == "momentum":
        need(out is not None, "out is required")
        assert out is not None
        plain(out, "out", torch.float32, numel)
        return
    need(param is not None and param.dtype in NATIVE_DTYPES, "param must be a float32/bfloat16/float16 tensor")
    assert param is not None
    plain(param, "param", None, numel)
    if kind == "block":
        need(len(second) == 1, "block needs (v,)")
        plain(second[0], "v", torch.float32, numel // period)
    else:
        rows, cols = shape
        need(len(second) == 2 and rows * cols == numel and rows > 0, f"factored needs (v_row, v_col) and {shape=}")
        plain(second[0], "v_row", torch.float32, rows)
        plain(second[1], "v_col", torch.float32, cols)


def native_step(
    kind: str,
    *,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    tables: tuple[Tensor, Tensor, Tensor],
    steps: int,
    period: int,
    beta1: float,
    param: Tensor | None = None,
    second: tuple[Tensor, ...] = (),
    out: Tensor | None = None,
    shape: tuple[int, int] = (0, 0),
    beta2: float = 0.0,
    eps: float = 1.0,
    lr: float = 0.0,
    weight_decay: float = 0.0,
    step: int = 1,
) -> None:
    """One native step of one parameter (or GefenMuon's momentum), in place.

    Args:
        kind: ``"block"`` (§6.2), ``"factored"`` (§6.4) or ``"momentum"`` (§7.1 step 2: codes, magnitudes and
            ``out`` only).
        grad: (N,) contiguous gradient, fp32/bf16/fp16.
        codes: (B, P) uint8; scale: (B,) fp32 (contiguous) — the first moment, updated in place.
        tables: ``(codebook (256,) fp32, lut (4097,) int32, thresholds fp32)`` on the CPU, contiguous.
        steps: compares after the bucket look-up (:class:`gefen.math.lookup.NearestCodeTable`).
        period: block length ``P``.
        beta1: the first-moment decay ``β1`` (Muon: ``momentum``); the EMA weight is ``1 − β1``.
        param: (N,) contiguous parameter, fp32/bf16/fp16 (not for ``"momentum"``).
        second: ``(v,)`` (B,) for block; ``(v_row, v_col)`` (R,), (C,) for factored; fp32, updated in place.
        out: (N,) fp32 receiving ``m̂`` (``"momentum"`` only).
        shape: ``(R, C)`` of a factored parameter.
        beta2, eps, lr, weight_decay: the group's hyperparameters (Python floats).
        step: the parameter's step counter after increment (``t >= 1``), for the bias corrections.

    Raises:
        ValueError: an argument that does not fit the others (size, dtype, device, layout); nothing was changed.
        RuntimeError: the library is unavailable or rejected the arguments (nothing was changed then).

    Source: algorithm.md §6.2, §6.4, §7.1; rounding as :mod:`gefen.kernels.eager`.
    """
    _require()
    tensors = {
        "grad": grad,
        "codes": codes,
        "scale": scale,
        "tables": tables,
        "steps": steps,
        "period": period,
        "param": param,
        "second": second,
        "out": out,
        "shape": shape,
    }
    check_arguments(kind, **tensors)
    scalars = StepScalars(beta1, beta2, eps, lr, weight_decay)
    run_records([record(kind, **tensors, scalars=scalars, step=step)])


def record(
    kind: str,
    *,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    tables: tuple[Tensor, Tensor, Tensor],
    steps: int,
    period: int,
    scalars: StepScalars,
    param: Tensor | None = None,
    second: tuple[Tensor, ...] = (),
    out: Tensor | None = None,
    shape: tuple[int, int] = (0, 0),
    step: int = 1,
    threads: int | None = None,
    global_rows: int = 0,
    reduce_offset: int = 0,
    grad_bound: float = 0.0,
    counter: Tensor | None = None,
) -> tuple[object, ...]:
    """The step record of one call of :func:`native_step` as a tuple (:data:`RECORD_FIELDS` order), unchecked.

    ``scalars`` is the group's per-step record; its constants for ``step`` (the counter after increment) fill the
    record's scalar fields, computed in float64 and rounded to fp32 once when the record is stored.

    ``global_rows > 0`` marks this rank's rows of a row-sharded (FSDP2) factored parameter with ``global_rows``
    rows in all: its column sums and row-moment total go to ``reduce_offset`` in the buffer of
    :func:`run_records`, which sums them over the ranks before the moments are updated.

    ``grad_bound > 0`` checks the gradient before anything is written: a NaN or a value with ``|g| > grad_bound``
    (compared in fp32; :func:`gefen.amp.usable_bound` gives the bound) refuses the whole call, nothing changed, and
    :func:`run_records` names the record. 0 leaves it unchecked.

    ``counter``: the parameter's int64 step counter (a contiguous 1-element CPU tensor, checked here), which the
    library increments once the whole call has been applied (not on a refused or failed call).

    ``threads`` defaults to ``torch.get_num_threads()``. The per-step constants are computed in float64 exactly as
    the eager reference computes its Python scalars and
    rounded to fp32 once when the record is stored (as torch rounds a Python scalar); ``1/sqrt(bc2)`` and
    ``w − 1`` are rounded in fp32 by the library, as torch computes them. The caller keeps every tensor alive until
    :func:`run_records` returns and has checked them (:func:`native_step` does, with :func:`check_arguments`).
    """
    codebook, lut, thresholds = tables
    lerp, *constants = scalars.native_fields(step, kind)
    return (
        param.data_ptr() if param is not None else 0,
        grad.data_ptr(),
        codes.data_ptr(),
        scale.data_ptr(),
        second[0].data_ptr() if kind == "block" else 0,
        second[0].data_ptr() if kind == "factored" else 0,
        second[1].data_ptr() if kind == "factored" else 0,
        out.data_ptr() if out is not None else 0,
        codebook.data_ptr(),
        lut.data_ptr(),
        thresholds.data_ptr(),
        grad.numel(),
        period,
        shape[0],
        shape[1],
        NATIVE_DTYPES[param.dtype] if param is not None else 0,
        NATIVE_DTYPES[grad.dtype],
        steps,
        lerp,
        _KINDS[kind],
        torch.get_num_threads() if threads is None else threads,
        *constants,
        grad_bound,
        global_rows,
        reduce_offset,
        _counter_pointer(counter),
    )


def _counter_pointer(counter: Tensor | None) -> int:
    if counter is None:
        return 0
    if counter.dtype != torch.int64 or counter.device.type != "cpu" or counter.numel() != 1:
        raise ValueError(f"a step counter must be a 1-element int64 CPU tensor, got {counter.dtype} {counter.shape}")
    return counter.data_ptr()


def run_records(
    records: list[tuple[object, ...]],
    buffer: Tensor | None = None,
    reduce: Callable[[Tensor], None] | None = None,
) -> list[int]:
    """Run the native steps of several parameters in one library call (two parallel regions over all of them).

    Args:
        records: from :func:`record`, for parameters that do not share any state tensor.
        buffer: for row-sharded factored records (``global_rows > 0``): a zeroed float64 CPU tensor of
            ``sum(cols + 1) + 1`` elements (their pieces at their ``reduce_offset``, then a status slot); every rank
            passes the same length, also a rank without such a record (its pieces stay zero).
        reduce: sums ``buffer`` over the ranks in place (an all-reduce); called exactly once when ``buffer`` is
            given, between the statistics and the first write.

    Returns:
        Indices (into ``records``, ascending) of the records whose gradient failed their ``grad_bound`` check; when
        it is not empty nothing was changed. Empty when the step was applied.

    Raises:
        RuntimeError: the library is unavailable, rejected a record, or a rank failed (nothing was changed then,
            on any rank).
        Exception: what ``reduce`` raised (nothing was changed).
    """
    lib = _require()
    if not records and buffer is None:
        return []
    array = np.array(records, dtype=_record_dtype(lib)) if records else None
    unusable = np.zeros(max(len(records), 1), dtype=np.uint8)
    failures: list[BaseException] = []
    callback = _NO_REDUCE
    if buffer is not None:
        if reduce is None or buffer.dtype != torch.float64 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("run_records needs a contiguous float64 CPU buffer and a reduce function")

        def call(pointer: Any, length: int) -> int:
            try:
                reduce(buffer)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the library returned
                failures.append(exc)
                return 1
            return 0

        callback = REDUCE_FN(call)
    rc = lib.gefen_step_many_reduce(
        array.ctypes.data if array is not None else None,
        len(records),
        buffer.data_ptr() if buffer is not None else None,
        buffer.numel() if buffer is not None else 0,
        callback,
        unusable.ctypes.data,
    )
    if failures:
        raise failures[0]
    codes = error_codes()
    if rc == codes["ERR_UNUSABLE"]:
        return np.flatnonzero(unusable[: len(records)]).tolist()
    if rc == codes["ERR_REDUCE"]:
        raise RuntimeError("gefen native step: another rank failed before the reduce; nothing was changed")
    if rc != 0:
        raise RuntimeError(f"gefen native step rejected its arguments (code {rc}); nothing was changed")
    return []


def kmeans_centres(prefix: np.ndarray, k: int, force_endpoints: bool, slack: tuple[float, float]) -> np.ndarray:
    """The layers and backtrack of the exact 1-D k-means of the codebook fit, natively.

    The same programme, float64 arithmetic and tie rule as :func:`gefen.math.codebook.optimal_partition_centers`
    (which prepares the arguments and remains the reference); each layer by divide and conquer on the monotone
    arg-min with the reference's rounding-slack windows, taken breadth first (the rows of one depth overlap in the
    CPU), eight candidates per AVX-512 vector where the CPU has it, the two halves of each layer on two of torch's
    threads; so the centres are identical.

    Args:
        prefix: (3, A + 1) float64, C-contiguous: the prefix sums W, X, Q of weights, weighted points and
            weighted squares.
        k: number of clusters, ``2 <= k <= A``.
        force_endpoints: pin the first centre to -1 and the last to +1.
        slack: ``(c0, c1)``, the rounding bound of ``gefen.math.codebook._rounding_slack``.

    Returns:
        (k,) float64 centres, ascending.

    Raises:
        RuntimeError: the library is unavailable, or refused the arguments, or ran out of memory.

    Source: algorithm.md §4.3, §13.2.
    """
    lib = _require()
    prefix = np.ascontiguousarray(prefix, dtype=np.float64)
    if prefix.ndim != 2 or prefix.shape[0] != 3:
        raise RuntimeError(f"kmeans_centres needs (3, A + 1) prefix sums, got shape {prefix.shape}")
    size = prefix.shape[1] - 1
    out = np.empty(k, dtype=np.float64)
    rows = [prefix[r].ctypes.data for r in range(3)]
    rc = lib.gefen_kmeans_centres(
        *rows, size, k, int(force_endpoints), slack[0], slack[1], out.ctypes.data, torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"gefen native k-means refused its arguments (code {rc}: A={size}, k={k})")
    return out


def histogram_(counts: Tensor, g: Tensor, period: int, bound: float = 0.0) -> bool:
    """Add the codebook histogram of one fp32 gradient to ``counts`` natively, on torch's threads.

    The bins of :func:`gefen.math.codebook.accumulate_histogram_` (the reference), computed with the same fp32
    operations (true division by the block maximum), so the counts are identical.

    Args:
        counts: (4096,) int64, CPU, contiguous; updated in place.
        g: fp32, CPU, contiguous, ``g.numel() % period == 0``.
        period: elements per block, >= 1.
        bound: > 0 also refuses a value with ``|g| > bound`` (compared in fp32, the bound rounded to fp32 as
            :func:`as_float32` does): with :func:`gefen.amp.usable_bound` this read doubles as the NaN/Inf check of
            a first step (the same rule as the preflight's :func:`gefen.amp.unusable_names`). 0: no bound.

    Returns:
        ``True`` when added; ``False`` (``counts`` untouched) when ``g`` holds a NaN, an infinity or a value beyond
        ``bound``.

    Raises:
        RuntimeError: the library is unavailable, or the arguments do not fit.

    Source: algorithm.md §4.2.
    """
    lib = _require()
    fits = counts.dtype == torch.int64 and counts.numel() == 4096 and counts.is_contiguous() and not counts.is_cuda
    if not (fits and g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu"):
        raise RuntimeError("histogram_ needs (4096,) int64 counts and a contiguous fp32 CPU gradient")
    numel = g.numel()
    if period < 1 or numel == 0 or numel % period:
        raise RuntimeError(f"histogram_: period {period} does not divide {numel} elements")
    if not bound >= 0.0:
        raise RuntimeError(f"histogram_: bound {bound!r} is not >= 0")
    rc = lib.gefen_histogram(g.data_ptr(), numel, period, counts.data_ptr(), torch.get_num_threads(), as_float32(bound))
    codes = error_codes()
    if rc == codes["ERR_NOMEM"]:
        raise RuntimeError("gefen native histogram: out of memory")
    if rc not in (codes["OK"], codes["ERR_UNUSABLE"]):
        raise RuntimeError(f"gefen native histogram refused its arguments (code {rc})")
    return rc == 0


def period_scores(g: Tensor, candidates: list[int], workspace: Tensor | None = None) -> tuple[list[float] | None, bool]:
    """The period-search scores of one fp32 gradient natively, with its finiteness and non-zero checks.

    The programme of :func:`gefen.math.period.period_scores` (the reference) on ``x = g * g``: float64 logs
    ``ln(x + 1e-12)`` (the library's own log, a few ulp), centred, one prefix sum, the mean absolute difference of
    adjacent block means per candidate; in a fixed order, so the same scores for any thread count and CPU. A
    candidate ``p`` reads the prefix only at multiples of ``p``, so the candidates are grouped into classes whose
    periods share a group size ``G``: the multiples of 8 (``G = 8``), then the others by their gcd (e.g. ``G = 11``
    for a 512 x 1408 weight, whose candidates are multiples of 8 and 11, 22, 44). Each class keeps one prefix value
    per ``G`` elements, the sum of their logs taken as the logs of products of up to 12 consecutive
    ``(x + 1e-12) * 2**-44`` (no overflow or underflow for any finite fp32 ``g * g``; the constant shift cancels in
    the centring): one log per 8 or 11 elements instead of one per element. When some class would need
    ``G = 1`` (or grouping would not save work) one per-element prefix serves all. The rounding differs from the
    reference's torch ops: scores agree to about 1e-12 relative (the tests hold them to 1e-11).

    Args:
        g: fp32, CPU, contiguous, ``N = g.numel() >= 1`` elements.
        candidates: periods ``p`` dividing ``N`` with ``N / p >= 2`` (may be empty: the checks only).
        workspace: optional float64 CPU contiguous scratch of at least ``N + 1`` elements, overwritten. A caller
            that searches many tensors passes one (a fresh ``N``-sized buffer costs more in page faults than the
            search itself); without it the library allocates its own.

    Returns:
        ``(scores, nonzero)``: one float per candidate, or ``None`` when some ``g * g`` overflows fp32 (the
        caller then uses the reference); ``nonzero`` is whether any element of ``g`` is non-zero.

    Raises:
        ValueError: ``g`` holds a NaN or an infinity.
        RuntimeError: the library is unavailable, or the arguments do not fit, or it ran out of memory.

    Source: algorithm.md §3.2 step 3.
    """
    lib = _require()
    if not (g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu" and g.numel() > 0):
        raise RuntimeError("period_scores needs a non-empty contiguous fp32 CPU gradient")
    work = 0
    if workspace is not None:
        if not (workspace.dtype == torch.float64 and workspace.is_contiguous() and workspace.device.type == "cpu"):
            raise RuntimeError("period_scores: the workspace must be a contiguous float64 CPU tensor")
        if workspace.numel() < g.numel() + 1:
            raise RuntimeError(f"period_scores: workspace of {workspace.numel()} < N + 1 = {g.numel() + 1} elements")
        work = workspace.data_ptr()
    # ctypes arrays, not numpy ones: numpy's .ctypes.data costs ~3 us per array, and a first step calls this once
    # per weight
    count = len(candidates)
    cands = (ctypes.c_int64 * count)(*candidates)
    scores = (ctypes.c_double * count)()
    nonzero = ctypes.c_int64(0)
    rc = lib.gefen_period_scores(
        g.data_ptr(),
        g.numel(),
        ctypes.addressof(cands),
        count,
        ctypes.addressof(scores),
        ctypes.addressof(nonzero),
        work,
        torch.get_num_threads(),
    )
    codes = error_codes()
    if rc == codes["ERR_NONFINITE"]:
        raise ValueError("find_period needs a finite gradient; got NaN or Inf values")
    if rc == codes["ERR_NOMEM"]:
        raise RuntimeError("gefen native period search: out of memory")
    if rc not in (codes["OK"], codes["ERR_OVERFLOW"]):
        raise RuntimeError(f"gefen native period search refused its arguments (code {rc}: N={g.numel()})")
    return (scores[:] if rc == codes["OK"] else None), bool(nonzero.value)
