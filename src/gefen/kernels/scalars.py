"""The per-step record of every backend: :class:`StepScalars`, built once per param group and step.

A step's constants (EMA weight, bias corrections, decay factor, signed step size) are derived from a group's
hyperparameters and a parameter's step counter ``t`` by one formula, :func:`derive`, written here once and evaluated
either on the host (Python floats, float64) or on a device (float64 tensors, for ``capturable=True``). Each backend
serialises the same record into its own form: the native library's C record (:meth:`StepScalars.native_fields`),
the compiled kernels' fp32 row (:meth:`StepScalars.compiled_row`, layout :data:`COMPILED_LAYOUT`), a device tensor.

Rounding (the eager reference's, :mod:`gefen.kernels.eager`): every constant is computed in float64 from the
Python floats of the group, as torch computes its Python scalars, and rounded to fp32 once where it is stored.

Source: algorithm.md §6.2 steps 2–4, §6.4 steps 3–5, §7.1 step 2.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.hyperparams import as_float

__all__ = ["StepScalars", "COMPILED_LAYOUT", "APPLY", "derive", "as_float32", "lerp_high"]

#: The compiled kernels' fp32 row, entry by entry: ``(block value, factored value)`` names of :func:`derive`'s keys.
#: Entry ``APPLY`` is the apply flag: 1 writes the step, 0 keeps every state and parameter value (a step decided
#: on the device, ``nonfinite="skip"`` without a host read).
COMPILED_LAYOUT: tuple[tuple[str, str], ...] = (
    ("w", "w"),
    ("beta2", "beta2"),
    ("one_minus_beta2", "one_minus_beta2"),
    ("eps", "eps"),
    ("decay", "decay"),
    ("root_bc2", "bc2"),
    ("inv_bc1", "one"),
    ("step", "step"),
    ("one", "one"),
)
#: Index of the apply flag in the compiled row.
APPLY = len(COMPILED_LAYOUT) - 1


def derive(
    beta1: Any, beta2: Any, eps: Any, lr: Any, weight_decay: Any, t: Any, factored: bool, sqrt: Callable[[Any], Any]
) -> dict[str, Any]:
    """Every per-step constant of one parameter, from its group's hyperparameters and its step count ``t >= 1``.

    Written once for the host (Python floats: ``sqrt=math.sqrt``) and the device (float64 tensors:
    ``sqrt=torch.sqrt``); the arithmetic is float64 either way.

    Returns:
        ``w = 1 − β1`` (the EMA weight), ``beta2``, ``one_minus_beta2``, ``eps``, ``decay = 1 − η·λ``,
        ``bc1 = 1 − β1^t``, ``bc2 = 1 − β2^t``, ``root_bc2 = sqrt(bc2)``, ``inv_bc1 = 1/bc1``, ``step`` (``−η``
        for a block moment, ``−η/bc1`` for a factored one: the factored update folds its bias correction into the
        step), ``one``.
    """
    bc1 = 1.0 - beta1**t
    bc2 = 1.0 - beta2**t
    inv_bc1 = 1.0 / bc1
    return {
        "w": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "eps": eps,
        "decay": 1.0 - lr * weight_decay,
        "bc1": bc1,
        "bc2": bc2,
        "root_bc2": sqrt(bc2),
        "inv_bc1": inv_bc1,
        "step": -lr * inv_bc1 if factored else -lr,
        "one": 1.0,
    }


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest fp32, as a Python float."""
    return _float32(value)


@functools.lru_cache(maxsize=256)
def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def lerp_high(weight: float) -> bool:
    """Whether ``torch.lerp`` takes its ``w >= 0.5`` branch for this EMA weight: torch tests the fp32 weight.

    Inside a ``torch.compile`` trace (``capturable=True``, where a changed hyperparameter is traced as a symbolic
    float) the exact value is compared instead; the two differ only within fp32 rounding of 0.5, where either
    branch is the same lerp to an ulp.
    """
    if torch.compiler.is_compiling():
        return abs(weight) >= 0.5
    return abs(as_float32(weight)) >= 0.5


@dataclass(frozen=True)
class StepScalars:
    """The hyperparameters of one param group at one step, as Python floats: the one per-step record.

    Attributes:
        beta1: the first-moment decay ``β1`` (GefenMuon: its ``momentum``).
        beta2: the second-moment decay ``β2`` (0 for GefenMuon's momentum).
        eps, lr, weight_decay: ``ε``, ``η``, ``λ`` (a tensor ``lr`` read once on the host).
    """

    beta1: float
    beta2: float = 0.0
    eps: float = 1.0
    lr: float = 0.0
    weight_decay: float = 0.0

    @classmethod
    def of_group(cls, group: Mapping[str, Any], beta1_key: str = "betas") -> StepScalars:
        """The record of a Gefen param group (``beta1_key="betas"``) or of GefenMuon's momentum (``"momentum"``).

        Raises:
            KeyError: the group lacks a hyperparameter (validated groups never do).
        """
        if beta1_key == "momentum":
            return cls(as_float(group["momentum"]))
        beta1, beta2 = (as_float(b) for b in group["betas"])
        return cls(beta1, beta2, as_float(group["eps"]), as_float(group["lr"]), as_float(group["weight_decay"]))

    def at(self, step: int, factored: bool) -> dict[str, float]:
        """:func:`derive` on the host for step count ``step`` (after increment, ``>= 1``); cached."""
        return _derive_host(self, step, factored)

    def native_fields(self, step: int, kind: str) -> tuple[float, ...]:
        """The scalar fields of the native library's record, in :data:`NATIVE_SCALAR_FIELDS` order (fp32 fields
        are rounded by the record's dtype when stored)."""
        return _native_fields(self, step, kind)

    def compiled_row(self, step: int, factored: bool) -> list[float]:
        """The compiled kernels' row (:data:`COMPILED_LAYOUT`, apply = 1) as Python floats; the caller's fp32
        tensor rounds each once."""
        values = self.at(step, factored)
        return [values[pair[1] if factored else pair[0]] for pair in COMPILED_LAYOUT]

    def compiled_row_on_device(self, step: Tensor, lr: float | Tensor, factored: bool) -> Tensor:
        """:meth:`compiled_row` computed on ``step``'s device from a device step counter (after increment) and a
        float or tensor ``lr``: no host read, so ``capturable=True`` can trace or capture it, and a tensor ``lr``
        changed in place between replays takes effect.

        Returns:
            (len(COMPILED_LAYOUT),) fp32 on ``step.device``.
        """
        device = step.device

        def const(value: float) -> Tensor:
            return torch.full((), value, dtype=torch.float64, device=device)

        eta = lr.to(device=device, dtype=torch.float64).reshape(()) if isinstance(lr, Tensor) else const(lr)
        values = derive(
            const(self.beta1),
            const(self.beta2),
            const(self.eps),
            eta,
            self.weight_decay,
            step.to(torch.float64),
            factored,
            torch.sqrt,
        )
        row = [values[pair[1] if factored else pair[0]] for pair in COMPILED_LAYOUT]
        return torch.stack([v if isinstance(v, Tensor) else const(v) for v in row]).to(torch.float32)


#: The record's scalar fields that :meth:`StepScalars.native_fields` fills, in order.
NATIVE_SCALAR_FIELDS = (
    "lerp_high",
    "w",
    "beta2",
    "one_minus_beta2",
    "eps",
    "decay",
    "step",
    "root_bc2",
    "inv_bc1",
    "bc2",
)


@functools.lru_cache(maxsize=1024)
def _derive_host(scalars: StepScalars, step: int, factored: bool) -> dict[str, float]:
    s = scalars
    return derive(s.beta1, s.beta2, s.eps, s.lr, s.weight_decay, step, factored, math.sqrt)


@functools.lru_cache(maxsize=1024)
def _native_fields(scalars: StepScalars, step: int, kind: str) -> tuple[float, ...]:
    values = _derive_host(scalars, step, kind == "factored")
    return (int(lerp_high(values["w"])),) + tuple(values[name] for name in NATIVE_SCALAR_FIELDS[1:])
