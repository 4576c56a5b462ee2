"""One-pass Gefen steps for ``torch.compile``: the whole §6.2 / §6.4 chain of one parameter as a single graph.

These are the compiled twins of the eager path (:mod:`gefen.math.moments` orchestrated by ``Gefen._update``):
the same equations, written so that inductor fuses them into one or two loops over memory (C++ on CPU, Triton
on CUDA) instead of a dozen full-size passes. They are pure functions of their inputs except for the explicit
in-place writes of the parameter and the state tensors at the end; every Python argument after ``*`` is static
(it selects the graph), every value that changes from step to step (lr, bias corrections, weight decay) arrives
in the fp32 ``scalars`` tensor, so a new lr or step never recompiles.

Agreement with the eager path (tested in ``tests/optim/test_gefen_fused.py``): the first-moment codes and magnitudes
are identical (same fp32 operations, same fused multiply-add in the EMA, the same exact nearest-code rule);
second moments differ only by the summation order of the block mean squares (a few ulps); parameters by the
rounding of ``sqrt`` and of those sums (a few ulps of the update).

Every value that changes from step to step arrives in one fp32 ``scalars`` row per parameter, the compiled
serialisation of the group's :class:`gefen.kernels.scalars.StepScalars` (layout: its ``COMPILED_LAYOUT``). Its
entry ``APPLY`` lets a step be decided on the device: ``nonfinite="skip"`` without a host read sets it to 0 when a
gradient is unusable, and every write of the kernels then keeps the old value (``torch.where``, so a NaN never
reaches the state).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gefen.kernels.scalars import APPLY
from gefen.math.lookup import LOOKUP_BUCKETS
from gefen.math.moments import FLOAT32_TINY
from gefen.state import ParamState

__all__ = [
    "register_fma",
    "write_param_",
    "lookup_table_as_float",
    "nearest_code_lut",
    "quantized_moment_",
    "fused_block_step_",
    "factored_roots_",
    "fused_factored_update_",
    "fused_momentum_",
    "fused_step_",
    "kernel_grad",
]

#: Whether ``torch.ops.prims.fma`` is registered (by ``torch._inductor.inductor_prims``, see :func:`_fma`).
_FMA_REGISTERED = False


def register_fma() -> None:
    """Register ``torch.ops.prims.fma`` (idempotent). Importing the inductor module that defines it pulls in all
    of ``torch._inductor`` and ``torch._dynamo`` (~1.5 s on CPU), so it happens before the first compilation or
    fused step, not at ``import gefen``."""
    global _FMA_REGISTERED
    import torch._inductor.inductor_prims  # noqa: F401  (registers torch.ops.prims.fma)

    _FMA_REGISTERED = True


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` as ``torch.ops.prims.fma``: one rounding where inductor compiles it (eager prims.fma rounds
    the product first). Registers the op on first use; under ``torch.compile`` dynamo traces that import once
    (a compiled kernel guards on the flag, so it never re-runs)."""
    if not _FMA_REGISTERED:
        register_fma()
    return torch.ops.prims.fma(a, b, c)


def kernel_grad(grad: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A gradient as the kernels take it: detached, contiguous, in ``shape``; float64 cast to float32 (the step
    computes in fp32 either way, algorithm.md §6.5). A copy only when one of those is needed."""
    grad = grad.detach()
    if grad.dtype == torch.float64:
        grad = grad.to(torch.float32)
    return grad.reshape(shape).contiguous()


def lookup_table_as_float(lut: Tensor) -> Tensor:
    """The int32 bucket table as fp32 (its values are counts ``<= 256``, exact in fp32).

    Compiled CPU kernels gather fp32 tables with one vector instruction where int32 tables take a scalar loop.

    Args:
        lut: (4097,) int32 from :func:`gefen.math.lookup.build_nearest_table`.

    Returns:
        (4097,) fp32 on the same device.
    """
    return lut.to(torch.float32)


def _gather(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a small 1-D table, as an embedding look-up (lowered without negative-index wrap)."""
    return torch.nn.functional.embedding(index, table.unsqueeze(1)).squeeze(-1)


def nearest_code_lut(u: Tensor, lut: Tensor, thresholds: Tensor, steps: int) -> Tensor:
    """Nearest codebook index of every element by bucket table + ``steps`` compares (algorithm.md §4.9).

    Identical to :func:`gefen.math.lookup.nearest_code_fast` (same fp32 bucket arithmetic, same thresholds).

    Args:
        u: fp32, any shape, values in ``[-1, 1]``.
        lut: (4097,) fp32 bucket table (:func:`lookup_table_as_float`).
        thresholds: (K - 1 + steps,) fp32 ascending thresholds padded with ``+inf``.
        steps: number of compares after the table look-up (static).

    Returns:
        int32 indices, the shape of ``u``.
    """
    bucket = ((u + 1.0) * (LOOKUP_BUCKETS / 2)).to(torch.int32).clamp(0, LOOKUP_BUCKETS - 1)
    index = _gather(lut, bucket).to(torch.int32)
    for _ in range(steps):
        index = index + (_gather(thresholds, index) < u).to(torch.int32)
    return index


def quantized_moment_(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    weight: Tensor,
    codebook: Tensor,
    lut: Tensor,
    thresholds: Tensor,
    *,
    steps: int,
    lerp_high: bool,
    apply: Tensor | None = None,
) -> Tensor:
    """Dequantize → EMA → requantize the first moment of whole blocks (algorithm.md §6.2 steps 5–6), in place.

    ``m = lerp(c[idx]·a, g, w)`` with torch's own vectorised fp32 lerp formula (``w < 0.5``:
    ``fma(w, g − m, m)``, else ``fma(w − 1, g − m, g)``), ``a = max_j |m_j|``, ``idx = nearest(c, m / a)``
    (``u = 0`` for a zero block), ``m̂ = c[idx]·a``. Every tensor stays in the (B, P) block view, so inductor
    computes the codes once for both the parameter write and the state write.

    Args:
        grad: (B, P) gradient, any floating dtype (computed in fp32).
        codes: (B, P) uint8, scale: (B,) fp32 — the state, updated in place.
        weight: 0-dim fp32 EMA weight ``w = 1 − β``.
        codebook: (256,) fp32.
        lut, thresholds, steps: the nearest-code table (:func:`nearest_code_lut`).
        lerp_high: ``w >= 0.5`` (selects torch's second lerp formula; static).
        apply: optional 0-dim bool; ``False`` keeps ``codes`` and ``scale`` as they were (see :data:`APPLY`).

    Returns:
        (B, P) fp32 ``m̂``.
    """
    g = grad.to(torch.float32)
    m_old = _gather(codebook, codes.to(torch.int32)) * scale.unsqueeze(1)
    if lerp_high:
        m = _fma(weight - 1.0, g - m_old, g)
    else:
        m = _fma(weight, g - m_old, m_old)
    new_scale = m.abs().amax(1, keepdim=True)
    u = m / torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))
    index = nearest_code_lut(u, lut, thresholds, steps)
    _write_(codes, index.to(torch.uint8), apply)
    _write_(scale, new_scale.squeeze(1), apply)
    return _gather(codebook, index) * new_scale


def _write_(target: Tensor, value: Tensor, apply: Tensor | None) -> None:
    """``target <- value`` in place, or (``apply`` a 0-dim bool tensor that is ``False``) ``target`` kept."""
    target.copy_(value if apply is None else torch.where(apply, value, target))


def write_param_(param: Tensor, direction: Tensor, decay: Tensor, step: Tensor, apply: Tensor | None = None) -> None:
    """``param <- fma(direction, step, param·decay)`` in fp32, rounded once to ``param``'s dtype, in place.

    Args:
        param: any shape, fp32/bf16/fp16.
        direction: fp32, ``param``'s shape.
        decay: 0-dim fp32 ``1 − η·λ``; step: 0-dim fp32 ``−η·k``.
        apply: optional 0-dim bool; ``False`` keeps ``param`` (see :data:`APPLY`).
    """
    work = param.to(torch.float32) * decay
    _write_(param, _fma(direction, step, work).to(param.dtype), apply)


def fused_block_step_(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    v: Tensor,
    codebook: Tensor,
    lut: Tensor,
    thresholds: Tensor,
    scalars: Tensor,
    *,
    steps: int,
    lerp_high: bool,
) -> None:
    """One Gefen step of a parameter with the block-shared second moment (algorithm.md §6.2), in place.

    Args:
        param: (B, P) view of the parameter (fp32, bf16 or fp16), updated in place.
        grad: (B, P) gradient, any floating dtype (computed in fp32).
        codes: (B, P) uint8, scale: (B,) fp32, v: (B,) fp32 — the state, updated in place.
        codebook, lut, thresholds, steps: codebook and nearest-code table.
        scalars: (8,) fp32, block layout of the module docstring.
        lerp_high: ``1 − β1 >= 0.5`` (static).

    Source: algorithm.md §6.2; Loshchilov & Hutter 2019 for the decoupled weight decay.
    """
    g = grad.to(torch.float32)
    apply = scalars[APPLY] != 0
    v_new = _fma(g.square().mean(-1), scalars[2], v * scalars[1])
    step_size = torch.reciprocal(torch.sqrt(v_new) / scalars[5] + scalars[3]) * scalars[6]
    m_hat = quantized_moment_(
        g, codes, scale, scalars[0], codebook, lut, thresholds, steps=steps, lerp_high=lerp_high, apply=apply
    )
    write_param_(param, m_hat * step_size.unsqueeze(-1), scalars[4], scalars[7], apply)
    _write_(v, v_new, apply)


def factored_roots_(grad: Tensor, v_row: Tensor, v_col: Tensor, scalars: Tensor, *, dense: bool) -> tuple[Tensor, ...]:
    """Factored second-moment EMAs (in place) and the bias-corrected root, as two factors or dense.

    ``v_row <- β2·v_row + (1 − β2)·mean_c g²``, ``v_col <- β2·v_col + (1 − β2)·mean_r g²``;
    ``row = sqrt(v_row / (max(mean(v_row), tiny)·bc2))``, ``col = sqrt(v_col)``, so that
    ``sqrt(V̂_rc / bc2) = row[r]·col[c]`` (as :func:`gefen.math.moments.factored_root_parts`). A graph of its own
    (its reductions run over rows and columns, the update's over blocks), so the roots are computed once per
    row and column, not once per element.

    Args:
        grad: (R, C) gradient, any floating dtype.
        v_row: (R,) fp32, v_col: (C,) fp32 — updated in place.
        scalars: (8,) fp32, factored layout of the module docstring.
        dense: return the (R, C) denominator ``row[r]·col[c] + ε`` (4 bytes/element, transient) instead of the
            factors; used when blocks straddle rows (``C % P != 0``), where the update cannot index the row
            factor in block order with affine indices (static).

    Returns:
        ``(row, col)``: (R,) and (C,) fp32; or ``(denominator,)``: (R, C) fp32.

    Source: Shazeer & Stern 2018; algorithm.md §6.4 steps 1–5.
    """
    square = grad.to(torch.float32).square()
    apply = scalars[APPLY] != 0
    v_row_new = _fma(square.mean(1), scalars[2], v_row * scalars[1])
    v_col_new = _fma(square.mean(0), scalars[2], v_col * scalars[1])
    normaliser = v_row_new.mean().clamp_min(FLOAT32_TINY) * scalars[5]
    _write_(v_row, v_row_new, apply)
    _write_(v_col, v_col_new, apply)
    row, col = torch.sqrt(v_row_new / normaliser), torch.sqrt(v_col_new)
    if dense:
        return (row.unsqueeze(1) * col.unsqueeze(0) + scalars[3],)
    return row, col


def fused_factored_update_(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    roots: tuple[Tensor, ...],
    codebook: Tensor,
    lut: Tensor,
    thresholds: Tensor,
    scalars: Tensor,
    *,
    steps: int,
    lerp_high: bool,
) -> None:
    """The factored step's first moment and parameter write (algorithm.md §6.4 steps 5–6), in place.

    ``p <- p·(1 − ηλ) − (η/bc1)·m̂ / (row[r]·col[c] + ε)``, every tensor in the (B, P) block view.

    Args:
        param: (B, P) view of the (R, C) parameter (fp32, bf16 or fp16), updated in place.
        grad: (B, P) view of the gradient, any floating dtype.
        codes: (B, P) uint8, scale: (B,) fp32 — first-moment state, updated in place.
        roots: :func:`factored_roots_`'s result: ``(row, col)`` — (R,), (C,), only when ``C % P == 0`` (whole
            blocks inside a row) — or ``(denominator,)`` (R, C).
        codebook, lut, thresholds, steps: codebook and nearest-code table.
        scalars: (8,) fp32, factored layout of the module docstring.
        lerp_high: ``1 − β1 >= 0.5`` (static).

    Source: algorithm.md §6.4.
    """
    blocks, period = param.shape
    if len(roots) == 1:
        denominator = roots[0].view(blocks, period)
    else:
        row, col = roots
        per_row = col.numel() // period  # blocks per row
        row_part = row.view(-1, 1, 1).expand(-1, per_row, 1).reshape(blocks, 1)
        col_part = col.view(1, per_row, period).expand(row.numel(), -1, -1).reshape(blocks, period)
        denominator = row_part * col_part + scalars[3]
    apply = scalars[APPLY] != 0
    m_hat = quantized_moment_(
        grad, codes, scale, scalars[0], codebook, lut, thresholds, steps=steps, lerp_high=lerp_high, apply=apply
    )
    write_param_(param, m_hat / denominator, scalars[4], scalars[7], apply)


def fused_momentum_(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    out: Tensor,
    codebook: Tensor,
    lut: Tensor,
    thresholds: Tensor,
    scalars: Tensor,
    *,
    steps: int,
    lerp_high: bool,
) -> None:
    """GefenMuon's quantized momentum update (algorithm.md §7.1 step 2), in place, with the dequantized result.

    Args:
        grad: (B, P) gradient, any floating dtype.
        codes: (B, P) uint8, scale: (B,) fp32 — the momentum state, updated in place.
        out: (B, P) fp32, receives ``m̂ = c[idx]·a``.
        codebook, lut, thresholds, steps: codebook and nearest-code table.
        scalars: fp32 tensor whose entry 0 is the EMA weight ``1 − β`` (β = momentum).
        lerp_high: ``1 − β >= 0.5`` (static).

    Source: algorithm.md §7.1, §6.2 steps 5–6.
    """
    m_hat = quantized_moment_(
        grad, codes, scale, scalars[0], codebook, lut, thresholds, steps=steps, lerp_high=lerp_high
    )
    out.copy_(m_hat)


def fused_step_(
    param: Tensor,
    grad: Tensor,
    view: ParamState,
    scalars: Tensor,
    tables: tuple[Tensor, Tensor, Tensor],
    steps: int,
    lerp_high: bool,
) -> None:
    """Apply one step of ``param`` in place: the block second moment's :func:`fused_block_step_`, or the factored
    one's :func:`factored_roots_` then :func:`fused_factored_update_` (algorithm.md §6.2, §6.4).

    Args:
        param: the parameter (any shape, fp32/bf16/fp16; a non-contiguous one is stepped through a copy).
        grad: its gradient, ``param``'s shape.
        view: its state (codes (B, P) uint8, magnitudes and second moments fp32), updated in place.
        scalars: the compiled row on the device (:meth:`gefen.kernels.scalars.StepScalars.compiled_row_on_device`).
        tables: codebook (256,), bucket table and thresholds on the device (``Gefen._fused_tables``).
        steps: the nearest-code table's compare steps; lerp_high: ``1 − β1 >= 0.5``.
    """
    blocks = tuple(view.codes.shape)
    target = param.detach()
    work = target if target.is_contiguous() else target.contiguous()
    g = kernel_grad(grad, blocks)
    if view.kind == "factored":
        rows, cols = param.shape
        roots = factored_roots_(
            g.view(rows, cols), view.second_moment_row, view.second_moment_col, scalars, dense=cols % view.period != 0
        )
        fused_factored_update_(
            work.view(blocks), g, view.codes, view.scale, roots, *tables, scalars, steps=steps, lerp_high=lerp_high
        )
    else:
        fused_block_step_(
            work.view(blocks),
            g,
            view.codes,
            view.scale,
            view.second_moment,
            *tables,
            scalars,
            steps=steps,
            lerp_high=lerp_high,
        )
    if work is not target:
        target.copy_(work)
