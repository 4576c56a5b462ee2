"""A canonical SHA-256 digest of nested training state, for checking that a resumed run is bit-identical to an
uninterrupted one (``model.state_dict()``, ``optimizer.state_dict()``, a scheduler's, codebooks).

Used by the Trainer resume gate (``benchmarks/trainer_resume.py``) and by the determinism, resume and multi-process
tests. Not part of the optimizer math: two states have equal digests exactly when they are equal structures of
equal values, bit for bit.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["state_digest"]


def _feed(h: Any, obj: object) -> None:
    """Feed ``obj`` into hash ``h`` with a type tag and length for every value, so that equal digests mean equal
    structures (a list never collides with a tuple, ``1`` with ``1.0`` or ``"1"``)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        h.update(f"T{t.dtype}{tuple(t.shape)}:{len(data)}:".encode())
        h.update(data)
    elif isinstance(obj, dict):
        items = sorted((_encoded(k), v) for k, v in obj.items())
        h.update(f"D{len(items)}:".encode())
        for key, value in items:
            h.update(key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}:".encode())
        for item in obj:
            _feed(h, item)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        text = obj.hex() if isinstance(obj, float) else repr(obj)  # float.hex: every bit, NaN/inf included
        h.update(f"S{type(obj).__name__}:{len(text)}:{text}".encode())
    elif isinstance(obj, (torch.dtype, torch.device)):
        h.update(f"P{type(obj).__name__}:{obj}".encode())
    else:
        raise TypeError(f"state_digest() cannot hash a {type(obj).__name__}: {obj!r}")


def _encoded(key: object) -> bytes:
    """A dict key's canonical bytes (their order is the sort order, so key order never matters)."""
    h = hashlib.sha256()
    _feed(h, key)
    return h.digest()


def state_digest(obj: object) -> str:
    """Canonical SHA-256 of a nested state.

    Dicts are hashed with their keys sorted (insertion order never matters), tensors by dtype, shape and raw bytes
    (any bit change does; moved to the CPU first), lists and tuples in order and told apart, scalars (``None``,
    bool, int, float by its exact bits, str, bytes, ``torch.dtype``, ``torch.device``) with their type.

    Args:
        obj: nested dicts/lists/tuples of tensors and scalars, e.g. ``optimizer.state_dict()``.

    Returns:
        64 lower-case hex characters.

    Raises:
        TypeError: a value of another type (e.g. a function) anywhere in ``obj``.

    Example:
        >>> import torch
        >>> state_digest({"b": torch.zeros(2), "a": 1}) == state_digest({"a": 1, "b": torch.zeros(2)})
        True
        >>> state_digest([1.0]) == state_digest([1])
        False
    """
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()
