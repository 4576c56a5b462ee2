"""Warnings that point at the user's line, however deep inside gefen and torch they are raised."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user"]

_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the first frame outside the gefen and torch packages (the
    caller's ``opt.step()``), so the warning is attributed to the user's code whatever wraps the step
    (``torch.no_grad``, step hooks, ``torch.compiler.disable``)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)
