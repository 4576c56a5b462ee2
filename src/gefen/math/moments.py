"""Moment updates of Gefen: second-moment EMAs (block-shared and factored), bias correction, the quantized
first-moment EMA, and the parameter write with decoupled weight decay.

Symbols (algorithm.md §0): ``g`` gradient, ``m`` first moment, ``v`` second moment, ``t`` the per-parameter step
after increment, ``β1, β2`` betas, ``ε`` eps, ``η`` lr, ``λ`` weight decay, ``c`` the codebook, ``idx`` uint8
codes, ``a`` per-block magnitude. A block is ``P`` consecutive elements of the row-major flattened tensor, so a
tensor of ``N`` elements has the block view ``(B, P)`` with ``B = N / P``.

Every intermediate is fp32 (§13.5). Functions ending in ``_`` update their first argument in place; the others
return new tensors. Nothing here knows about param groups or optimizer state dicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gefen.math.codebook import decode
from gefen.math.lookup import NearestCodeTable, gather, nearest_code_fast

__all__ = [
    "sharded_factored_second_moment_",
    "FLOAT32_TINY",
    "bias_correction",
    "block_second_moment_",
    "factored_second_moment_",
    "block_step_size",
    "factored_root_parts",
    "factored_denominator",
    "QuantizedMoment",
    "update_quantized_moment",
    "apply_update_",
]

#: Smallest normal fp32 value; floor of the factored normaliser (algorithm.md §6.4 step 4).
FLOAT32_TINY = 1.1754943508222875e-38


def bias_correction(beta: float, step: int) -> float:
    """Adam bias correction ``1 - beta**step`` as a Python float.

    Args:
        beta: decay rate in ``[0, 1)``.
        step: number of EMA updates so far, ``>= 1``.

    Source: Kingma & Ba 2015, Algorithm 1; algorithm.md §6.2 step 2.
    """
    return 1.0 - beta**step


def block_second_moment_(v: Tensor, g_blocks: Tensor, beta2: float) -> Tensor:
    """EMA of the per-block mean square: ``v_b <- β2·v_b + (1 − β2)·mean_j g_bj²``, in place.

    Args:
        v: (B,) fp32 second moment, updated in place.
        g_blocks: (B, P) fp32 gradient blocks (not modified).
        beta2: decay in ``[0, 1)``.

    Returns:
        ``v``.

    Source: algorithm.md §6.2 step 1.
    """
    return v.mul_(beta2).add_(g_blocks.square().mean(dim=1), alpha=1.0 - beta2)


def factored_second_moment_(v_row: Tensor, v_col: Tensor, g: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """Adafactor row/column EMAs of the mean square, in place.

    ``v_row <- β2·v_row + (1 − β2)·mean_c g_rc²`` and ``v_col <- β2·v_col + (1 − β2)·mean_r g_rc²``; the
    column means come from float64 sums (as in the native kernel), so they do not depend on how rows are split.

    Args:
        v_row: (R,) fp32, updated in place.
        v_col: (C,) fp32, updated in place.
        g: (R, C) fp32 gradient (not modified; squared into a fresh buffer).
        beta2: decay in ``[0, 1)``.

    Returns:
        ``(v_row, v_col)``.

    Source: Shazeer & Stern 2018 (Adafactor); algorithm.md §6.4 steps 1–2.
    """
    sq = g.square()
    v_row.mul_(beta2).add_(sq.mean(dim=1), alpha=1.0 - beta2)
    # the column means over float64 sums, as the native kernel and the row-sharded form take them: the same value
    # however the rows are split (up to rare float64 rounding ties)
    v_col.mul_(beta2).add_((sq.sum(dim=0, dtype=torch.float64) / g.shape[0]).to(torch.float32), alpha=1.0 - beta2)
    return v_row, v_col


def sharded_factored_second_moment_(
    v_row: Tensor, v_col: Tensor, g: Tensor, beta2: float, rows: int, reduce: Callable[[Tensor], Any]
) -> Tensor:
    """:func:`factored_second_moment_` for this rank's rows of a row-sharded (FSDP2 ``Shard(0)``) matrix.

    A row's statistic is local; the column statistic and the mean of the row moments need every rank's rows: their
    sums are taken in float64 (this rank's rows), summed over the ranks by ``reduce`` (one all-reduce of ``C + 1``
    values), divided by ``rows`` and rounded to fp32 once, so the result does not depend on how the rows are split
    (up to rare float64 rounding ties).

    Args:
        v_row: (r,) fp32, this rank's rows of the row moment, updated in place.
        v_col: (C,) fp32, the column moment (the same on every rank), updated in place.
        g: (r, C) fp32, this rank's rows of the gradient (``r`` may be 0).
        beta2: decay in ``[0, 1)``.
        rows: ``R``, the matrix's rows on all ranks.
        reduce: sums a float64 tensor over the ranks in place (a collective: every rank calls it once).

    Returns:
        0-dim fp32: the mean of the updated row moment over all ``R`` rows (for :func:`factored_root_parts`).

    Source: Shazeer & Stern 2018 (Adafactor); algorithm.md §6.4 steps 1–2, 4.
    """
    sq = g.square()
    v_row.mul_(beta2).add_(sq.mean(dim=1), alpha=1.0 - beta2)
    piece = torch.cat([sq.sum(dim=0, dtype=torch.float64), v_row.sum(dtype=torch.float64).view(1)])
    reduce(piece)
    v_col.mul_(beta2).add_((piece[:-1] / rows).to(torch.float32), alpha=1.0 - beta2)
    return (piece[-1] / rows).to(torch.float32)


def block_step_size(v: Tensor, bc1: float, bc2: float, eps: float) -> Tensor:
    """Per-block Adam step size ``s_b = (1/bc1) / (sqrt(v_b)/sqrt(bc2) + ε)``.

    Args:
        v: (B,) fp32 second moment (already updated this step).
        bc1: first-moment bias correction ``1 − β1^t`` (> 0).
        bc2: second-moment bias correction ``1 − β2^t`` (> 0).
        eps: ε > 0, added to the bias-corrected root exactly as in AdamW.

    Returns:
        (B, 1) fp32, ready to broadcast against the (B, P) momentum blocks.

    Source: algorithm.md §6.2 step 4.
    """
    return ((v.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1)).unsqueeze(1)


def factored_root_parts(v_row: Tensor, v_col: Tensor, bc2: float, mean: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Row and column factors of the bias-corrected root of the factored second moment.

    ``V̂_rc = v_row[r]·v_col[c] / max(mean(v_row), FLOAT32_TINY)`` and
    ``sqrt(V̂_rc / bc2) = row[r]·col[c]`` with ``row = sqrt(v_row / (max(mean(v_row), tiny)·bc2))`` and
    ``col = sqrt(v_col)``. Splitting the root keeps the per-element work to one product (same value as the
    direct formula up to fp32 rounding).

    Args:
        v_row: (R,) fp32 (already updated this step).
        v_col: (C,) fp32 (already updated this step).
        bc2: ``1 − β2^t`` (> 0).
        mean: the mean of ``v_row`` over all rows when ``v_row`` holds only this rank's rows of a sharded matrix
            (from :func:`sharded_factored_second_moment_`); default ``v_row.mean()``.

    Returns:
        ``(row, col)``: (R,) and (C,) fp32.

    Source: Shazeer & Stern 2018; algorithm.md §6.4 steps 4–5.
    """
    if mean is None:  # a float64 sum, as in the native kernel and the row-sharded form
        mean = (v_row.sum(dtype=torch.float64) / v_row.numel()).to(torch.float32)
    normaliser = mean.clamp_min(FLOAT32_TINY) * bc2
    return (v_row / normaliser).sqrt_(), v_col.sqrt()


def factored_denominator(row: Tensor, col: Tensor, eps: float) -> Tensor:
    """Per-element Adam denominator ``row[r]·col[c] + ε`` for some rows.

    Args:
        row: (r,) fp32, the rows wanted (a slice of :func:`factored_root_parts`'s ``row``).
        col: (C,) fp32.
        eps: ε > 0.

    Returns:
        (r, C) fp32. The step size is ``(1/bc1) / denominator``.

    Source: algorithm.md §6.4 step 5.
    """
    return torch.outer(row, col).add_(eps)


class QuantizedMoment(NamedTuple):
    """Result of one quantized first-moment update.

    Attributes:
        codes: (B, P) int32 codebook indices of the new first moment (store them as uint8).
        scale: (B,) fp32 per-block magnitude ``a_b = max_j |m_bj|``.
        m_hat: (B, P) fp32 dequantized new first moment ``c[codes]·a`` (what the update uses).
    """

    codes: Tensor
    scale: Tensor
    m_hat: Tensor


def update_quantized_moment(
    codes: Tensor, scale: Tensor, g_blocks: Tensor, table: NearestCodeTable, beta: float
) -> QuantizedMoment:
    """Dequantize → EMA → requantize the first moment of some whole blocks.

    ``m = lerp(c[idx]·a, g, 1 − β)``; ``a <- max_j |m_bj|``; ``idx <- nearest(c, m/a)`` (``u = 0`` for a
    zero block); ``m̂ = c[idx]·a``. Identical to ``encode``/``decode`` of :mod:`gefen.math.codebook`, with the
    O(1) nearest-code search of :mod:`gefen.math.lookup`.

    Args:
        codes: (B, P) uint8 current codes (not modified).
        scale: (B,) fp32 current magnitudes (not modified).
        g_blocks: (B, P) fp32 gradient blocks.
        table: nearest-code table of the (256,) fp32 codebook.
        beta: EMA decay (β1 for Gefen, the momentum μ for Muon), in ``[0, 1)``.

    Returns:
        :class:`QuantizedMoment` with new codes, magnitudes and the dequantized momentum.

    Source: algorithm.md §6.2 steps 5–6.
    """
    m = decode(codes, scale, table.codebook).lerp_(g_blocks, 1.0 - beta)
    new_scale = m.abs().amax(dim=1)  # (much faster on CPU than linalg.vector_norm(m, inf, dim=1), same value)
    u = m.div_(torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))[:, None])
    index = nearest_code_fast(u, table)
    m_hat = gather(table.codebook, index).mul_(new_scale[:, None])
    return QuantizedMoment(index, new_scale, m_hat)


def apply_update_(
    param: Tensor, direction: Tensor, lr: float, weight_decay: float, direction_scale: float = 1.0
) -> Tensor:
    """Write ``p <- p·(1 − η·λ) − η·k·d`` into ``param`` once, in its own dtype (round to nearest).

    The arithmetic runs in fp32 (fp64 for fp64 parameters); a bf16/fp16 parameter is rounded exactly once.

    Args:
        param: the parameter (or a contiguous piece of it), fp32/bf16/fp16/fp64; updated in place.
        direction: ``d`` with ``param.numel()`` elements, fp32, any shape (viewed as ``param``'s shape).
        lr: η >= 0.
        weight_decay: λ >= 0 (decoupled; multiplied by the raw lr).
        direction_scale: ``k``, a scalar folded into the step (e.g. ``1/bc1``).

    Returns:
        ``param``.

    Source: Loshchilov & Hutter 2019 (decoupled weight decay); algorithm.md §6.2 steps 3 and 6, §13.5–13.6.
    """
    compute_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    d = direction.reshape(param.shape).to(compute_dtype)
    step = -lr * direction_scale
    if param.dtype == compute_dtype:
        if weight_decay != 0.0:
            param.mul_(1.0 - lr * weight_decay)
        return param.add_(d, alpha=step)
    work = param.to(compute_dtype)
    if weight_decay != 0.0:
        work.mul_(1.0 - lr * weight_decay)
    work.add_(d, alpha=step)
    return param.copy_(work)
