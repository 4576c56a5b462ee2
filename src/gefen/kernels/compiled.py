"""The compiled fast path: one ``torch.compile``\\ d kernel per step signature, compiled once and cached.

A *signature* is everything that selects a graph: second-moment kind, the parameter's block view shape, period,
parameter and gradient dtypes, device type, the nearest-code table's compare count and the lerp branch. Values
that change every step (lr, bias corrections, weight decay) travel in a tensor, so they never recompile.

Each signature gets its own copy of the kernel's code object, so dynamo keeps one cache entry per code object
and the number of distinct shapes in a model is never limited by ``torch._dynamo.config.recompile_limit``
(which would otherwise silently fall back to eager after 8 shapes). Compilation happens in :meth:`prepare`, on
scratch tensors, before the optimizer touches any state: a signature that cannot be compiled is reported there
(the optimizer then refuses the step or falls back to its eager twin) and never half-applies a step.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gefen.errors import ConfigError
from gefen.kernels.fused import (
    factored_roots_,
    fused_block_step_,
    fused_factored_update_,
    fused_momentum_,
    kernel_grad,
)
from gefen.kernels.scalars import COMPILED_LAYOUT, as_float32, lerp_high

__all__ = [
    "KernelSignature",
    "StepKernels",
    "COMPILED_DTYPES",
    "BASE_OPTIONS",
    "UPDATE_OPTIONS",
    "FUSED_ENV",
    "compile_supported",
    "constants_on",
    "as_float32",
    "lerp_high",
    "host_only",
    "kernel_grad",
    "fused_by_default",
]

#: Parameter dtypes the compiled kernels handle (float64 stays on the eager path, as in algorithm.md §6.5).
COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Inductor options of every kernel (scoped to our graphs, never set globally): indices into the codebook and
#: bucket tables are in range by construction (uint8 codes, clamped buckets, ``+inf``-padded thresholds), so the
#: per-lane bounds assertions are dropped.
BASE_OPTIONS: dict[str, object] = {"assert_indirect_indexing": False}

#: Options of the update graphs: high realize thresholds let inductor recompute the dequantized momentum in the
#: second loop over a block instead of writing and re-reading a full fp32 copy of it (8 bytes/element of memory
#: traffic). Not for the factored denominator graph, where they would recompute row/column roots per element.
UPDATE_OPTIONS: dict[str, object] = {
    **BASE_OPTIONS,
    "realize_opcount_threshold": 10_000,
    "realize_reads_threshold": 10_000,
    "realize_acc_reads_threshold": 10_000,
}


#: Recompilations allowed per kernel when global state changes between steps (see :meth:`StepKernels.run`).
RECOMPILE_LIMIT = 64

#: Environment variable that sets what ``fused=None`` means: ``"1"`` (default) compiled where it works, ``"0"``
#: always eager (e.g. short test runs where compile time would dominate). ``fused=True/False`` ignore it.
FUSED_ENV = "GEFEN_FUSED"


def fused_by_default() -> bool:
    """What ``fused=None`` resolves to: the :data:`FUSED_ENV` setting (``"1"`` unless set to ``"0"``).

    Raises:
        ConfigError: the variable holds anything but ``"0"`` or ``"1"``.
    """
    value = os.environ.get(FUSED_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"environment variable {FUSED_ENV}={value!r} must be '0' (eager) or '1' (compiled).")
    return value == "1"


def constants_on(device: torch.device, rows: list[list[float]]) -> Tensor:
    """Per-step kernel constants as one fp32 tensor on ``device``, without a host synchronisation.

    Args:
        device: the parameters' device.
        rows: one list of floats per parameter (e.g. :meth:`gefen.kernels.scalars.StepScalars.compiled_row`).

    Returns:
        (len(rows), len(rows[0])) fp32 on ``device``. On accelerators the host tensor is pinned (torch's caching
        host allocator keeps the block alive until the copy is done) and copied asynchronously.
    """
    host = torch.tensor(rows, dtype=torch.float32)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_HOST_STEP_REASON = (
    "a capturable=False Gefen-optimizer step reads counters and hyperparameters on the host and runs its own compiled "
    "kernels; build the optimizer with capturable=True (tensor lr) and run one eager warm-up step to compile "
    "the whole step, or keep step() out of the fullgraph region"
)


def host_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a ``capturable=False`` step as never traced by ``torch.compile`` (``torch.compiler.disable``, with
    the reason shown in dynamo's message where this torch supports one): under ``torch.compile(opt.step)`` it
    runs as is, its own compiled kernels included; under ``fullgraph=True`` dynamo refuses it before it runs."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=_HOST_STEP_REASON)
    return torch.compiler.disable(fn)


@functools.cache
def _dynamo_supported() -> bool:
    try:
        return bool(torch._dynamo.is_dynamo_supported())
    except Exception:  # pragma: no cover - exotic builds
        return False


def compile_supported() -> bool:
    """Whether ``torch.compile`` can run here: dynamo supports this Python/platform and is not disabled
    (``TORCH_COMPILE_DISABLE=1`` or ``torch._dynamo.config.disable``, under which compiled graphs would
    silently run as slow eager code)."""
    return _dynamo_supported() and not torch._dynamo.config.disable


@dataclass(frozen=True)
class KernelSignature:
    """What selects one compiled graph.

    Attributes:
        kind: ``"block"``, ``"factored"`` (Gefen) or ``"momentum"`` (GefenMuon's quantized momentum only).
        shape: the parameter's shape as the kernel sees it: ``(B, P)`` for block and momentum, ``(R, C)`` for
            factored.
        period: block length ``P``.
        param_dtype, grad_dtype: dtypes of the parameter and its gradient.
        device_type: ``"cpu"``, ``"cuda"``, ...
        steps: compares after the nearest-code table look-up (from the codebook's table).
        lerp_high: ``1 − β1 >= 0.5``.
        deterministic: built with inductor's ``deterministic`` option (no runtime autotuning of reduction
            configurations, which could pick another summation order in another process); the optimizer's
            ``deterministic=True``.
    """

    kind: Literal["block", "factored", "momentum"]
    shape: tuple[int, ...]
    period: int
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    device_type: str
    steps: int
    lerp_high: bool
    deterministic: bool = False

    def eligible(self) -> bool:
        """Whether a compiled kernel exists for this signature (else the eager path runs)."""
        if self.param_dtype not in COMPILED_DTYPES or not self.grad_dtype.is_floating_point:
            return False
        if self.grad_dtype == torch.float64 or self.device_type not in ("cpu", "cuda"):
            return False
        return True


def _block_kernel(steps: int, lerp_high: bool) -> Callable[..., None]:
    def gefen_block_step(param, grad, codes, scale, v, codebook, lut, thresholds, scalars):  # type: ignore[no-untyped-def]
        fused_block_step_(
            param, grad, codes, scale, v, codebook, lut, thresholds, scalars, steps=steps, lerp_high=lerp_high
        )

    return gefen_block_step


def _factored_kernel(steps: int, lerp_high: bool, dense: bool) -> Callable[..., None]:
    """The factored step: its roots graph, then its update graph (both compiled by the caller)."""

    def gefen_factored_roots(grad, v_row, v_col, scalars):  # type: ignore[no-untyped-def]
        return factored_roots_(grad, v_row, v_col, scalars, dense=dense)

    def gefen_factored_update(param, grad, codes, scale, roots, codebook, lut, thresholds, scalars):  # type: ignore[no-untyped-def]
        fused_factored_update_(
            param, grad, codes, scale, roots, codebook, lut, thresholds, scalars, steps=steps, lerp_high=lerp_high
        )

    return gefen_factored_roots, gefen_factored_update


def _chain_factored(roots: Callable[..., tuple[Tensor, ...]], update: Callable[..., None]) -> Callable[..., None]:
    """The factored step as one callable: ``(param, grad)`` in (R, C), the state, tables and scalars."""

    def gefen_factored_step(param, grad, codes, scale, v_row, v_col, codebook, lut, thresholds, scalars):  # type: ignore[no-untyped-def]
        blocks = codes.shape
        factors = roots(grad, v_row, v_col, scalars)
        update(param.view(blocks), grad.view(blocks), codes, scale, factors, codebook, lut, thresholds, scalars)

    return gefen_factored_step


def _momentum_kernel(steps: int, lerp_high: bool) -> Callable[..., None]:
    def gefen_momentum(param, grad, codes, scale, out, codebook, lut, thresholds, scalars):  # type: ignore[no-untyped-def]
        fused_momentum_(grad, codes, scale, out, codebook, lut, thresholds, scalars, steps=steps, lerp_high=lerp_high)

    return gefen_momentum


def _own_code_object(fn: Callable[..., None], tag: int) -> Callable[..., None]:
    """A copy of ``fn`` with its own code object (dynamo caches compiled graphs per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class StepKernels:
    """Cache of compiled Gefen step kernels, one per :class:`KernelSignature`.

    Attributes:
        compile_time_s: total wall time spent compiling (seconds), including the scratch run of each new
            signature.
        failures: signature -> the exception text of a failed compilation (those run eagerly).
    """

    def __init__(self) -> None:
        self._kernels: dict[KernelSignature, Callable[..., None]] = {}
        self.compile_time_s = 0.0
        self.failures: dict[KernelSignature, str] = {}

    def __len__(self) -> int:
        return len(self._kernels)

    def get(self, signature: KernelSignature) -> Callable[..., None] | None:
        """The compiled kernel of ``signature`` if :meth:`prepare` succeeded for it, else ``None``."""
        return self._kernels.get(signature)

    def run(self, signature: KernelSignature, *args: Tensor) -> None:
        """Run the kernel of a prepared ``signature`` on real tensors.

        Dynamo re-specialises a graph when a guard on global state fails (thread count, autocast, deterministic
        mode); each code object here is ours alone, so such recompiles are allowed well past dynamo's default
        limit of 8 (:data:`RECOMPILE_LIMIT`), scoped to this call.

        Raises:
            KeyError: ``signature`` was not prepared.
            Exception: whatever a recompilation raises; the signature is then recorded in :attr:`failures`
                (the next :meth:`prepare` of it raises) and the caller falls back to the eager path.
        """
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                self._kernels[signature](*args)
        except Exception as exc:
            self.failures[signature] = f"{type(exc).__name__}: {exc}"
            raise

    def prepare(self, signature: KernelSignature, device: torch.device, tables: tuple[Tensor, Tensor, Tensor]) -> None:
        """Compile ``signature`` (once) by running it on scratch tensors; never touches real state.

        Args:
            signature: an :meth:`KernelSignature.eligible` signature.
            device: where the parameter lives.
            tables: ``(codebook, lut, thresholds)`` on ``device`` (fp32).

        Raises:
            RuntimeError: (any exception from ``torch.compile``/inductor) compilation failed; the signature is
                recorded in :attr:`failures` and the caller decides between refusing and falling back.
        """
        if signature in self.failures:
            raise RuntimeError(self.failures[signature])
        if signature in self._kernels:
            return
        tag = len(self._kernels) + len(self.failures)

        def compile_one(fn: Callable[..., Any], options: dict[str, object]) -> Callable[..., Any]:
            options = {**options, "deterministic": True} if signature.deterministic else dict(options)
            return torch.compile(_own_code_object(fn, tag), fullgraph=True, dynamic=False, options=options)

        if signature.kind == "block":
            compiled = compile_one(_block_kernel(signature.steps, signature.lerp_high), UPDATE_OPTIONS)
        elif signature.kind == "momentum":
            compiled = compile_one(_momentum_kernel(signature.steps, signature.lerp_high), UPDATE_OPTIONS)
        else:
            dense = signature.shape[1] % signature.period != 0
            roots, update = _factored_kernel(signature.steps, signature.lerp_high, dense)
            compiled = _chain_factored(compile_one(roots, BASE_OPTIONS), compile_one(update, UPDATE_OPTIONS))
        started = time.perf_counter()
        try:
            compiled(*_scratch_arguments(signature, device, tables))
        except Exception as exc:
            self.failures[signature] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.compile_time_s += time.perf_counter() - started
        self._kernels[signature] = compiled


def _scratch_arguments(
    signature: KernelSignature, device: torch.device, tables: tuple[Tensor, Tensor, Tensor]
) -> list[Tensor]:
    """Throw-away inputs with the signature's shapes, dtypes and device (zeros; a valid step)."""
    shape, period = signature.shape, signature.period
    numel = 1
    for size in shape:
        numel *= size
    blocks = numel // period

    def zeros(size: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    scalars = torch.tensor([0.1, 0.999, 0.001, 1e-8, 1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float32, device=device)
    assert scalars.numel() == len(COMPILED_LAYOUT)
    head = [zeros(shape, signature.param_dtype), zeros(shape, signature.grad_dtype)]
    moment = [zeros((blocks, period), torch.uint8), zeros((blocks,), torch.float32)]
    if signature.kind == "block":
        second = [zeros((blocks,), torch.float32)]
    elif signature.kind == "momentum":
        second = [zeros((blocks, period), torch.float32)]  # the m̂ output
    else:
        second = [zeros((shape[0],), torch.float32), zeros((shape[1],), torch.float32)]
    return head + moment + second + list(tables) + [scalars]
