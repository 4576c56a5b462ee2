"""Gefen: memory-efficient PyTorch optimizers (~1 byte/param of optimizer state, AdamW-level loss).

Public names: :class:`Gefen` (AdamW drop-in), :class:`GefenMuon` (Muon with 8-bit momentum),
:class:`GefenMuonHybrid` (whole-model Muon), :func:`split_params_for_muon`, :func:`validate_split`,
``DEFAULT_BACKUP_SUBSTRINGS`` (the name fragments routed to the hybrid's backup), :func:`native_status`
(whether the native CPU backend runs here, and why not), the error types, and ``__version__``.

``import gefen`` itself loads neither torch nor the optimizers (PEP 562 module attributes): the first use of a
name above, or of a sub-module such as ``gefen.checkpoint``, imports what it needs. ``gefen --help`` and the
first moments of ``gefen demo`` so skip torch's ~1.5 s import; everything else behaves as an eager import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from gefen._version import __version__
from gefen.errors import CheckpointError, ConfigError, GefenError, StepError

if TYPE_CHECKING:
    from gefen.kernels.native import native_status
    from gefen.optim.gefen import Gefen
    from gefen.optim.hybrid import DEFAULT_BACKUP_SUBSTRINGS, GefenMuonHybrid, split_params_for_muon, validate_split
    from gefen.optim.muon import GefenMuon

#: Where each lazily imported public name lives.
_LAZY = {
    "Gefen": "gefen.optim.gefen",
    "GefenMuon": "gefen.optim.muon",
    "GefenMuonHybrid": "gefen.optim.hybrid",
    "split_params_for_muon": "gefen.optim.hybrid",
    "validate_split": "gefen.optim.hybrid",
    "DEFAULT_BACKUP_SUBSTRINGS": "gefen.optim.hybrid",
    "native_status": "gefen.kernels.native",
}

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


def __getattr__(name: str) -> Any:
    """Import a public name (:data:`_LAZY`) or a sub-module (``gefen.checkpoint``) on first use.

    Raises:
        AttributeError: ``name`` is neither (as for any module).
    """
    if name in _LAZY:
        value = getattr(_import(_LAZY[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = _import(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def _import(module: str) -> Any:
    """``importlib.import_module(module)`` through the ``import`` machinery ``-X importtime`` reports."""
    __import__(module)
    return sys.modules[module]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
