"""Validation of hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``, flags), shared by the
constructors, ``add_param_group``, ``step`` and checkpoint loading so that every path applies the same rules
and the same messages.

Each validator returns the normalised value or raises ``error`` (``ConfigError`` by default,
``CheckpointError`` when a checkpoint is being loaded) with a message that names where the value sits, the
value, the constraint and the fix.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gefen.errors import ConfigError

__all__ = [
    "check_lr",
    "as_float",
    "check_betas",
    "check_eps",
    "check_weight_decay",
    "check_bool",
    "check_group",
]


def _is_real_number(value: object) -> bool:
    """A real scalar: Python/numpy numbers (not bool), or a 1-element real tensor or numpy array."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (torch.SymFloat, torch.SymInt)):  # a float traced by torch.compile
        return True
    if isinstance(value, numbers.Real):
        return not type(value).__name__.startswith("bool")
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)  # numpy arrays, without numpy
    if shape is not None and dtype is not None and getattr(value, "size", 0) == 1:
        return getattr(dtype, "kind", "") in "fiu"
    return False


def _real(value: Any) -> float:
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value  # type: ignore[return-value]  # stays symbolic: torch.compile guards on its uses
    return float(value.reshape(()).item()) if isinstance(value, torch.Tensor) else float(value)


def _finite(value: float) -> bool:
    """``math.isfinite`` that also works on floats traced by ``torch.compile`` (``x − x`` is 0 unless NaN/±inf)."""
    return (value - value) == 0


def as_float(value: Any) -> float:
    """A validated scalar hyperparameter (``lr``, a beta, ``eps``...) as a Python float (a tensor is read on the
    host)."""
    return _real(value)


def _example(where: str, name: str) -> str:
    """The argument name for a message's "pass e.g." hint: the one ``where`` ends with (``backup_lr``,
    ``muon_weight_decay``) when it ends with ``name``, else ``name``."""
    match = re.search(r"([A-Za-z_][A-Za-z0-9_]*)'?\]?$", where)
    return match.group(1) if match and match.group(1).endswith(name) else name


def check_lr(
    lr: object, where: str, error: type[Exception] = ConfigError, host_values: bool = True
) -> float | torch.Tensor:
    """Validate a learning rate: a finite real ``>= 0``, or a 1-element real tensor holding one.

    Args:
        lr: the value to check.
        where: location for the message, e.g. ``"Gefen param_groups[1]['lr']"``.
        error: exception class to raise.
        host_values: read a tensor's value on the host to check it; ``False`` (``capturable=True`` steps)
            checks only its structure (1 element, floating dtype), so no host sync happens.

    Returns:
        ``lr`` unchanged (a float or a 1-element tensor).

    Raises:
        error: not a number / not 1 element / negative / NaN / infinite.
    """
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.is_complex() or lr.dtype == torch.bool):
        raise error(
            f"{where} is a tensor of shape {tuple(lr.shape)} and dtype {lr.dtype}; it must be a 1-element real "
            "tensor or a float; pass e.g. lr=torch.tensor(1e-3)."
        )
    if not _is_real_number(lr):
        raise error(f"{where}={lr!r} must be a float >= 0; pass e.g. {_example(where, 'lr')}=1e-3.")
    if isinstance(lr, torch.Tensor) and not host_values:
        if not lr.is_floating_point():
            raise error(f"{where} is a {lr.dtype} tensor; capturable=True needs a floating lr tensor.")
        return lr
    value = _real(lr)
    if not _finite(value) or value < 0.0:
        raise error(f"{where}={value} must be a finite number >= 0; pass e.g. {_example(where, 'lr')}=1e-3.")
    return lr  # type: ignore[return-value]


def check_betas(betas: object, where: str, error: type[Exception] = ConfigError) -> tuple[float, float]:
    """Validate Adam betas: two real numbers, each in ``[0, 1)``.

    Returns:
        ``(beta1, beta2)`` as floats.

    Raises:
        error: wrong type or length, or a value outside ``[0, 1)``.
    """
    try:
        pair = list(betas)  # type: ignore[call-overload]
    except TypeError:
        pair = []
    if isinstance(betas, (str, bytes)) or len(pair) != 2:
        raise error(f"{where}={betas!r} must be a pair (beta1, beta2); pass e.g. betas=(0.9, 0.999).")
    out = []
    for i, b in enumerate(pair):
        if not _is_real_number(b) or not (0.0 <= _real(b) < 1.0):  # NaN fails the range test too
            raise error(f"{where}[{i}]={b!r} must be a number in [0, 1); pass e.g. betas=(0.9, 0.999).")
        out.append(_real(b))
    return out[0], out[1]


def check_decay_rate(value: object, where: str, error: type[Exception] = ConfigError) -> float:
    """Validate one EMA decay (Muon ``momentum``, NorMuon ``normuon_beta2``): a real number in ``[0, 1)``.

    Raises:
        error: not a number or outside ``[0, 1)`` (NaN included).
    """
    if not _is_real_number(value) or not (0.0 <= _real(value) < 1.0):
        raise error(f"{where}={value!r} must be a number in [0, 1); pass e.g. 0.95.")
    return _real(value)


def check_eps(eps: object, where: str, error: type[Exception] = ConfigError) -> float:
    """Validate eps: a finite real ``> 0`` (algorithm.md §13.8).

    Raises:
        error: not a number, ``<= 0``, NaN or infinite.
    """
    if not _is_real_number(eps) or not _finite(_real(eps)) or _real(eps) <= 0.0:
        raise error(f"{where}={eps!r} must be a finite number > 0; pass e.g. eps=1e-8.")
    return _real(eps)


def check_weight_decay(weight_decay: object, where: str, error: type[Exception] = ConfigError) -> float:
    """Validate decoupled weight decay: a finite real ``>= 0``.

    Raises:
        error: not a number, negative, NaN or infinite.
    """
    wd = weight_decay
    if not _is_real_number(wd) or not _finite(_real(wd)) or _real(wd) < 0.0:
        raise error(
            f"{where}={weight_decay!r} must be a finite number >= 0; pass e.g. {_example(where, 'weight_decay')}=0.01."
        )
    return _real(wd)


def check_bool(value: object, where: str, error: type[Exception] = ConfigError) -> bool:
    """Validate a flag: must be a real ``bool`` (``1`` or ``"False"`` are refused, never coerced).

    Raises:
        error: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise error(f"{where}={value!r} must be a bool (True or False).")
    return value


def check_flags(kind: str, flags: Mapping[str, object], optional: Sequence[str] = ()) -> None:
    """Constructor type check of boolean options: each must be a real ``bool`` (``None`` also allowed for the
    names in ``optional``, e.g. ``fused``).

    Raises:
        TypeError: a flag of another type (``1`` or ``"False"`` are refused, never coerced).
    """
    for name, value in flags.items():
        if isinstance(value, bool) or (value is None and name in optional):
            continue
        allowed = "None, True or False" if name in optional else "a bool (True or False)"
        raise TypeError(f"{kind} {name}={value!r} must be {allowed}.")


def check_group(
    group: Mapping[str, Any], where: str, error: type[Exception] = ConfigError, host_values: bool = True
) -> None:
    """Validate the Adam-family hyperparameters of one param group (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``factored_v_2d``, ``fused``, ``backend``) that are present in ``group``.

    Args:
        group: a param-group mapping.
        where: prefix for messages, e.g. ``"Gefen param_groups[0]"``.
        error: exception class to raise.
        host_values: see :func:`check_lr`.

    Raises:
        error: the first invalid value found.
    """
    if "lr" in group:
        check_lr(group["lr"], f"{where}['lr']", error, host_values)
    if "betas" in group:
        check_betas(group["betas"], f"{where}['betas']", error)
    if "eps" in group:
        check_eps(group["eps"], f"{where}['eps']", error)
    if "weight_decay" in group:
        check_weight_decay(group["weight_decay"], f"{where}['weight_decay']", error)
    if "factored_v_2d" in group:
        check_bool(group["factored_v_2d"], f"{where}['factored_v_2d']", error)
    if "fused" in group and group["fused"] is not None:
        check_bool(group["fused"], f"{where}['fused']", error)
    if "backend" in group:
        from gefen.kernels.backends import BACKENDS  # the registry (imported here: it imports this module)

        if group["backend"] not in BACKENDS:
            raise error(f"{where}['backend'] = {group['backend']!r} is not one of {', '.join(map(repr, BACKENDS))}.")


#: ``torch.optim.AdamW`` keyword arguments and the values Gefen accepts: the "off" value, and for ``foreach``
#: (which only picks torch's loop, never the math) any of its values.
_TORCH_ONLY_OPTIONS: dict[str, tuple[object, ...]] = {
    "maximize": (False,),
    "amsgrad": (False,),
    "differentiable": (False,),
    "foreach": (None, False, True),
}


def refuse_torch_only_options(kind: str, options: Mapping[str, Any]) -> None:
    """Refuse ``torch.optim.AdamW`` options a Gefen optimizer does not implement, with a clear message.

    ``foreach`` may be ``None``, ``False`` or ``True`` (no effect: Gefen runs its own step); the others only
    their "off" value, so code written for AdamW that passes the defaults explicitly keeps working.

    Raises:
        TypeError: an unknown keyword argument.
        ConfigError: a known AdamW option set to a value Gefen does not implement.
    """
    for key, value in options.items():
        if key not in _TORCH_ONLY_OPTIONS:
            raise TypeError(f"{kind}.__init__() got an unexpected keyword argument {key!r}")
        allowed = _TORCH_ONLY_OPTIONS[key]
        if not any(value is a for a in allowed):
            raise ConfigError(
                f"{kind} does not implement torch.optim.AdamW's {key}={value!r}; remove the argument "
                f"(Gefen has its own update path)."
            )
