"""Checkpoint schema of Gefen optimizers: the only code that validates an untrusted state dict.

``state_dict()`` of a Gefen optimizer is torch's layout plus one metadata entry::

    {"state": {i: {<keys of gefen.state>}}, "param_groups": [...],
     "gefen": {"schema_version": 1, "optimizer": "Gefen", "period_search": "<variant>",
               "codebook": fp32 (256,) tensor or None, "global_step": int}}

Everything in it is a tensor, a number, a string, a list or a dict, so ``torch.load(weights_only=True)`` reads it.

Loading is staged: :func:`stage_load` validates the whole dict against the live parameters and the spec of
:mod:`gefen.state`, and builds brand-new state tensors (saved dtypes kept, placed on each parameter's device —
unlike ``torch.optim.Optimizer.load_state_dict``, which would cast uint8 codes and fp32 moments to a bf16
parameter's dtype). The optimizer then publishes the staged result with plain assignments, so a refused load
leaves it bit-identical and never touches the caller's dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.errors import CheckpointError
from gefen.hyperparams import check_group
from gefen.math.codebook import validate_codebook
from gefen.math.period import PERIOD_SEARCH_VARIANT
from gefen.state import FIRST_MOMENT_CODES, NORMUON_STEP, PERIOD, STEP, SecondMomentKind, state_spec

__all__ = ["SCHEMA_VERSION", "METADATA_KEY", "build_metadata", "StagedLoad", "stage_load"]

#: Version of the layout above. Bump it (and add ``migrate_v{N}_to_v{N+1}``) whenever the layout changes.
SCHEMA_VERSION = 1
#: Top-level key of the metadata entry.
METADATA_KEY = "gefen"


def build_metadata(optimizer_kind: str, codebook: Tensor | None, global_step: int) -> dict[str, Any]:
    """The metadata entry written next to ``state`` and ``param_groups``.

    Args:
        optimizer_kind: class name, e.g. ``"Gefen"``.
        codebook: fp32 (256,) codebook, or ``None`` before the first step.
        global_step: number of completed ``step()`` calls that updated anything.

    Returns:
        A dict of plain values (the codebook is cloned so later steps cannot change a saved dict).
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "optimizer": optimizer_kind,
        "period_search": PERIOD_SEARCH_VARIANT,
        "codebook": None if codebook is None else codebook.detach().clone(),
        "global_step": int(global_step),
    }


@dataclass
class StagedLoad:
    """A fully validated load, ready to publish.

    Attributes:
        state: live parameter -> fresh state dict (tensors owned by nobody else).
        param_groups: new group dicts (saved hyperparameters, live ``params``).
        codebook: fp32 (256,) on the codebook device, or ``None``.
        global_step: restored global step.
    """

    state: dict[Tensor, dict[str, Tensor]]
    param_groups: list[dict[str, Any]]
    codebook: Tensor | None
    global_step: int


def _int_counter(value: object, where: str) -> int:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype in (torch.bool, torch.uint8):
            raise CheckpointError(
                f"{where} must be a 0-dim int64 tensor, got dtype {value.dtype} and shape {tuple(value.shape)}."
            )
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CheckpointError(f"{where}={value!r} must be a non-negative integer.")


def _read_metadata(state_dict: Mapping[str, Any], optimizer_kind: str) -> tuple[Tensor | None, int]:
    meta = state_dict.get(METADATA_KEY)
    if not isinstance(meta, Mapping):
        raise CheckpointError(
            f"this is not a {optimizer_kind} checkpoint: the '{METADATA_KEY}' metadata entry is missing "
            "(was it saved by another optimizer, or by a tool that keeps only 'state' and 'param_groups'?); "
            f"load the dict returned by {optimizer_kind}.state_dict()."
        )
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"checkpoint schema_version={version!r} is not a positive integer.")
    if version > SCHEMA_VERSION:
        raise CheckpointError(
            f"checkpoint schema_version={version} is newer than this gefen supports ({SCHEMA_VERSION}); "
            "upgrade gefen to load it."
        )
    kind = meta.get("optimizer")
    if kind != optimizer_kind:
        raise CheckpointError(f"checkpoint was saved by optimizer {kind!r}, cannot load it into {optimizer_kind}.")
    variant = meta.get("period_search")
    if variant != PERIOD_SEARCH_VARIANT:
        raise CheckpointError(
            f"checkpoint period_search={variant!r} is not this gefen's variant {PERIOD_SEARCH_VARIANT!r}."
        )
    global_step = _int_counter(meta.get("global_step"), "checkpoint global_step")
    if global_step < 0:
        raise CheckpointError(f"checkpoint global_step={global_step} must be >= 0.")
    codebook = meta.get("codebook")
    if codebook is not None:
        reason = validate_codebook(codebook)
        if reason is not None:
            raise CheckpointError(f"checkpoint codebook is invalid: {reason}.")
    return codebook, global_step


def _stage_param_state(saved: object, param: Tensor, kind: SecondMomentKind, where: str) -> dict[str, Tensor]:
    """Validate one saved parameter state and return fresh tensors on the parameter's device."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where} must be a dict of tensors, got {type(saved).__name__}.")
    if param.numel() == 0:
        raise CheckpointError(f"{where} holds state for a zero-element parameter, which Gefen never steps.")
    if PERIOD not in saved or FIRST_MOMENT_CODES not in saved:
        raise CheckpointError(f"{where} lacks '{PERIOD}' or '{FIRST_MOMENT_CODES}'; keys: {sorted(saved)}.")
    period = _int_counter(saved[PERIOD], f"{where}['{PERIOD}']")
    if period < 1 or param.numel() % period != 0:
        raise CheckpointError(
            f"{where}['{PERIOD}']={period} does not divide the parameter's {param.numel()} elements "
            f"(shape {tuple(param.shape)}); the checkpoint belongs to another model."
        )
    spec = state_spec(tuple(param.shape), period, kind)
    if set(saved) != set(spec):
        raise CheckpointError(
            f"{where} has keys {sorted(saved)}, expected {sorted(spec)} for a {kind} state "
            f"(parameter shape {tuple(param.shape)}; are factored_v_2d / normuon the same as when it was saved?)."
        )
    step = _int_counter(saved[STEP], f"{where}['{STEP}']")
    if step < 1:
        raise CheckpointError(f"{where}['{STEP}']={step} must be >= 1 for a parameter that has state.")
    staged: dict[str, Tensor] = {}
    for key, tspec in spec.items():
        value = saved[key]
        if key in (STEP, PERIOD):
            staged[key] = torch.tensor(step if key == STEP else period, dtype=torch.int64)
            continue
        if key == NORMUON_STEP:
            count = _int_counter(value, f"{where}['{key}']")
            if not 0 <= count <= step:
                raise CheckpointError(f"{where}['{key}']={count} must be in [0, step={step}].")
            staged[key] = torch.tensor(count, dtype=torch.int64)
            continue
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{where}['{key}'] must be a tensor, got {type(value).__name__}.")
        if value.dtype != tspec.dtype or tuple(value.shape) != tspec.shape:
            raise CheckpointError(
                f"{where}['{key}'] has dtype {value.dtype} and shape {tuple(value.shape)}, expected "
                f"{tspec.dtype} and {tspec.shape} (was the state cast or reshaped by another loader?)."
            )
        if tspec.non_negative and value.numel() and not bool(((value >= 0) & torch.isfinite(value)).all()):
            raise CheckpointError(f"{where}['{key}'] has negative or non-finite values.")
        if key == FIRST_MOMENT_CODES and value.numel() and int(value.max()) > 255:
            raise CheckpointError(f"{where}['{key}'] has an index above 255.")
        staged[key] = value.detach().to(device=param.device).clone()
    return staged


def stage_load(
    state_dict: object,
    *,
    optimizer_kind: str,
    live_groups: list[dict[str, Any]],
    second_moment_kind: Callable[[Tensor, Mapping[str, Any]], SecondMomentKind],
    codebook_device: torch.device,
) -> StagedLoad:
    """Validate ``state_dict`` against the live param groups and build the state to publish.

    Args:
        state_dict: the untrusted dict (never modified).
        optimizer_kind: class name the checkpoint must have been saved by.
        live_groups: the optimizer's current ``param_groups``.
        second_moment_kind: ``(param, group) -> "block" | "factored"``; called with the *saved* group's
            hyperparameters, which replace the live ones on load (torch semantics).
        codebook_device: where the restored codebook lives.

    Returns:
        :class:`StagedLoad`.

    Raises:
        CheckpointError: anything that does not fit: wrong layout, optimizer kind, newer schema, group or
            parameter counts, names, shapes, dtypes, periods, counters, invalid hyperparameters, quantized
            state without a codebook.
    """
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), list)
    ):
        raise CheckpointError("a state dict must be a dict with 'state' (dict) and 'param_groups' (list).")
    codebook, global_step = _read_metadata(state_dict, optimizer_kind)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved_groups)} param groups, this optimizer has {len(live_groups)}."
        )
    index_to_param: dict[int, tuple[Tensor, Mapping[str, Any], str]] = {}
    new_groups: list[dict[str, Any]] = []
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        where = f"checkpoint param_groups[{g}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
            raise CheckpointError(f"{where} must be a dict with a 'params' list.")
        if len(saved["params"]) != len(live["params"]):
            raise CheckpointError(
                f"{where} has {len(saved['params'])} parameters, the live group has {len(live['params'])}."
            )
        check_group(saved, where, CheckpointError)
        saved_names, live_names = saved.get("param_names"), live.get("param_names")
        if saved_names is not None and live_names is not None and list(saved_names) != list(live_names):
            diff = (
                next((a, b) for a, b in zip(saved_names, live_names) if a != b)
                if len(saved_names) == len(live_names)
                else (len(saved_names), len(live_names))
            )
            raise CheckpointError(f"{where} parameter names differ from the live ones (first difference: {diff}).")
        for i, (pid, param) in enumerate(zip(saved["params"], live["params"])):
            if not isinstance(pid, int) or isinstance(pid, bool) or pid in index_to_param:
                raise CheckpointError(f"{where}['params'][{i}]={pid!r} is not a unique integer index.")
            name = live_names[i] if live_names is not None else f"param_groups[{g}][{i}]"
            index_to_param[pid] = (param, saved, name)
        group = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in saved.items()}
        group["params"] = live["params"]
        if live_names is not None:
            group["param_names"] = live_names
        new_groups.append(group)

    new_state: dict[Tensor, dict[str, Tensor]] = {}
    for pid, saved_state in state_dict["state"].items():
        if pid not in index_to_param:
            raise CheckpointError(f"checkpoint state has an entry for parameter index {pid!r}, which no group lists.")
        param, group, name = index_to_param[pid]
        where = f"checkpoint state[{pid}] ({name})"
        new_state[param] = _stage_param_state(saved_state, param, second_moment_kind(param, group), where)
    if new_state and codebook is None:
        raise CheckpointError(
            "checkpoint has quantized first moments but no codebook; the uint8 codes cannot be read without it. "
            "Resume from the unmodified dict returned by state_dict()."
        )
    if codebook is not None:
        codebook = codebook.detach().to(codebook_device).clone()
    return StagedLoad(new_state, new_groups, codebook, global_step)
