"""The native backend: the step of many parameters at once on the C library, one record per parameter, one call.

See :mod:`gefen.kernels.native` for the library (SIMD with run-time dispatch, torch's OpenMP threads, no compile
time) and :mod:`gefen.kernels.backends` for the interface this implements.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from gefen.amp import usable_bound
from gefen.kernels.backends import StepContext, StepJob, StepOutcome, dtype_reason
from gefen.kernels.fused import kernel_grad
from gefen.kernels.native import NATIVE_DTYPES, as_float32, native_status, run_records
from gefen.kernels.native import check_arguments as check_native_arguments
from gefen.kernels.native import record as native_record
from gefen.math.lookup import NearestCodeTable
from gefen.sharding import all_reduce_, collective_device
from gefen.state import (
    FIRST_MOMENT_CODES,
    FIRST_MOMENT_SCALE,
    SECOND_MOMENT,
    SECOND_MOMENT_COL,
    SECOND_MOMENT_ROW,
    STEP,
)

__all__ = ["NativeBackend", "run_native_jobs"]


class NativeBackend:
    """The native C backend: CPU parameters and gradients of fp32/bf16/fp16 (float64 gradients cast to fp32), plain
    or row-sharded; it can fold the ``nonfinite`` check into its own statistics pass (``check="host"``)."""

    name = "native"
    checks = "host"

    def available(self) -> str:
        return native_status().reason

    def supports(self, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> str:
        reason = native_status().reason
        if reason:
            return reason
        if param.device.type != "cpu":
            return f"the parameter is on {param.device.type} (the native backend is CPU-only)"
        return dtype_reason(param, grad_dtype, tuple(NATIVE_DTYPES), self.name)

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        return []

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        unusable = run_native_jobs(jobs, context.table(torch.device("cpu")), check == "host")
        return StepOutcome(unusable=unusable)


def run_native_jobs(jobs: list[StepJob], table: NearestCodeTable, check: bool = False) -> list[str]:
    """Apply the native CPU backend (:mod:`gefen.kernels.native`) to ``jobs`` in one library call.

    ``check=True`` folds the ``nonfinite`` check into the call: the library checks every gradient against
    :func:`gefen.amp.usable_bound` (NaN, Inf, or a value whose square sums would overflow float32) between its
    statistics pass and its first write (for factored moments from the row sums it computes anyway), and refuses the
    whole call when one fails. The caller then applies its policy; nothing has been changed.

    Returns:
        Names (``StepJob.name``, in ``jobs`` order) of the parameters whose gradient failed the check; empty when
        the step was applied (always, with ``check=False``).

    This rank's rows of row-sharded (FSDP2) factored parameters take their column statistics and the mean of the
    row moments over all ranks: one float64 all-reduce of ``C + 1`` values per such matrix, all in one collective,
    inside the call (between the statistics and the first write), so the factored moment is the one of the full
    matrix, as in one process.

    The backend was chosen for CPU tensors of supported dtypes; the state tensors are the optimizer's own
    (created or validated by it), so only their layout is checked here, with the full argument check of
    :func:`gefen.kernels.native.native_step` for any that is not contiguous. The library checks every record
    before it writes anything. This runs once per step for every parameter, so it reads each group's
    hyperparameters once and keeps the per-parameter work to the record itself.
    """
    tables = (table.codebook, table.lut, table.thresholds)
    records, keep, copies, names, empty_steps = [], [], [], [], []
    threads = torch.get_num_threads()
    reduce_length, reduce_shard = 0, None  # row-sharded factored parameters: one all-reduce for all of them
    for item in jobs:
        state = item.state
        codes, scale, step = state[FIRST_MOMENT_CODES], state[FIRST_MOMENT_SCALE], state[STEP]
        param = item.target  # this rank's rows of a sharded parameter
        momentum = SECOND_MOMENT_ROW not in state and SECOND_MOMENT not in state  # GefenMuon's: m̂ into item.out
        if momentum:
            item.out = torch.empty(codes.shape, dtype=torch.float32)
        numel = param.numel()
        sharded_factored = item.shard is not None and state.get(SECOND_MOMENT_ROW) is not None
        offset = reduce_length
        if sharded_factored:  # its piece of the buffer, also on a rank that holds none of its rows
            assert item.shard is not None
            reduce_length += item.shard.row_length + 1
            reduce_shard = item.shard
        if numel == 0:  # a rank without rows of a sharded parameter: only its counter moves
            empty_steps.append(step)
            continue
        grad = item.grad
        if grad.dtype == torch.float64 or not grad.is_contiguous():
            grad = kernel_grad(grad, (numel,))
        if momentum:
            kind, second, work = "momentum", (), None
        else:
            work = param
            if not param.is_contiguous():  # stepped in a contiguous copy, written back after the call
                param = param.detach()
                work = param.contiguous()
                copies.append((param, work))
            row = state.get(SECOND_MOMENT_ROW)
            kind = "factored" if row is not None else "block"
            second = (row, state[SECOND_MOMENT_COL]) if row is not None else (state[SECOND_MOMENT],)
        factored = kind == "factored"
        call = {
            "grad": grad,
            "codes": codes,
            "scale": scale,
            "tables": tables,
            "steps": table.steps,
            "period": codes.shape[1],
            "param": work,
            "second": second,
            "out": item.out.view(-1) if momentum and item.out is not None else None,
            "shape": tuple(param.shape) if factored else (0, 0),
        }
        if not (codes.is_contiguous() and scale.is_contiguous() and all(t.is_contiguous() for t in second)):
            check_native_arguments(kind, **call)
        keep.append(call)
        records.append(
            native_record(
                kind,
                **call,
                scalars=item.scalars,
                step=int(step) + 1,
                threads=threads,
                global_rows=item.shard.rows if sharded_factored and item.shard is not None else 0,
                reduce_offset=offset if sharded_factored else 0,
                grad_bound=_grad_bound(numel) if check else 0.0,
                counter=step,  # the library advances it once the whole step is applied
            )
        )
        names.append(item.name)
    if reduce_length:
        buffer = torch.zeros(reduce_length + 1, dtype=torch.float64)  # + the status slot
        assert reduce_shard is not None
        device = collective_device(reduce_shard)  # a CUDA mesh's (CPU-offloaded shards): its pieces go there and back
        unusable = run_records(records, buffer, lambda b: b.copy_(all_reduce_(b.to(device), reduce_shard.group, "sum")))
    else:
        unusable = run_records(records)
    if unusable:  # nothing was changed
        return [names[i] for i in unusable]
    for param, work in copies:
        param.copy_(work)
    if empty_steps:
        torch._foreach_add_(empty_steps, 1)
    return []


@functools.lru_cache(maxsize=1024)
def _grad_bound(numel: int) -> float:
    """:func:`gefen.amp.usable_bound` of ``numel`` elements rounded to fp32 (the library compares in fp32)."""
    return as_float32(usable_bound(numel))
