"""Gefen: memory-efficient PyTorch optimizers (~1 byte/param of optimizer state, AdamW-level loss).

Public names: :class:`Gefen` (AdamW drop-in), the error types, and ``__version__``.
"""

from gefen._version import __version__
from gefen.errors import CheckpointError, ConfigError, GefenError, StepError
from gefen.optim.gefen import Gefen

__all__ = ["Gefen", "GefenError", "ConfigError", "CheckpointError", "StepError", "__version__"]
