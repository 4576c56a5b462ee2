"""Guards of a step against contexts it cannot run in: ``torch.inference_mode``, a CUDA-graph capture of a
step that reads the host, a trace or capture in progress (hardening.md §3.2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gefen.errors import StepError

if TYPE_CHECKING:
    from gefen.optim._base import GefenOptimizer

__all__ = ["check_not_inference", "check_capture", "capturing"]


def check_not_inference(kind: str) -> None:
    """Refuse ``step()`` under ``torch.inference_mode()``: state created there would be inference tensors, which
    no later (normal) step may update in place.

    Raises:
        StepError: inference mode is on (nothing changed).
    """
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        raise StepError(
            f"{kind}.step() was called under torch.inference_mode(): optimizer state created or updated there "
            "becomes inference tensors that later training steps cannot update. Call step() outside "
            "inference_mode (torch.no_grad() is fine). Nothing was changed."
        )


def check_capture(optimizer: GefenOptimizer) -> None:
    """Refuse a trace or CUDA-graph capture that cannot work, before anything runs (hardening.md §3.2).

    Raises:
        StepError: CUDA-graph capturing a ``capturable=False`` step (host counters would be frozen into the
            graph), or a parameter that is not on the current capture device.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    if not optimizer.capturable:
        raise StepError(
            f"{optimizer.kind}.step() is being captured in a CUDA graph but the optimizer was built with "
            "capturable=False: its host-side counters would be frozen into the graph. Build it with "
            "capturable=True and run eager warm-up steps before capturing."
        )
    device = torch.device("cuda", torch.cuda.current_device())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device != device:
                raise StepError(
                    f"{optimizer.kind}(capturable=True): every parameter must be on the current capture device "
                    f"{device}; found one on {p.device}. Use one optimizer per device."
                )


def capturing() -> bool:
    """Inside a ``torch.compile`` trace or a CUDA-graph capture (where host-driven work cannot run)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
