"""Per-parameter checkpoint staging: validate one parameter's saved state against the live parameter's spec
(shape, dtype, period, sharding) and return fresh tensors ready to publish. Split from :mod:`gefen.checkpoint`
(the schema, metadata and whole-optimizer load), which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gefen.errors import CheckpointError
from gefen.math.period import spans_rows
from gefen.sharding import (
    SHARDED_KEYS,
    BlockShard,
    RowShard,
    as_sharded,
    is_dtensor,
    mesh_key,
    sharded_shape,
    state_shard,
)
from gefen.state import (
    FIRST_MOMENT_CODES,
    NORMUON_STEP,
    NORMUON_V,
    PERIOD,
    STEP,
    SecondMomentKind,
    has_row_statistics,
    state_spec,
)

__all__ = ["int_counter", "is_placeholder", "stage_param_state"]


_INT64_MAX = 2**63 - 1


def int_counter(value: object, where: str) -> int:
    """An integer counter (Python int or 1-element integer tensor) within the int64 range the state stores."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype in (torch.bool, torch.uint8):
            raise CheckpointError(
                f"{where} must be a 0-dim int64 tensor, got dtype {value.dtype} and shape {tuple(value.shape)}."
            )
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
            raise CheckpointError(f"{where}={value} does not fit the int64 counter the optimizer keeps.")
        return value
    raise CheckpointError(f"{where}={value!r} must be a non-negative integer.")


def stage_param_state(
    saved: object,
    shape: tuple[int, ...],
    kind: SecondMomentKind,
    where: str,
    device: torch.device | None = None,
    counter_device: torch.device | None = None,
    shard: RowShard | None = None,
) -> dict[str, Tensor]:
    """Validate one saved parameter state against the spec of a parameter of ``shape``; return fresh tensors.

    For a sharded parameter (``shard`` given) each row-sharded tensor (see :mod:`gefen.sharding`) may be saved
    as a ``Shard(0)`` DTensor of the live layout (a sharded checkpoint of the same world size) or as a full plain
    tensor in the sharded or single-process shape (a gathered checkpoint of any world size, or a single-process
    one): this rank keeps its own rows, so a checkpoint reshards N → M exactly. A plain parameter accepts the
    full sharded shapes as well.

    Args:
        saved: the untrusted per-parameter dict (never modified).
        shape: the parameter's shape (``numel >= 1``).
        kind: the second-moment kind it must have.
        where: prefix for messages.
        device: where the state tensors go (``None``: the CPU).
        counter_device: where the int64 counters go (``None``: the CPU; the parameter's device when the
            optimizer is ``capturable``).
        shard: the rows this rank holds of a sharded parameter, ``None`` for a plain one.

    Returns:
        New tensors following :func:`gefen.state.state_spec` (counters int64 0-dim); for a sharded parameter the
        row-sharded ones are ``Shard(0)`` DTensors of this rank's rows.

    Raises:
        CheckpointError: missing or extra keys, a period that does not divide ``numel``, counters that are not
            integers, negative or inconsistent, tensors of another dtype or shape, negative or non-finite
            magnitudes or second moments.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where} must be a dict of tensors, got {type(saved).__name__}.")
    odd = [k for k in saved if not isinstance(k, str)]
    if odd:
        raise CheckpointError(f"{where} has non-string keys {odd[:3]!r}; state keys are names such as 'step'.")
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        raise CheckpointError(f"{where} holds state for a zero-element parameter, which Gefen never steps.")
    if PERIOD not in saved or FIRST_MOMENT_CODES not in saved:
        raise CheckpointError(
            f"{where} lacks '{PERIOD}' or '{FIRST_MOMENT_CODES}' (quantized first moment); keys: {sorted(saved)}."
        )
    period = int_counter(saved[PERIOD], f"{where}['{PERIOD}']")
    if period < 1 or numel % period != 0:
        raise CheckpointError(
            f"{where}['{PERIOD}']={period} does not divide the parameter's {numel} elements "
            f"(shape {tuple(shape)}); the checkpoint belongs to another model."
        )
    if shard is not None and kind == "factored" and spans_rows(tuple(shape), period):
        raise CheckpointError(
            f"{where}['{PERIOD}']={period} does not divide the row length {shard.row_length} of the sharded "
            f"parameter {tuple(shape)}, whose second moment is factored: its blocks straddle rows, which the sharded "
            "factored step cannot split. It was saved under gefen's earlier free period rule: resume that run in one "
            "process (or with factored_v_2d=False), or give this parameter zero counters {'step': 0, 'period': 0} "
            "(its moments restart)."
        )
    spec = state_spec(tuple(shape), period, kind)
    if kind == "momentum" and set(saved) - set(spec) == {NORMUON_V, NORMUON_STEP} and not has_row_statistics(shape):
        # saved before NorMuon left out matrices with rows under 8 elements (gefen.state.has_row_statistics): its
        # row statistics no longer apply; the momentum loads as saved
        saved = {key: value for key, value in saved.items() if key not in (NORMUON_V, NORMUON_STEP)}
    if set(saved) != set(spec):
        raise CheckpointError(
            f"{where} has keys {sorted(saved)}, expected {sorted(spec)} for a {kind} state "
            f"(parameter shape {tuple(shape)}; are factored_v_2d / normuon the same as when it was saved?)."
        )
    step = int_counter(saved[STEP], f"{where}['{STEP}']")
    if step < 1:
        raise CheckpointError(f"{where}['{STEP}']={step} must be >= 1 for a parameter that has state.")
    staged: dict[str, Tensor] = {}
    for key, tspec in spec.items():
        value = saved[key]
        if key in (STEP, PERIOD):
            staged[key] = torch.tensor(step if key == STEP else period, dtype=torch.int64)
            continue
        if key == NORMUON_STEP:
            count = int_counter(value, f"{where}['{key}']")
            if not 0 <= count <= step:
                raise CheckpointError(f"{where}['{key}']={count} must be in [0, step={step}].")
            staged[key] = torch.tensor(count, dtype=torch.int64, device=counter_device)
            continue
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{where}['{key}'] must be a tensor, got {type(value).__name__}.")
        if key in SHARDED_KEYS and (shard is not None or is_dtensor(value)):
            staged[key] = _stage_rows(value, key, tspec, period, shape, shard, f"{where}['{key}']", device)
            continue
        if key in SHARDED_KEYS and shape and tuple(value.shape) == sharded_shape(key, tspec.shape, period, shape[0]):
            value = value.reshape(tspec.shape)  # a gathered sharded checkpoint loading into a single process
        if value.dtype != tspec.dtype or tuple(value.shape) != tspec.shape:
            raise CheckpointError(
                f"{where}['{key}'] has dtype {value.dtype} and shape {tuple(value.shape)}, expected "
                f"{tspec.dtype} and {tspec.shape}" + _shape_hint(value, tspec.dtype, tspec.shape, shape)
            )
        if tspec.non_negative and value.numel() and not bool(((value >= 0) & torch.isfinite(value)).all()):
            raise CheckpointError(f"{where}['{key}'] has negative or non-finite values.")
        staged[key] = value.detach().to(device=device).clone()
    staged[STEP] = staged[STEP].to(counter_device)
    return staged


def is_placeholder(saved: object) -> bool:
    """Zero counters and nothing else: what an optimizer saves for a parameter without state (see the module
    docstring)."""
    if not isinstance(saved, Mapping) or FIRST_MOMENT_CODES in saved or not saved:
        return False
    if not set(saved) <= {STEP, PERIOD, NORMUON_STEP}:
        return False
    return all(
        isinstance(v, Tensor) and v.numel() == 1 and not v.dtype.is_floating_point and int(v) == 0
        for v in saved.values()
    )


def _shape_hint(value: Tensor, dtype: torch.dtype, expected: tuple[int, ...], param_shape: Sequence[int]) -> str:
    """The end of a refusal for a state tensor of the wrong shape: a tensor of the right dtype whose element count
    differs was saved for a parameter of another size (another model); otherwise a loader cast or reshaped it."""
    count = 1
    for d in expected:
        count *= d
    if value.dtype == dtype and value.numel() != count:
        return (
            f": this checkpoint is from a different model (its state holds {value.numel()} elements where this "
            f"parameter of shape {tuple(param_shape)} needs {count}; were layer sizes changed since it was saved?). "
            "Load it into the model it was saved from, or start this optimizer afresh."
        )
    return " (was the state cast or reshaped by another loader?)."


def _stage_rows(
    value: Tensor,
    key: str,
    spec: Any,
    period: int,
    shape: tuple[int, ...],
    shard: RowShard | None,
    where: str,
    device: torch.device | None,
) -> Tensor:
    """This rank's rows of a row-sharded state tensor (its blocks, for blocks straddling rows: see
    :mod:`gefen.sharding`), validated and wrapped for the live layout."""
    if not shape:
        raise CheckpointError(
            f"{where} is a DTensor but the live parameter is a 0-dim tensor (never sharded); gather the checkpoint "
            "first (torch.distributed.checkpoint's get_optimizer_state_dict with full_state_dict=True)."
        )
    rows = shape[0]
    spanning = spans_rows(tuple(shape), period)
    full_shape = sharded_shape(key, spec.shape, period, rows, spanning)
    if shard is not None and spanning and key != NORMUON_V:  # blocks straddle rows: sharded by blocks
        split = state_shard(shard, period)
        assert isinstance(split, BlockShard)
        shard = split.blocks
    if value.dtype != spec.dtype:
        raise CheckpointError(f"{where} has dtype {value.dtype}, expected {spec.dtype}.")
    if is_dtensor(value):
        if shard is None:
            raise CheckpointError(
                f"{where} is a DTensor but the live parameter is a plain tensor; gather the checkpoint first "
                "(torch.distributed.checkpoint's get_optimizer_state_dict with full_state_dict=True)."
            )
        same = (
            tuple(value.shape) == full_shape
            and len(value.placements) == 1
            and type(value.placements[0]).__name__ == "Shard"
            and value.placements[0].dim == 0
            and mesh_key(value.device_mesh) == mesh_key(shard.mesh)
        )
        if not same:
            raise CheckpointError(
                f"{where} is a DTensor of shape {tuple(value.shape)} with placements {tuple(value.placements)} on "
                f"another mesh or layout than the live Shard(0) {full_shape}; load a full (gathered) checkpoint or "
                "one resharded by torch.distributed.checkpoint instead."
            )
        rows_here = value.to_local()
    else:
        if tuple(value.shape) == tuple(spec.shape):
            value = value.reshape(full_shape)
        if tuple(value.shape) != full_shape:
            raise CheckpointError(
                f"{where} has shape {tuple(value.shape)}, expected {full_shape} (or {tuple(spec.shape)})"
                + _shape_hint(value, spec.dtype, full_shape, shape)
            )
        if shard is None:
            rows_here = value
        else:
            rows_here = value[shard.start : shard.stop]
    if tuple(rows_here.shape[1:]) != full_shape[1:] or (
        shard is not None and rows_here.shape[0] != shard.stop - shard.start
    ):
        raise CheckpointError(f"{where}: this rank's rows have shape {tuple(rows_here.shape)}, not the live shard's.")
    if spec.non_negative and rows_here.numel() and not bool(((rows_here >= 0) & torch.isfinite(rows_here)).all()):
        raise CheckpointError(f"{where} has negative or non-finite values.")
    rows_here = rows_here.detach().to(device=device).clone()
    if shard is None:
        return rows_here.reshape(spec.shape)
    return as_sharded(rows_here, shard, full_shape)
