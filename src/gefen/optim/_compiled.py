"""One parameter's whole step through the fused graphs of :mod:`gefen.math.fused`, called directly (the
``capturable=True`` path: a ``torch.compile`` of the whole ``step()`` fuses it and a CUDA graph can capture it)."""

from __future__ import annotations

from torch import Tensor

from gefen.compiled import kernel_grad
from gefen.math.fused import factored_roots_, fused_block_step_, fused_factored_update_
from gefen.state import ParamState

__all__ = ["fused_step_"]


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
        scalars: (``SCALARS``,) fp32 on the device (:func:`gefen.math.fused.device_step_scalars`).
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
