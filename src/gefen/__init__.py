"""Gefen: memory-efficient PyTorch optimizers (~1 byte/param of optimizer state, AdamW-level loss).

Public names: :class:`Gefen` (AdamW drop-in), :class:`GefenMuon` (Muon with 8-bit momentum),
:class:`GefenMuonHybrid` (whole-model Muon), :func:`split_params_for_muon`, :func:`validate_split`,
``DEFAULT_BACKUP_SUBSTRINGS`` (the name fragments routed to the hybrid's backup), :func:`native_status`
(whether the native CPU backend runs here, and why not), the error types, and ``__version__``.
"""

from gefen._version import __version__
from gefen.errors import CheckpointError, ConfigError, GefenError, StepError
from gefen.kernels.native import native_status
from gefen.optim.gefen import Gefen
from gefen.optim.hybrid import DEFAULT_BACKUP_SUBSTRINGS, GefenMuonHybrid, split_params_for_muon, validate_split
from gefen.optim.muon import GefenMuon

__all__ = [
    "Gefen",
    "GefenMuon",
    "GefenMuonHybrid",
    "split_params_for_muon",
    "validate_split",
    "DEFAULT_BACKUP_SUBSTRINGS",
    "native_status",
    "GefenError",
    "ConfigError",
    "CheckpointError",
    "StepError",
    "__version__",
]
