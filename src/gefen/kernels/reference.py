"""The eager torch reference of one Gefen step: the semantics every backend of :mod:`gefen.kernels` follows.

:func:`reference_step` takes the arguments of :func:`gefen.kernels.native.native_step` and applies the same update
with torch operations (the functions of :mod:`gefen.math.moments`, which ``Gefen``'s eager path runs chunk by
chunk). Its rounding rules are the contract of the other backends:

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

import torch
from torch import Tensor

from gefen.math.lookup import NearestCodeTable
from gefen.math.moments import (
    apply_update_,
    bias_correction,
    block_second_moment_,
    block_step_size,
    factored_denominator,
    factored_root_parts,
    factored_second_moment_,
    update_quantized_moment,
)

__all__ = ["reference_step"]


@torch.no_grad()
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
    """One step of one parameter (or GefenMuon's momentum) with torch operations, in place.

    Args:
        kind: ``"block"``, ``"factored"`` or ``"momentum"``.
        grad: (N,) gradient, any floating dtype. codes: (B, P) or (N,) uint8; scale: (B,) fp32 — updated in place.
        table: the codebook's nearest-code table (:func:`gefen.math.lookup.build_nearest_table`).
        period: ``P``; beta1: ``β1`` (Muon: the momentum).
        param: (N,) parameter (not for ``"momentum"``); second: ``(v,)`` or ``(v_row, v_col)`` fp32, in place.
        out: (N,) fp32 receiving ``m̂`` (``"momentum"``). shape: ``(R, C)`` when factored.
        beta2, eps, lr, weight_decay: hyperparameters; step: the step counter after increment (``t >= 1``).

    Source: algorithm.md §6.2, §6.4, §7.1 step 2, §13.5–13.6.
    """
    g_blocks = grad.reshape(-1).to(torch.float32).view(-1, period)
    moment = update_quantized_moment(codes.view(-1, period), scale, g_blocks, table, beta1)
    codes.view(-1, period).copy_(moment.codes)
    scale.copy_(moment.scale)
    if kind == "momentum":
        assert out is not None
        out.view(-1).copy_(moment.m_hat.view(-1))
        return
    assert param is not None
    bc1, bc2 = bias_correction(beta1, step), bias_correction(beta2, step)
    if kind == "block":
        v = block_second_moment_(second[0], g_blocks, beta2)
        direction = moment.m_hat.mul_(block_step_size(v, bc1, bc2, eps))
        apply_update_(param.view(-1), direction, lr, weight_decay, 1.0)
        return
    rows, cols = shape
    factored_second_moment_(second[0], second[1], g_blocks.reshape(rows, cols), beta2)
    row, col = factored_root_parts(second[0], second[1], bc2)
    direction = moment.m_hat.reshape(-1).div_(factored_denominator(row, col, eps).reshape(-1))
    apply_update_(param.view(-1), direction, lr, weight_decay, 1.0 / bc1)
