"""Warnings that point at the user's line, however deep inside gefen and torch they are raised."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user"]

_GEFEN = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTERNAL = (_GEFEN, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
#: Parts of gefen that use the optimizers as a user would: their lines are where a warning belongs.
_CALLERS = (os.path.join(_GEFEN, "cli") + os.sep,)


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_INTERNAL) and not path.startswith(_CALLERS)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the line that called into the optimizer: the first frame outside gefen's
    library code and torch (the caller's ``opt.step()`` or ``Gefen(...)``), whatever wraps the step
    (``torch.no_grad``, step hooks, ``torch.compiler.disable``).

    Frames of gefen's command line (``gefen.cli``) count as the caller: ``gefen demo`` steps its optimizers in
    a ``ProcessPoolExecutor`` child, where the first frame past gefen would be ``concurrent/futures``.

    Args:
        message: the warning's text.
        category: its class (a :class:`Warning` subclass).
    """
    level, frame = 1, sys._getframe(1)
    while frame is not None and _is_internal(frame.f_code.co_filename):
        level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)
