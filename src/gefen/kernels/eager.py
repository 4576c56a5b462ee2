"""The eager backend: torch operations, the reference every other backend follows.

:func:`eager_step_` applies one parameter's step with the pure functions of :mod:`gefen.math.moments`, in chunks of
whole blocks (and whole rows when factored) so that its transient memory stays a few bytes per element of one chunk;
per-block reductions never straddle a chunk, so the result does not depend on the chunk size. Its rounding rules
are the contract of the other backends:

* every intermediate is fp32; gradients of any dtype are up-cast exactly; the codebook is fp32;
* first moment (algorithm.md §6.2 step 5): ``m_old = c[idx]·a`` (one fp32 product); the EMA is torch's lerp with
  weight ``w = 1 − β1`` rounded to fp32: ``fma(w, g − m_old, m_old)`` for ``w < 0.5``, else
  ``fma(w − 1, g − m_old, g)``; ``a = max|m|`` (NaN propagates); ``u = m / a`` is a true (correctly rounded)
  division, ``u = m`` for a block whose ``a`` is not positive; the code is the exact nearest-code rule of §4.8
  (:mod:`gefen.math.lookup`); ``m̂ = c[idx]·a``;
* block second moment (§6.2): ``v = fma(mean(g²), 1 − β2, v·β2)``; ``s = (1/bc1) · 1/(sqrt(v)·(1/sqrt(bc2)) + ε)``,
  where ``1/sqrt(bc2)`` is the fp32 reciprocal of the fp32-rounded ``sqrt(bc2)`` (torch divides by a Python scalar
  that way) and ``1/bc1`` is rounded from float64;
* factored second moment (§6.4): row/column means of the fp32 squares, the same EMA; roots
  ``row = sqrt(v_row / (max(mean(v_row), tiny)·bc2))``, ``col = sqrt(v_col)``; ``d = m̂ / (row·col + ε)``;
* parameter (§6.2 step 6, §13.5): ``p = fma(d, −η·k, p·(1 − ηλ))`` in fp32 (fp64 for fp64 parameters), rounded once
  to the parameter's dtype, to nearest even; ``k = 1`` (block) or ``1/bc1`` (factored).

The sums (block mean square, row/column means, the mean of ``v_row``) are the only operations whose order a backend
chooses: a backend may differ from this reference there by a few ulps of the second moment, and through it of the
parameter; codes and magnitudes never differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gefen.kernels.backends import StepContext, StepJob, StepOutcome
from gefen.kernels.scalars import StepScalars
from gefen.math.lookup import NearestCodeTable
from gefen.math.moments import (
    apply_update_,
    bias_correction,
    block_second_moment_,
    block_step_size,
    factored_denominator,
    factored_root_parts,
    factored_second_moment_,
    sharded_factored_second_moment_,
    update_quantized_moment,
)
from gefen.state import FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE, SECOND_MOMENT, SECOND_MOMENT_COL, SECOND_MOMENT_ROW

__all__ = ["EagerBackend", "eager_step_", "reference_step"]

#: Elements per chunk on the CPU (rounded to whole blocks/rows): small enough for the cache.
CHUNK_ELEMENTS = 1 << 17
#: The same on accelerators, where each pass is a kernel launch: large enough to keep launches few.
CHUNK_ELEMENTS_ACCELERATOR = 1 << 22


@torch.no_grad()
def eager_step_(
    kind: str,
    *,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    table: NearestCodeTable,
    scalars: StepScalars,
    step: int = 1,
    param: Tensor | None = None,
    second: tuple[Tensor, ...] = (),
    out: Tensor | None = None,
    column_reduce: Callable[[Tensor], Tensor] | None = None,
    rows_all: int = 0,
) -> None:
    """One step of one parameter (or GefenMuon's momentum) with torch operations, in place.

    Args:
        kind: ``"block"`` (§6.2), ``"factored"`` (§6.4) or ``"momentum"`` (§7.1 step 2).
        grad: the gradient, any floating dtype, ``param``'s shape ((R, C) when factored) or flat.
        codes: (B, P) uint8; scale: (B,) fp32 — the first moment, updated in place.
        table: the codebook's nearest-code table (:func:`gefen.math.lookup.build_nearest_table`).
        scalars: the group's per-step record (``beta1`` is GefenMuon's momentum for ``"momentum"``).
        step: the step counter after increment (``t >= 1``), for the bias corrections.
        param: the parameter (any contiguity; not for ``"momentum"``), updated in place.
        second: ``(v,)`` (B,) for block; ``(v_row (R,), v_col (C,))`` for factored; fp32, updated in place.
        out: (B, P) fp32 receiving ``m̂`` (``"momentum"``).
        column_reduce: factored, row-sharded: sums a float64 vector over the ranks (an all-reduce); with
            ``rows_all`` the parameter's rows on all ranks, so the factored moment is the full matrix's.

    Source: algorithm.md §6.2, §6.4, §7.1 step 2, §13.5–13.6.
    """
    period = codes.shape[1]
    flat = grad.reshape(-1)
    if kind == "momentum":
        assert out is not None
        moment = update_quantized_moment(codes, scale, flat.to(torch.float32).view(-1, period), table, scalars.beta1)
        codes.copy_(moment.codes)
        scale.copy_(moment.scale)
        out.copy_(moment.m_hat.view_as(out))
        return
    assert param is not None
    beta1, beta2 = scalars.beta1, scalars.beta2
    bc1, bc2 = bias_correction(beta1, step), bias_correction(beta2, step)
    numel = param.numel()
    if kind == "factored":
        rows, cols = param.shape if param.dim() == 2 else (second[0].numel(), second[1].numel())
        g2d = flat.to(torch.float32).view(rows, cols)
        mean = None
        if column_reduce is None:
            factored_second_moment_(second[0], second[1], g2d, beta2)
        else:  # this rank's rows: the column statistic and the row mean over all ranks (one all-reduce)
            mean = sharded_factored_second_moment_(second[0], second[1], g2d, beta2, rows_all, column_reduce)
        row_root, col_root = factored_root_parts(second[0], second[1], bc2, mean)
        unit = math.lcm(period, cols)
    else:
        unit = period
    size = CHUNK_ELEMENTS if param.device.type == "cpu" else CHUNK_ELEMENTS_ACCELERATOR
    chunk = max(unit, (size // unit) * unit)
    work = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        blocks = slice(start // period, stop // period)
        g_blocks = flat[start:stop].to(torch.float32).view(-1, period)
        moment = update_quantized_moment(codes[blocks], scale[blocks], g_blocks, table, beta1)
        if kind == "factored":
            denominator = factored_denominator(row_root[start // cols : stop // cols], col_root, scalars.eps)
            direction = moment.m_hat.view(-1).div_(denominator.view(-1))
            direction_scale = 1.0 / bc1
        else:
            v = block_second_moment_(second[0][blocks], g_blocks, beta2)
            direction = moment.m_hat.mul_(block_step_size(v, bc1, bc2, scalars.eps))
            direction_scale = 1.0
        codes[blocks] = moment.codes
        scale[blocks] = moment.scale
        apply_update_(work[start:stop], direction, scalars.lr, scalars.weight_decay, direction_scale)
    if work.data_ptr() != param.data_ptr():
        param.copy_(work.view_as(param))


def reference_step(
    kind: str,
    *,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    table: NearestCodeTable,
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
    """:func:`eager_step_` with the arguments of :func:`gefen.kernels.native.native_step` (flat tensors, the
    hyperparameters as floats, ``shape = (R, C)`` when factored): the reference the backends are tested against."""
    scalars = StepScalars(beta1, beta2, eps, lr, weight_decay)
    target = param.view(shape) if param is not None and kind == "factored" else param
    eager_step_(
        kind,
        grad=grad,
        codes=codes.view(-1, period),
        scale=scale,
        table=table,
        scalars=scalars,
        step=step,
        param=target,
        second=second,
        out=None if out is None else out.view(-1, period),
    )


class EagerBackend:
    """The eager backend (see the module docstring): every device and dtype, float64 included; sharded parameters
    too (their factored column statistics all-reduced over the ranks)."""

    name = "eager"
    checks = ""

    def available(self) -> str:
        return ""

    def supports(self, param: Tensor, grad_dtype: torch.dtype, sharded: bool) -> str:
        return ""

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        return []

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        """The step of each job in order; its counter moves first (the step count of its bias corrections)."""
        for job in jobs:
            run_eager(job, context.table(job.target.device))
        return StepOutcome()


def run_eager(job: StepJob, table: NearestCodeTable) -> None:
    """One job on the eager backend, its step counter advanced (see :func:`eager_step_`)."""
    from gefen.sharding import all_reduce_, collective_device  # sharding is optional machinery of this path

    state = job.state
    counter = state["step"]
    counter.add_(1)
    kind = job.kind
    second: tuple[Tensor, ...] = ()
    reduce, rows_all = None, 0
    if kind == "factored":
        second = (state[SECOND_MOMENT_ROW], state[SECOND_MOMENT_COL])
        if job.shard is not None:
            shard = job.shard
            rows_all = shard.rows

            def reduce(piece: Tensor) -> Tensor:
                return piece.copy_(all_reduce_(piece.to(collective_device(shard)), shard.group, "sum"))

    elif kind == "block":
        second = (state[SECOND_MOMENT],)
    if kind == "momentum" and job.out is None:
        job.out = torch.empty(state[FIRST_MOMENT_CODES].shape, dtype=torch.float32, device=job.target.device)
    eager_step_(
        kind,
        grad=job.grad,
        codes=state[FIRST_MOMENT_CODES],
        scale=state[FIRST_MOMENT_SCALE],
        table=table,
        scalars=job.scalars,
        step=int(counter),
        param=None if kind == "momentum" else job.target,
        second=second,
        out=job.out,
        column_reduce=reduce,
        rows_all=rows_all,
    )
