"""The Triton backend: Gefen's step on CUDA by hand-written multi-tensor Triton kernels.

One plan per set of parameters (:mod:`gefen.kernels.triton_plan`): the device tables of every tensor's address, the
per-job metadata and the work items are built once and reused while the same tensors step, so a steady step's host
work is a few launches, whatever the number of parameters. Statistics, the ``nonfinite`` decision (``check="device"``:
no host read), the per-step constants (from a (G, 5) float64 group table and device step counters) and the update
all run on the device. Numerics: those of the eager reference (:mod:`gefen.kernels.eager`), codes and magnitudes
bit-identical; see :mod:`gefen.kernels.triton_plan` for the rest.

Step counters: the optimizer's counters stay where its state keeps them (the CPU unless ``capturable``). Under
``capturable=True`` they are device tensors and the kernels advance them directly (iff the step is applied), so a steady
step reads nothing on the host and a CUDA graph can capture it. Otherwise the plan holds a device copy of them, built
with the plan, that its kernels advance iff a step is applied. The optimizer's counters advance on the host at the same
time (``check=""``) or when the device decision is settled (``check="device"``, :class:`gefen.nonfinite.PendingCheck`),
so both always agree once settled.

Plans are cached per batch (a batch is the list of parameters one ``run`` steps; GefenMuon runs its parameters in
parts, each a batch). GefenMuon's ``m̂`` buffers are views of one arena per device, as large as the largest batch's
momenta: the parts run one after another and each consumes its ``m̂`` before the next, so the arena is reused and
the persistent cost stays that of one part, not 4 bytes per parameter.

Triton ships with torch's CUDA wheels (no compiler, no compile step for users beyond Triton's own JIT cache). On the
CPU the backend runs only under Triton's interpreter (``TRITON_INTERPRET=1``: the tests). Before a device is trusted,
:mod:`gefen.kernels.triton_check` steps a fixed problem on it against the eager reference (once per device and
process); a device that fails it is not supported (``backend="auto"`` moves on to the next backend, an explicit
``backend="triton"`` refuses with the reason).
"""

from __future__ import annotations

import os
import time

import torch
from torch import Tensor

from gefen.kernels.backends import StepContext, StepJob, StepOutcome, dtype_reason
from gefen.kernels.fused import kernel_grad
from gefen.state import (
    FIRST_MOMENT_CODES,
    FIRST_MOMENT_SCALE,
    SECOND_MOMENT,
    SECOND_MOMENT_COL,
    SECOND_MOMENT_ROW,
    STEP,
)

__all__ = ["TritonBackend"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


class _Prepared:
    """One batch's plan, its device counters, this step's group table and work copies."""

    def __init__(self, plan: object, mirror: Tensor | None, outs: list[Tensor | None]) -> None:
        self.plan = plan
        self.mirror = mirror
        self.outs = outs
        self.groups: Tensor | None = None  # this step's table, set by prepare, consumed by run
        self.table: Tensor | None = None  # the device group table of ``rows``, kept while they do not change
        self.rows: list[list[float]] = []
        self.copies: list[tuple[Tensor, Tensor]] = []
        self.states: tuple[int, ...] = ()  # the jobs' state tensors (their codes' addresses) the mirror counts for


#: Plans kept per optimizer (least recently built dropped first).
_MAX_PLANS = 64


class TritonBackend:
    """The Triton backend (see the module docstring): plain (unsharded) fp32/bf16/fp16 parameters on CUDA."""

    name = "triton"
    checks = "device"
    device_counters = True  # a plan's mirror advances on the device; the host's counters follow when settled
    captures = True  # capturable=True: the kernels advance the state's device counters, nothing is read on the host

    def __init__(self) -> None:
        self._prepared: dict[tuple[int, ...], _Prepared] = {}
        self._arena: dict[torch.device, Tensor] = {}  # GefenMuon's m-hat buffers, shared by its parts
        self._failed: set[tuple[int, ...]] = set()  # batches whose plan could not be built or compiled
        self._warned = False
        self.jit_time_s = 0.0  # seconds in Triton's compiler (plan.compile), none with warm caches

    def forget_state(self) -> None:
        """Drop every plan: they hold the old state's addresses and device step counters (a load replaced them)."""
        self._prepared.clear()

    def available(self) -> str:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (it ships with torch's CUDA wheels: pip install triton)"
        return ""

    def supports(self, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> str:
        reason = self.available()
        if reason:
            return reason
        if sharded:
            return "the parameter is sharded (the Triton step runs on plain tensors)"
        if param.device.type != "cuda" and not (param.device.type == "cpu" and _interpreted()):
            return f"the parameter is on {param.device.type} (the Triton backend runs on CUDA)"
        reason = dtype_reason(param, grad_dtype, _DTYPES, self.name)
        if reason:
            return reason
        from gefen.kernels.triton_check import device_verdict

        verdict = device_verdict(param.device)  # once per device and process (gefen.kernels.triton_check)
        return f"its self-check on this device failed: {verdict}" if verdict else ""

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        """Build (or reuse) the plan of ``jobs`` and this step's group table; no write to any state.

        Raises:
            StepError: the plan cannot be built (``backend="triton"`` asked for); otherwise the jobs are left to
                the eager backend with one warning.
        """
        from gefen.errors import StepError

        if not jobs:
            return []
        device = jobs[0].target.device
        key = tuple(id(job.param) for job in jobs)
        if key in self._failed and not any(context.strict(job, self.name) for job in jobs):
            return list(jobs)  # its plan failed before (warned then): not rebuilt every step
        outs = self._momentum_buffers(jobs, device)
        groups: dict[int, int] = {}
        rows: list[list[float]] = []
        copies: list[tuple[Tensor, Tensor]] = []
        prepared = self._prepared.get(key)
        triton_jobs = []
        for i, job in enumerate(jobs):
            row = groups.get(id(job.scalars))
            if row is None:
                row = groups[id(job.scalars)] = len(rows)
                s = job.scalars
                rows.append([s.beta1, s.beta2, s.eps, s.lr, s.weight_decay])
            if context.capturable:  # the state's own device counter, advanced by the kernels
                counter: Tensor | None = job.state[STEP].view(1)
            elif prepared is not None and prepared.mirror is not None and i < prepared.mirror.numel():
                counter = prepared.mirror[i : i + 1]
            else:
                counter = None
            triton_jobs.append(_triton_job(job, row, outs[i], counter, copies))
        try:
            if prepared is None or not prepared.plan.matches(triton_jobs):  # type: ignore[attr-defined]
                same_state = prepared is not None and prepared.states == _state_ptrs(jobs)
                old = prepared.mirror if same_state else None  # type: ignore[union-attr]
                prepared = self._build(jobs, triton_jobs, outs, context, old)
                self._prepared.pop(key, None)
                while len(self._prepared) >= _MAX_PLANS:
                    self._prepared.pop(next(iter(self._prepared)))
                self._prepared[key] = prepared
        except Exception as exc:  # a plan's check (ValueError) or Triton's compiler: nothing was written yet
            self._prepared.pop(key, None)
            self._failed.add(key)
            if any(context.strict(job, self.name) for job in jobs):
                raise StepError(
                    f"{context.kind}(backend='triton'): the step's plan could not be built or compiled: "
                    f"{type(exc).__name__}: {exc}. Nothing was changed; pass backend='auto' or backend='eager'."
                ) from exc
            if not self._warned:
                self._warned = True
                from gefen._warnings import warn_user

                warn_user(
                    f"{context.kind}: the Triton step could not be planned or compiled ({type(exc).__name__}: {exc}); "
                    "using the eager step for these parameters (same results, slower)."
                )
            return list(jobs)
        if prepared.rows != rows or prepared.table is None:  # a new plan, or a hyperparameter changed
            host = torch.tensor(rows, dtype=torch.float64)
            prepared.table = host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
            prepared.rows = rows
        prepared.groups = prepared.table  # unchanged hyperparameters: no copy to the device (capturable)
        prepared.copies = copies
        return []

    def _momentum_buffers(self, jobs: list[StepJob], device: torch.device) -> list[Tensor | None]:
        """Views of the device's arena for the momentum jobs (``None`` for the others). A larger batch than the
        arena holds replaces it by a larger one; a plan built on the old one keeps it alive (its ``outs``) until it no
        longer matches, at its batch's next step, and is rebuilt on the new one."""
        sizes = [job.target.numel() if job.kind == "momentum" else 0 for job in jobs]
        total = sum(sizes)
        if not total:
            return [None] * len(jobs)
        arena = self._arena.get(device)
        if arena is None or arena.numel() < total:
            arena = self._arena[device] = torch.empty(total, dtype=torch.float32, device=device)
        views: list[Tensor | None] = []
        offset = 0
        for size in sizes:
            views.append(arena[offset : offset + size] if size else None)
            offset += size
        return views

    def _build(
        self,
        jobs: list[StepJob],
        triton_jobs: list,
        outs: list[Tensor | None],
        context: StepContext,
        mirror: Tensor | None,
    ) -> _Prepared:
        """A new plan. Its device counters: ``mirror``, those of the batch's previous plan (the same parameters and
        states in the same order, current on the device whatever is still unsettled), else copied from the
        optimizer's host counters once every pending step is settled (no device read when none is)."""
        from gefen.kernels import triton_plan

        device = jobs[0].target.device
        table = context.table(device)
        if context.capturable:  # the jobs carry the state's device counters
            mirror = None
        elif mirror is None or mirror.numel() != len(jobs):
            context.settle()
            mirror = torch.tensor([int(job.state[STEP]) for job in jobs], dtype=torch.int64).to(device)
        if mirror is not None:
            for i, tj in enumerate(triton_jobs):
                tj.counter = mirror[i : i + 1]
        codebook, lut, thresholds = table.codebook, table.lut, table.thresholds  # type: ignore[attr-defined]
        plan = triton_plan.build_plan(triton_jobs, codebook, lut, thresholds, table.steps)  # type: ignore[attr-defined]
        start = time.perf_counter()
        plan.compile()  # Triton's JIT now, not at the first launch half-way through the step
        self.jit_time_s += time.perf_counter() - start
        prepared = _Prepared(plan, mirror, outs)
        prepared.states = _state_ptrs(jobs)
        return prepared

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        """One launch sequence for every job of the batch; with ``check="device"`` the step is decided on the device
        and the optimizer's counters move when the returned pending check is settled."""
        from gefen.nonfinite import PendingCheck

        prepared = self._prepared[tuple(id(job.param) for job in jobs)]
        assert prepared.groups is not None, "prepare() comes first"
        flags = prepared.plan.run(prepared.groups, check=check == "device")  # type: ignore[attr-defined]
        for param, work in prepared.copies:
            param.copy_(work)  # the work copy is unchanged when the device skipped the step
        prepared.copies, prepared.groups = [], None
        for job, out in zip(jobs, prepared.outs):
            if out is not None:
                job.out = out.view(job.state[FIRST_MOMENT_CODES].shape)
        counters = [job.state[STEP] for job in jobs]
        outcome = StepOutcome()
        if context.capturable:  # the kernels advanced the state's counters; the caller counts the decision
            outcome.applied = prepared.plan.applied if check == "device" else None  # type: ignore[attr-defined]
        elif check == "device":
            outcome.pending = PendingCheck.of(flags != 0, [job.name for job in jobs], counters)
        else:
            torch._foreach_add_(counters, 1)
        return outcome


def _state_ptrs(jobs: list[StepJob]) -> tuple[int, ...]:
    """The addresses of the jobs' codes: a plan rebuilt for new gradients or parameters keeps its device counters
    only while every job still has the same state (a new state, e.g. reset by hand, starts from its own counter)."""
    return tuple(job.state[FIRST_MOMENT_CODES].data_ptr() for job in jobs)


def _triton_job(
    job: StepJob, group: int, out: Tensor | None, counter: Tensor | None, copies: list[tuple[Tensor, Tensor]]
) -> object:
    """The plan's record of one job; a non-contiguous parameter steps in a contiguous copy (added to ``copies``)."""
    from gefen.kernels.triton_plan import TritonJob

    state = job.state
    kind = job.kind
    param = job.target.detach()
    if kind != "momentum" and not param.is_contiguous():
        work = param.contiguous()
        copies.append((param, work))
        param = work
    grad = job.grad
    if grad.dtype == torch.float64 or not grad.is_contiguous():
        grad = kernel_grad(grad, tuple(job.target.shape))
    second: tuple[Tensor, ...] = ()
    if kind == "factored":
        second = (state[SECOND_MOMENT_ROW], state[SECOND_MOMENT_COL])
    elif kind == "block":
        second = (state[SECOND_MOMENT],)
    return TritonJob(
        kind,
        grad.reshape(-1),
        state[FIRST_MOMENT_CODES],
        state[FIRST_MOMENT_SCALE],
        job.period,
        group,
        None if kind == "momentum" else param.reshape(-1),
        second,
        tuple(job.target.shape) if kind == "factored" else (0, 0),
        out,
        counter,
    )
