"""Exception types raised by Gefen.

Every error subclasses the builtin a ``torch.optim`` user already catches, so ``except ValueError`` keeps
working. Messages name the place, the value, the constraint and the fix.
"""

from __future__ import annotations

__all__ = ["GefenError", "ConfigError", "CheckpointError", "StepError"]


class GefenError(Exception):
    """Base class of every error raised by Gefen on purpose."""


class ConfigError(GefenError, ValueError):
    """A constructor argument or param-group hyperparameter is invalid (raised before any state exists)."""


class CheckpointError(GefenError, ValueError):
    """A state dict cannot be loaded into this optimizer; the optimizer was left unchanged."""


class StepError(GefenError, RuntimeError):
    """``step()`` refused its inputs (bad gradient, bad lr tensor); params and state were left unchanged."""
