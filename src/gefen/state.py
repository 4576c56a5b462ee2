"""Per-parameter optimizer state: the one place where key names, dtypes and shapes are declared.

A parameter's state is a flat dict of plain tensors (so it passes through ``torch.save``, DDP and DCP unchanged):

===========================  ==========  ==================  ===============================================
key                          dtype       shape               meaning
===========================  ==========  ==================  ===============================================
``step``                     int64       ()                  per-parameter update count ``t`` (bias correction)
``period``                   int64       ()                  block period ``P``, frozen after the first step
``first_moment_codes``       uint8       (B, P)              codebook indices of the first moment
``first_moment_scale``       float32     (B,)                per-block magnitude ``a_b >= 0``
``second_moment``            float32     (B,)                block-shared second moment (block kind)
``second_moment_row``        float32     (R,)                row mean-square EMA (factored kind, 2-D only)
``second_moment_col``        float32     (C,)                column mean-square EMA (factored kind, 2-D only)
``normuon_v``                float32     (R,)                NorMuon row mean-square EMA (GefenMuon, normuon)
``normuon_step``             int64       ()                  NorMuon counter (GefenMuon, normuon)
===========================  ==========  ==================  ===============================================

GefenMuon's parameters hold no second moment (kind ``"momentum"``; ``"momentum_normuon"`` adds the two NorMuon
entries).

``B = numel / P``. Validation of untrusted dicts against this spec lives in :mod:`gefen.checkpoint`; this module
only declares, builds and measures.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gefen.math.period import is_short_rowed, spans_rows

__all__ = [
    "STEP",
    "PERIOD",
    "FIRST_MOMENT_CODES",
    "FIRST_MOMENT_SCALE",
    "SECOND_MOMENT",
    "SECOND_MOMENT_ROW",
    "SECOND_MOMENT_COL",
    "NORMUON_V",
    "NORMUON_STEP",
    "SecondMomentKind",
    "TensorSpec",
    "state_spec",
    "is_factorable",
    "has_row_statistics",
    "layout_name",
    "second_moment_kind",
    "placeholder_state",
    "normuon_state",
    "drop_normuon_state",
    "state_mismatch",
    "init_state",
    "ParamState",
    "tensor_bytes",
    "state_bytes",
]

STEP = "step"
PERIOD = "period"
FIRST_MOMENT_CODES = "first_moment_codes"
FIRST_MOMENT_SCALE = "first_moment_scale"
SECOND_MOMENT = "second_moment"
SECOND_MOMENT_ROW = "second_moment_row"
SECOND_MOMENT_COL = "second_moment_col"
NORMUON_V = "normuon_v"
NORMUON_STEP = "normuon_step"

#: ``"block"``: one second moment per block; ``"factored"``: Adafactor row/column statistics (2-D only);
#: ``"momentum"``: none (GefenMuon); ``"momentum_normuon"``: none, plus NorMuon's row statistics.
SecondMomentKind = Literal["block", "factored", "momentum", "momentum_normuon"]


@dataclass(frozen=True)
class TensorSpec:
    """Declared dtype and shape of one state tensor.

    Attributes:
        dtype: the stored dtype.
        shape: the stored shape.
        non_negative: values must be finite and ``>= 0`` (magnitudes, second moments).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    non_negative: bool = False


def state_spec(param_shape: tuple[int, ...], period: int, kind: SecondMomentKind) -> dict[str, TensorSpec]:
    """The declared state of a parameter of ``param_shape`` with block period ``period``.

    Args:
        param_shape: the parameter's shape, ``numel >= 1``.
        period: ``P`` dividing ``numel``.
        kind: ``"factored"`` (only for 2-D shapes), ``"block"``, ``"momentum"`` or ``"momentum_normuon"``
            (2-D only).

    Returns:
        Ordered mapping key -> :class:`TensorSpec` for every tensor of the state.

    Raises:
        ValueError: ``period`` does not divide ``numel`` or ``kind`` is factored for a non-2-D shape.
    """
    return dict(_state_spec(tuple(param_shape), period, kind))


@functools.lru_cache(maxsize=1024)
def _state_spec(
    param_shape: tuple[int, ...], period: int, kind: SecondMomentKind
) -> tuple[tuple[str, TensorSpec], ...]:
    """:func:`state_spec` as an immutable tuple of items, cached (a model has few distinct shapes; a first step asks
    once per parameter)."""
    numel = 1
    for d in param_shape:
        numel *= d
    if period < 1 or numel % period != 0:
        raise ValueError(f"period {period} does not divide numel {numel} of shape {tuple(param_shape)}")
    n_blocks = numel // period
    spec = {
        STEP: TensorSpec(torch.int64, ()),
        PERIOD: TensorSpec(torch.int64, ()),
        FIRST_MOMENT_CODES: TensorSpec(torch.uint8, (n_blocks, period)),
        FIRST_MOMENT_SCALE: TensorSpec(torch.float32, (n_blocks,), non_negative=True),
    }
    if kind in ("factored", "momentum_normuon") and len(param_shape) != 2:
        raise ValueError(f"a {kind} state needs a 2-D parameter, got shape {tuple(param_shape)}")
    if kind == "factored":
        spec[SECOND_MOMENT_ROW] = TensorSpec(torch.float32, (param_shape[0],), non_negative=True)
        spec[SECOND_MOMENT_COL] = TensorSpec(torch.float32, (param_shape[1],), non_negative=True)
    elif kind == "block":
        spec[SECOND_MOMENT] = TensorSpec(torch.float32, (n_blocks,), non_negative=True)
    elif kind == "momentum_normuon":
        spec[NORMUON_V] = TensorSpec(torch.float32, (param_shape[0],), non_negative=True)
        spec[NORMUON_STEP] = TensorSpec(torch.int64, ())
    elif kind != "momentum":
        raise ValueError(f"unknown state kind {kind!r}")
    return tuple(spec.items())


def is_factorable(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` gets the factored second moment when ``factored_v_2d=True``.

    True for 2-D shapes ``(R, C)`` whose row and column statistics cost at most half a byte per parameter,
    ``4·(R + C) <= R·C / 2``; thin matrices such as ``(4096, 1)`` would otherwise hold 4 bytes/param of
    statistics, so they keep the block second moment.
    """
    return len(shape) == 2 and 8 * (shape[0] + shape[1]) <= shape[0] * shape[1]


def has_row_statistics(shape: tuple[int, ...]) -> bool:
    """Whether GefenMuon keeps NorMuon's per-row statistic for a matrix of ``shape`` (when ``normuon=True``).

    True for 2-D shapes ``(R, C)`` whose ``(R,)`` fp32 statistic costs at most half a byte per parameter,
    ``4·R <= R·C / 2`` (rows of at least 8 elements), the bound :func:`is_factorable` puts on the factored moment; a
    ``(4096, 1)`` column would otherwise hold 4 bytes/param of it, and NorMuon's per-row normalisation of rows of a
    few elements is little more than a per-element sign.
    """
    return len(shape) == 2 and 8 * shape[0] <= shape[0] * shape[1]


def second_moment_kind(optimizer: str, shape: tuple[int, ...], group: Mapping[str, Any]) -> SecondMomentKind:
    """The state kind an optimizer gives a parameter: the one rule the optimizers, checkpoint validation and
    ``gefen inspect`` read.

    Args:
        optimizer: ``"Gefen"`` or ``"GefenMuon"``.
        shape: the parameter's shape.
        group: its param group (``factored_v_2d`` for Gefen, default ``True``; ``normuon`` for GefenMuon, default
            ``False``).

    Returns:
        ``"momentum_normuon"``/``"momentum"`` for GefenMuon (``"momentum"`` also with ``normuon`` where
        :func:`has_row_statistics` is false: rows of fewer than 8 elements); for Gefen ``"factored"`` when
        ``factored_v_2d`` and :func:`is_factorable`, else ``"block"``.

    Raises:
        ValueError: an unknown ``optimizer``.
    """
    if optimizer == "GefenMuon":
        normuon = group.get("normuon", False) is True and has_row_statistics(tuple(shape))
        return "momentum_normuon" if normuon else "momentum"
    if optimizer != "Gefen":
        raise ValueError(f"unknown optimizer kind {optimizer!r}")
    return "factored" if group.get("factored_v_2d", True) is True and is_factorable(shape) else "block"


def layout_name(shape: tuple[int, ...], period: int, kind: SecondMomentKind) -> str:
    """How a parameter's state is laid out, in words (``state_report()``'s ``layout``).

    Args:
        shape: the parameter's (global) shape.
        period: its block period ``P``.
        kind: its state kind.

    Returns:
        ``"factored"`` (Adafactor row/column second moment, blocks inside rows); ``"blocks (flattened: degenerate
        shape)"`` for a shape whose rows are too short to hold a block (:func:`gefen.math.period.is_short_rowed`:
        1-D, ``(R, 1)``, ``(R, C <= 8)``, ``(C, 1, 1, 1)``; its blocks span rows,
        :func:`gefen.math.period.layout_period`); ``"blocks (spanning rows)"`` for blocks that straddle the rows of
        an ordinary shape (a period saved under gefen's earlier free rule); else ``"blocks"`` (blocks inside rows).
    """
    if kind == "factored":
        return "factored"
    if is_short_rowed(tuple(shape)):
        return "blocks (flattened: degenerate shape)"
    if spans_rows(tuple(shape), period):
        return "blocks (spanning rows)"
    return "blocks"


def placeholder_state(kind: SecondMomentKind | None = None) -> dict[str, Tensor]:
    """Zero counters standing in for "no state yet" in a saved state dict (see :mod:`gefen.checkpoint`).

    Args:
        kind: the kind the parameter will get; ``"momentum_normuon"`` adds the NorMuon counter.

    Returns:
        ``{"step": 0, "period": 0[, "normuon_step": 0]}``, int64 0-dim CPU tensors.
    """
    keys = (STEP, PERIOD, NORMUON_STEP) if kind == "momentum_normuon" else (STEP, PERIOD)
    return {key: torch.zeros((), dtype=torch.int64) for key in keys}


def normuon_state(rows: int, device: torch.device, counter_device: torch.device | None) -> dict[str, Tensor]:
    """The two NorMuon entries of :func:`state_spec` (kind ``"momentum_normuon"``), zero: the row statistic fp32
    ``(rows,)`` on ``device`` and the int64 () counter on ``counter_device`` (``None``: the CPU)."""
    return {
        NORMUON_V: torch.zeros((rows,), dtype=torch.float32, device=device),
        NORMUON_STEP: torch.zeros((), dtype=torch.int64, device=counter_device),
    }


def drop_normuon_state(state: dict[str, Any]) -> None:
    """Remove the NorMuon entries from a GefenMuon state in place (``normuon`` turned off: kind ``"momentum"``)."""
    state.pop(NORMUON_V, None)
    state.pop(NORMUON_STEP, None)


def state_mismatch(state: Mapping[str, Any], shape: tuple[int, ...], device: torch.device) -> str | None:
    """Why a live state no longer fits its parameter (resized or moved after the state was created), or ``None``.

    Args:
        state: the parameter's state (a sharded one as its DTensors, which report their global shapes); a state
            without ``first_moment_codes`` (none yet) always fits.
        shape: the parameter's (global) shape.
        device: the parameter's device.

    Returns:
        A short reason naming the state key, or ``None``.
    """
    codes = state.get(FIRST_MOMENT_CODES)
    if not isinstance(codes, Tensor):
        return None
    numel = 1
    for d in shape:
        numel *= d
    if codes.numel() != numel:
        return f"its {FIRST_MOMENT_CODES} {tuple(codes.shape)} cover {codes.numel()} elements, the parameter {numel}"
    for key, dim in ((SECOND_MOMENT_ROW, 0), (SECOND_MOMENT_COL, 1), (NORMUON_V, 0)):
        value = state.get(key)
        if isinstance(value, Tensor) and (len(shape) != 2 or value.shape[0] != shape[dim]):
            return f"its {key} has {value.shape[0]} entries for a parameter of shape {tuple(shape)}"
    if codes.device != device:
        return f"its state is on {codes.device}, the parameter on {device}"
    return None


def init_state(
    param: Tensor, period: int, kind: SecondMomentKind, zero_code: int, counters_on_device: bool = False
) -> dict[str, Tensor]:
    """Fresh state for ``param``: every moment exactly zero, counters 0.

    Args:
        param: the parameter (its shape and device are used).
        period: ``P`` dividing ``param.numel()``.
        kind: second-moment kind.
        zero_code: index of the exact-zero codebook entry; codes start there so ``c[idx]`` is 0 even before
            the magnitude is set.
        counters_on_device: put the step counters on ``param.device`` (``capturable=True``) instead of the CPU.

    Returns:
        New dict of tensors following :func:`state_spec`; moments (and counters if asked) on ``param.device``.
    """
    state: dict[str, Tensor] = {}
    device = param.device
    counters = device if counters_on_device else None
    # torch.full for every entry: ~2x cheaper to dispatch than torch.tensor / torch.zeros on the CPU, which adds up
    # over a model's first step (one call per state tensor)
    for key, spec in _state_spec(tuple(param.shape), period, kind):
        if key == STEP or key == NORMUON_STEP:
            state[key] = torch.full((), 0, dtype=spec.dtype, device=counters)
        elif key == PERIOD:
            state[key] = torch.full((), period, dtype=spec.dtype)
        else:
            fill = zero_code if key == FIRST_MOMENT_CODES else 0
            state[key] = torch.full(spec.shape, fill, dtype=spec.dtype, device=device)
    return state


@dataclass(frozen=True)
class ParamState:
    """Typed read-only view of one parameter's state dict (the tensors are shared, not copied).

    Attributes:
        step: int64 () counter.
        period: block period ``P``.
        codes: uint8 (B, P).
        scale: fp32 (B,).
        second_moment: fp32 (B,) or ``None`` when factored.
        second_moment_row: fp32 (R,) or ``None`` when block.
        second_moment_col: fp32 (C,) or ``None`` when block.
    """

    step: Tensor
    period: int
    codes: Tensor
    scale: Tensor
    second_moment: Tensor | None
    second_moment_row: Tensor | None
    second_moment_col: Tensor | None

    @property
    def kind(self) -> SecondMomentKind:
        """``"factored"`` (row/column statistics), ``"block"`` (per-block) or ``"momentum"`` (none)."""
        if self.second_moment_row is not None:
            return "factored"
        return "block" if self.second_moment is not None else "momentum"

    @classmethod
    def from_dict(cls, state: dict[str, Tensor]) -> ParamState:
        """Build the view from a state dict that follows :func:`state_spec`."""
        return cls(
            step=state[STEP],
            period=state[FIRST_MOMENT_CODES].shape[1],  # == state[PERIOD], read without a host sync
            codes=state[FIRST_MOMENT_CODES],
            scale=state[FIRST_MOMENT_SCALE],
            second_moment=state.get(SECOND_MOMENT),
            second_moment_row=state.get(SECOND_MOMENT_ROW),
            second_moment_col=state.get(SECOND_MOMENT_COL),
        )


def tensor_bytes(t: Tensor) -> int:
    """Bytes held by ``t``'s elements (``numel × element_size``), in bytes; for a DTensor, this rank's part."""
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(state: dict[str, object]) -> int:
    """Persistent bytes of one parameter's state: the sum over its tensors, in bytes."""
    return sum(tensor_bytes(v) for v in state.values() if isinstance(v, Tensor))
