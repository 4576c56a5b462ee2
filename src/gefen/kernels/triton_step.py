"""The Triton backend: Gefen's step on CUDA by hand-written multi-tensor Triton kernels.

One plan per set of parameters (:mod:`gefen.kernels.triton_plan`): the device tables of every tensor's address, the
per-job metadata and the work items are built once and reused while the same tensors step, so a steady step's host
work is a few launches, whatever the number of parameters. Statistics, the ``nonfinite`` decision (``check="device"``:
no host read), the per-step constants (from a (G, 5) float64 group table and device step counters) and the update
all run on the device. Numerics: those of the eager reference (:mod:`gefen.kernels.eager`), codes and magnitudes
bit-identical; see :mod:`gefen.kernels.triton_plan` for the rest.

Step counters: the optimizer's counters stay where its state keeps them (the CPU unless ``capturable``); the plan
holds a device copy of them, built with the plan, that its kernels advance iff a step is applied. The optimizer's
counters advance on the host at the same time (``check=""``) or when the device decision is settled
(``check="device"``, :class:`gefen.nonfinite.PendingCheck`), so both always agree once settled.

Triton ships with torch's CUDA wheels (no compiler, no compile step for users beyond Triton's own JIT cache). On the
CPU the backend runs only under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).
"""

from __future__ import annotations

import os

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


class TritonBackend:
    """The Triton backend (see the module docstring): plain (unsharded) fp32/bf16/fp16 parameters on CUDA."""

    name = "triton"
    checks = "device"

    def __init__(self) -> None:
        self._plan = None
        self._mirror: Tensor | None = None  # the plan's device copy of the step counters
        self._outs: list[Tensor | None] = []  # the plan's m̂ buffers (GefenMuon), one per job
        self._groups: Tensor | None = None  # this step's (G, 5) group table on the device
        self._copies: list[tuple[Tensor, Tensor]] = []  # (parameter, contiguous work copy) of this step
        self._warned = False

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
        return dtype_reason(param, grad_dtype, _DTYPES, self.name)

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        """Build (or reuse) the plan of ``jobs`` and this step's group table; no write to any state.

        Raises:
            StepError: the plan cannot be built (``backend="triton"`` asked for); otherwise the jobs are left to
                the eager backend with one warning.
        """
        from gefen.errors import StepError
        from gefen.kernels import triton_plan

        self._copies = []
        if not jobs:
            return []
        device = jobs[0].target.device
        groups: dict[int, int] = {}
        rows: list[list[float]] = []
        triton_jobs = []
        for i, job in enumerate(jobs):
            row = groups.get(id(job.scalars))
            if row is None:
                row = groups[id(job.scalars)] = len(rows)
                s = job.scalars
                rows.append([s.beta1, s.beta2, s.eps, s.lr, s.weight_decay])
            triton_jobs.append(self._triton_job(job, row, i))
        table = context.table(device)
        try:
            if self._plan is None or not self._plan.matches(triton_jobs):
                self._plan, triton_jobs = self._build(jobs, triton_jobs, table, triton_plan)
        except ValueError as exc:
            self._plan = None
            if any(context.strict(job, self.name) for job in jobs):
                raise StepError(
                    f"{context.kind}(backend='triton'): the step's plan could not be built: {exc}. Nothing was "
                    "changed; pass backend='auto' or backend='eager'."
                ) from exc
            if not self._warned:
                self._warned = True
                from gefen._warnings import warn_user

                warn_user(f"{context.kind}: the Triton step could not be planned ({exc}); using the eager step.")
            return list(jobs)
        host = torch.tensor(rows, dtype=torch.float64)
        self._groups = host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
        return []

    def _triton_job(self, job: StepJob, group: int, index: int) -> object:
        """The plan's record of one job (the counter and ``out`` the plan's own, when it has them)."""
        from gefen.kernels.triton_plan import TritonJob

        state = job.state
        kind = job.kind
        param = job.target.detach()
        if kind != "momentum" and not param.is_contiguous():
            work = param.contiguous()
            self._copies.append((param, work))
            param = work
        grad = job.grad
        if grad.dtype == torch.float64 or not grad.is_contiguous():
            grad = kernel_grad(grad, tuple(job.target.shape))
        second: tuple[Tensor, ...] = ()
        if kind == "factored":
            second = (state[SECOND_MOMENT_ROW], state[SECOND_MOMENT_COL])
        elif kind == "block":
            second = (state[SECOND_MOMENT],)
        mirror = self._mirror
        own = self._plan is not None and mirror is not None and index < mirror.numel()
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
            self._outs[index] if own and index < len(self._outs) else None,
            mirror[index : index + 1] if own and mirror is not None else None,
        )

    def _build(self, jobs: list[StepJob], triton_jobs: list, table: object, triton_plan: object) -> tuple:
        """A new plan: device counters copied from the optimizer's, fresh ``out`` buffers for momentum jobs."""
        device = jobs[0].target.device
        counts = [int(job.state[STEP]) for job in jobs]  # host counters: no device read
        self._mirror = torch.tensor(counts, dtype=torch.int64).to(device)
        self._outs = [
            torch.empty(job.target.numel(), dtype=torch.float32, device=device) if job.kind == "momentum" else None
            for job in jobs
        ]
        for i, tj in enumerate(triton_jobs):
            tj.counter = self._mirror[i : i + 1]
            tj.out = self._outs[i]
        codebook, lut, thresholds = table.codebook, table.lut, table.thresholds  # type: ignore[attr-defined]
        plan = triton_plan.build_plan(triton_jobs, codebook, lut, thresholds, table.steps)  # type: ignore[attr-defined]
        return plan, triton_jobs

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        """One launch sequence for every job; with ``check="device"`` the step is decided on the device and the
        optimizer's counters move when the returned pending check is settled."""
        from gefen.nonfinite import PendingCheck

        assert self._plan is not None and self._groups is not None, "prepare() comes first"
        flags = self._plan.run(self._groups, check=check == "device")
        for param, work in self._copies:
            param.copy_(work)  # the work copy is unchanged when the device skipped the step
        self._copies = []
        for job, out in zip(jobs, self._outs):
            if out is not None:
                job.out = out.view(job.state[FIRST_MOMENT_CODES].shape)
        counters = [job.state[STEP] for job in jobs]
        outcome = StepOutcome()
        if check == "device":
            outcome.pending = PendingCheck.of(flags != 0, [job.name for job in jobs], counters)
        else:
            torch._foreach_add_(counters, 1)
        return outcome
