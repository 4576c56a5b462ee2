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
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gefen.kernels.backends import FUSED_ENV, fused_by_default
from gefen.kernels.fused import (
    factored_roots_,
    fused_block_step_,
    fused_factored_update_,
    fused_momentum_,
    kernel_grad,
    register_fma,
)
from gefen.kernels.scalars import APPLY, COMPILED_LAYOUT, as_float32, lerp_high

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


def _disable_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=_HOST_STEP_REASON)
    return torch.compiler.disable(fn)


def host_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a ``capturable=False`` step as never traced by ``torch.compile`` (``torch.compiler.disable``, with
    the reason shown in dynamo's message where this torch supports one): under ``torch.compile(opt.step)`` it
    runs as is, its own compiled kernels included; under ``fullgraph=True`` dynamo refuses it before it runs.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (~1.5 s), so it is applied on the first call made once
    dynamo is loaded, not at ``import gefen``: before that nothing can trace the step and ``fn`` runs as is. A
    first call that dynamo traces (the step compiled before it ever ran) breaks the graph with the same reason.
    """
    disabled: list[Callable[..., Any]] = []  # the torch.compiler.disable'd fn, once made

    @functools.wraps(fn)
    def host_step(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if torch.compiler.is_compiling():
                # where graph_break takes no msg (older torch), dynamo refuses the call with its own message
                torch._dynamo.graph_break(msg=_HOST_STEP_REASON)
            elif "torch._dynamo" not in sys.modules:  # no eval-frame hook can be set: nothing to disable
                return fn(*args, **kwargs)
            disabled.append(_disable_dynamo(fn))
        return disabled[0](*args, **kwargs)

    return host_step


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
            if torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT:  # the caller patched it for all its calls
                self._kernels[signature](*args)
            else:
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
            register_fma()  # before tracing, so that no graph traces the import
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


class CompiledBackend:
    """The compiled backend: one ``torch.compile``\\ d kernel per :class:`KernelSignature` (inductor C++ on CPU,
    Triton on CUDA), compiled in :meth:`prepare` on scratch tensors before any state changes; per-step constants of
    every parameter go to each device in one copy. It can decide ``nonfinite="skip"`` on the device
    (``check="device"``): the apply entry of the constants masks every write, no host read."""

    name = "compiled"
    checks = "device"

    def __init__(self) -> None:
        self.kernels = StepKernels()
        self._tables: dict[torch.device, tuple[Any, tuple[Tensor, Tensor, Tensor]]] = {}
        self._warned = False

    def available(self) -> str:
        return "" if compile_supported() else "torch.compile is unavailable or disabled here"

    def supports(self, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> str:
        if not compile_supported():
            return self.available()
        if sharded:
            return "the parameter is sharded (the compiled step runs on plain tensors)"
        if param.dtype not in COMPILED_DTYPES or param.device.type not in ("cpu", "cuda"):
            return f"the parameter is {param.dtype} on {param.device.type}"
        return ""

    def tables(self, context: Any, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(codebook, lut as fp32, thresholds)`` of the step's codebook on ``device`` (built once per table)."""
        from gefen.kernels.fused import lookup_table_as_float

        table = context.table(device)
        entry = self._tables.get(device)
        if entry is None or entry[0] is not table:
            entry = (table, (table.codebook, lookup_table_as_float(table.lut), table.thresholds))
            self._tables[device] = entry
        return entry[1]

    def signature(self, job: Any, context: Any) -> KernelSignature:
        """The kernel signature of a job (its kind, block view, dtypes, device, table and lerp branch)."""
        kind = job.kind
        numel, period = job.param.numel(), job.period
        shape = tuple(job.param.shape) if kind == "factored" else (numel // period, period)
        grad_dtype = torch.float32 if job.grad.dtype == torch.float64 else job.grad.dtype  # cast in run()
        return KernelSignature(
            kind,
            shape,
            period,
            job.param.dtype,
            grad_dtype,
            job.param.device.type,
            context.table(job.param.device).steps,
            lerp_high(1.0 - job.scalars.beta1),
            context.deterministic,
        )

    def prepare(self, jobs: list[Any], context: Any) -> list[Any]:
        """Compile every new signature; refuse (``StepError``, nothing changed) or leave to the eager backend (one
        warning) a job whose kernel cannot be built, as the user asked (strict: ``backend="compiled"``/``fused=True``).
        """
        from gefen.errors import StepError

        if any(context.strict(job, self.name) for job in jobs) and not compile_supported():
            raise StepError(
                f"{context.kind}(fused=True): torch.compile is unavailable or disabled here (TORCH_COMPILE_DISABLE "
                "or torch._dynamo.config.disable). Nothing was changed; pass fused=None or fused=False."
            )
        left = []
        for job in jobs:
            strict = context.strict(job, self.name)
            signature = self.signature(job, context)
            if not signature.eligible() or not compile_supported():
                if strict:
                    raise StepError(
                        f"{context.kind}(fused=True): {job.name} is {job.param.dtype} on {job.param.device.type}, "
                        "which the compiled step does not support (float32/bfloat16/float16 on CPU or CUDA). "
                        "Nothing was changed; put it in a param group with fused=None or fused=False."
                    )
                left.append(job)
                continue
            try:
                self.kernels.prepare(signature, job.param.device, self.tables(context, job.param.device))
            except Exception as exc:
                if strict:
                    raise StepError(
                        f"{context.kind}(fused=True): compiling the step of {job.name} {signature} failed: "
                        f"{type(exc).__name__}: {exc}. Nothing was changed; pass fused=None to fall back "
                        "to the eager path, or fix the torch.compile toolchain (a C++ compiler on CPU)."
                    ) from exc
                if not self._warned:
                    self._warned = True
                    from gefen._warnings import warn_user

                    warn_user(
                        f"{context.kind}: torch.compile could not build the fused step ({type(exc).__name__}: "
                        f"{exc}); using the eager step for the affected parameters (same results, slower)."
                    )
                left.append(job)
                continue
            job.prepared = signature  # for run()
        return left

    def run(self, jobs: list[Any], context: Any, check: str = "") -> Any:
        """Run the prepared kernels. ``check="device"`` (one device): the apply entry of every constants row is
        ``all(usable(grad))``, computed on the device; the counters move when the returned
        :class:`gefen.nonfinite.PendingCheck` is settled.

        A kernel that fails here (dynamo recompiles when a guard on global state fails, and that can fail) marks
        its signature failed, warns once, and returns that job and every later one as ``left`` for the eager
        backend, so the step is still applied whole; a strict group then refuses the next step before any change.
        """
        from gefen.amp import usable_flags
        from gefen.kernels.backends import StepOutcome
        from gefen.nonfinite import PendingCheck
        from gefen.state import STEP

        signatures = [job.prepared for job in jobs]
        rows: dict[torch.device, list[list[float]]] = {}
        for job, signature in zip(jobs, signatures):
            step = int(job.state[STEP]) + 1
            rows.setdefault(job.param.device, []).append(job.scalars.compiled_row(step, signature.kind == "factored"))
        constants = {device: constants_on(device, r) for device, r in rows.items()}
        outcome = StepOutcome()
        if check == "device":
            flags = usable_flags([job.grad for job in jobs])
            for table in constants.values():
                table[:, APPLY] = flags.all().to(table.dtype)  # on the device: no host read
            outcome.pending = PendingCheck.of(flags, [job.name for job in jobs], [job.state[STEP] for job in jobs])
        scalars = {device: iter(table) for device, table in constants.items()}
        with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            return self._run_kernels(jobs, signatures, scalars, context, outcome)

    def _run_kernels(self, jobs: list[Any], signatures: list[KernelSignature], scalars: dict, context: Any,
                     outcome: Any) -> Any:  # fmt: skip
        """The kernel calls of :meth:`run` (under one ``recompile_limit`` patch for all of them, not one per call)."""
        from gefen._warnings import warn_user
        from gefen.state import STEP

        for position, (job, signature) in enumerate(zip(jobs, signatures)):
            device = job.param.device
            param = job.param.detach()  # plain contiguous tensors: the graphs were compiled for them
            work = param if param.is_contiguous() else param.contiguous()
            grad = kernel_grad(job.grad, signature.shape)
            state = job.state
            if signature.kind == "momentum":
                job.out = torch.empty(signature.shape, dtype=torch.float32, device=device)
                second: tuple[Tensor, ...] = (job.out,)
            elif signature.kind == "factored":
                second = (state["second_moment_row"], state["second_moment_col"])
            else:
                second = (state["second_moment"],)
            row = next(scalars[device])
            try:
                self.kernels.run(
                    signature,
                    work.view(signature.shape),
                    grad,
                    state["first_moment_codes"],
                    state["first_moment_scale"],
                    *second,
                    *self.tables(context, device),
                    row,
                )
            except Exception as exc:  # recorded in self.kernels.failures by run()
                warn_user(
                    f"{context.kind}: the compiled step of {job.name} failed inside step() ({type(exc).__name__}: "
                    f"{exc}); this step was completed on the eager path for it and the parameters after it (same "
                    "math). fused=None keeps using the eager path for this signature; fused=True refuses the next "
                    "step."
                )
                if outcome.pending is not None:  # the eager backend advances the counters of the rest itself
                    del outcome.pending.counters[position:]
                job.out = None
                outcome.left = jobs[position:]
                return outcome
            if work is not param:
                param.copy_(work)
            if outcome.pending is None:
                state[STEP].add_(1)
        return outcome
