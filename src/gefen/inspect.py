"""Offline inspection of a saved optimizer state dict: validation without live parameters, and a summary.

A checkpoint is normally validated by ``load_state_dict`` against the live parameters. This module runs the same
checks of :mod:`gefen.checkpoint` (:func:`~gefen.checkpoint.read_metadata`,
:func:`~gefen.checkpoint.stage_param_state`) and :mod:`gefen.hyperparams` (:func:`~gefen.hyperparams.check_group`)
on a dict alone, taking each parameter's shape from its saved state (:func:`infer_param_shape`), and collects
every problem instead of stopping at the first one. It owns only what the absence of live parameters adds: shape
and second-moment-kind inference, the group index bookkeeping, and the accounting (periods, kinds, bytes).

What it cannot check offline: that the parameters have the inferred shapes (a block or momentum state only
reveals its element count), that the group and parameter counts and names match a model, and the live
``deterministic`` policy. A checkpoint with no problem here loads into an optimizer over matching parameters.

Layouts understood (see :mod:`gefen.checkpoint` and :class:`gefen.GefenMuonHybrid`)::

    Gefen / GefenMuon:  {"state": {...}, "param_groups": [...], "gefen": {...}}   (or the group mirrors only)
    GefenMuonHybrid:    {"state": {...}, "param_groups": [... each with "hybrid_half" ...], "gefen_hybrid": {...}}
                        (see :mod:`gefen.checkpoint_hybrid`), or the gefen 0.1 layout
                        {"muon": <GefenMuon dict or None>, "backup": <Gefen or torch AdamW dict or None>,
                         "backup_optimizer": "gefen" | "adamw"}
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from gefen.checkpoint import (
    GROUP_METADATA_KEY,
    HYBRID_KEYS,
    METADATA_KEY,
    Metadata,
    check_hybrid_layout,
    is_placeholder,
    read_metadata,
    stage_param_state,
)
from gefen.checkpoint_hybrid import is_hybrid_state_dict, split_hybrid_state_dict
from gefen.errors import CheckpointError
from gefen.hyperparams import check_group
from gefen.state import (
    FIRST_MOMENT_CODES,
    NORMUON_V,
    PERIOD,
    SECOND_MOMENT,
    SECOND_MOMENT_COL,
    SECOND_MOMENT_ROW,
    SecondMomentKind,
    second_moment_kind,
    state_bytes,
    tensor_bytes,
)

__all__ = [
    "HalfReport",
    "CheckpointReport",
    "optimizer_kind",
    "infer_param_shape",
    "inspect_gefen_state_dict",
    "inspect_torch_state_dict",
    "inspect_state_dict",
]

#: Gefen optimizer kinds this module knows the second-moment rules of.
_GEFEN_KINDS = ("Gefen", "GefenMuon")
#: ``backup_optimizer`` value -> optimizer kind of the backup half.
_BACKUP_KINDS = {"gefen": "Gefen", "adamw": "AdamW"}


@dataclass
class HalfReport:
    """What one optimizer state dict holds (a whole checkpoint, or one half of a hybrid).

    Attributes:
        label: ``"optimizer"`` for a plain checkpoint, ``"muon"`` or ``"backup"`` for a hybrid half.
        optimizer: the kind it must load into: ``"Gefen"``, ``"GefenMuon"``, ``"AdamW"``, or the saved name.
        saved_schema_version: the schema version it was written with (int), the raw value when the metadata
            is refused, ``None`` when absent (always ``None`` for AdamW).
        deterministic: the saved policy (bool), ``None`` when untagged (schema 1) or absent, or the raw value
            when refused.
        global_step: number of completed steps (int), or the raw value when refused.
        skipped_steps: steps skipped for NaN/Inf gradients (int; 0 before schema 3), or the raw value when refused.
        n_groups: number of param groups.
        n_params_listed: number of parameter indices listed by the groups.
        n_params_with_state: number of entries in ``state``.
        numel_with_state: total elements of the parameters with state whose shape could be inferred.
        periods: saved block period ``P`` -> number of parameters (Gefen layouts only).
        second_moment_kinds: inferred :data:`gefen.state.SecondMomentKind` -> number of parameters (Gefen layouts
            only). These three describe the state as saved, refused entries included, so ``state_bytes`` and
            ``numel_with_state`` cover the same parameters.
        state_bytes: bytes of every tensor in ``state`` plus the codebook's, in bytes.
        codebook: the saved fp32 (256,) codebook, or whatever tensor stands in its place; ``None`` if none.
        problems: every reason the load would be refused, one message per parameter / group / metadata.
        gefen_layout: ``False`` for a ``torch.optim`` state dict that is only counted (no schema fields).
    """

    label: str
    optimizer: str
    saved_schema_version: Any = None
    deterministic: Any = None
    global_step: Any = None
    skipped_steps: Any = None
    n_groups: int = 0
    n_params_listed: int = 0
    n_params_with_state: int = 0
    numel_with_state: int = 0
    periods: dict[int, int] = field(default_factory=dict)
    second_moment_kinds: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    codebook: Tensor | None = None
    problems: list[str] = field(default_factory=list)
    gefen_layout: bool = True

    @property
    def state_bytes_per_param(self) -> float | None:
        """``state_bytes / numel_with_state`` in bytes per parameter element, ``None`` with no state."""
        return self.state_bytes / self.numel_with_state if self.numel_with_state else None


@dataclass
class CheckpointReport:
    """The inspection of a whole checkpoint.

    Attributes:
        optimizer: ``"Gefen"``, ``"GefenMuon"``, ``"GefenMuonHybrid"``, or ``None`` when it cannot be told.
        backup_optimizer: a hybrid's ``"gefen"`` or ``"adamw"`` (the raw value if unknown); ``None`` otherwise.
        halves: one :class:`HalfReport` per state dict (one, or a hybrid's non-empty halves).
        problems: problems of the top-level layout (not of a half).
        skipped_steps: a hybrid's own count of steps skipped for NaN/Inf gradients (the hybrid skips both halves
            at once; 0 where the checkpoint predates it, the raw value when refused); ``None`` for other
            checkpoints, whose count is their half's.
    """

    optimizer: str | None
    backup_optimizer: Any = None
    skipped_steps: Any = None
    halves: list[HalfReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def all_problems(self) -> list[str]:
        """Top-level problems followed by every half's."""
        return self.problems + [p for half in self.halves for p in half.problems]

    @property
    def state_bytes(self) -> int:
        """Optimizer state of all halves, in bytes."""
        return sum(half.state_bytes for half in self.halves)

    @property
    def numel_with_state(self) -> int:
        """Elements of every parameter with state, over all halves."""
        return sum(half.numel_with_state for half in self.halves)

    @property
    def state_bytes_per_param(self) -> float | None:
        """``state_bytes / numel_with_state`` (bytes per parameter element), ``None`` with no state."""
        return self.state_bytes / self.numel_with_state if self.numel_with_state else None


def _raw_metadata(state_dict: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The top-level metadata entry, else the first group mirror, unvalidated (for the report only)."""
    top = state_dict.get(METADATA_KEY)
    if isinstance(top, Mapping):
        return top
    groups = state_dict.get("param_groups")
    for group in groups if isinstance(groups, list) else []:
        mirror = group.get(GROUP_METADATA_KEY) if isinstance(group, Mapping) else None
        if isinstance(mirror, Mapping):
            return mirror
    return None


def optimizer_kind(state_dict: Mapping[str, Any]) -> str | None:
    """The optimizer class name a Gefen state dict was saved by.

    Args:
        state_dict: a Gefen state dict (never modified).

    Returns:
        ``state_dict["gefen"]["optimizer"]``, else ``state_dict["param_groups"][0]["gefen_metadata"]["optimizer"]``
        (layouts that keep only ``state`` and ``param_groups``); ``None`` when neither is a string.
    """
    top = state_dict.get(METADATA_KEY)
    if isinstance(top, Mapping):
        kind = top.get("optimizer")
    else:
        groups = state_dict.get("param_groups")
        first = groups[0] if isinstance(groups, list) and groups else None
        mirror = first.get(GROUP_METADATA_KEY) if isinstance(first, Mapping) else None
        kind = mirror.get("optimizer") if isinstance(mirror, Mapping) else None
    return kind if isinstance(kind, str) else None


def infer_param_shape(saved: Mapping[str, Any], where: str) -> tuple[tuple[int, ...], SecondMomentKind]:
    """The parameter shape and second-moment kind implied by one saved parameter state.

    ``numel = B * P`` from ``first_moment_codes`` of shape ``(B, P)``. The kind follows the keys:
    ``second_moment_row``/``_col`` -> ``"factored"`` with shape ``(len(row), len(col))``; ``normuon_v`` ->
    ``"momentum_normuon"`` with shape ``(len(normuon_v), numel // len(normuon_v))``; ``second_moment`` ->
    ``"block"``; none of them -> ``"momentum"``; the last two with the 1-D shape ``(numel,)`` (the state does not
    record the real one, and its spec does not depend on it).

    Args:
        saved: the untrusted per-parameter dict (never modified).
        where: prefix for messages, e.g. ``"checkpoint state[3] (fc.weight)"``.

    Returns:
        ``(shape, kind)``: a shape of ``numel`` elements and the kind to validate the state against.

    Raises:
        CheckpointError: no 2-D ``first_moment_codes`` tensor, row/column or ``normuon_v`` statistics that are not
            1-D tensors, or whose lengths do not multiply or divide to ``numel``.
    """
    codes = saved.get(FIRST_MOMENT_CODES)
    if not isinstance(codes, Tensor) or codes.dim() != 2:
        got = f"shape {tuple(codes.shape)}" if isinstance(codes, Tensor) else type(codes).__name__
        raise CheckpointError(
            f"{where}['{FIRST_MOMENT_CODES}'] must be a 2-D (blocks, period) tensor, got {got}; the parameter's "
            f"size cannot be inferred (keys: {sorted(saved)})."
        )
    numel = codes.shape[0] * codes.shape[1]
    if SECOND_MOMENT_ROW in saved or SECOND_MOMENT_COL in saved:
        row, col = saved.get(SECOND_MOMENT_ROW), saved.get(SECOND_MOMENT_COL)
        if not (isinstance(row, Tensor) and isinstance(col, Tensor) and row.dim() == 1 and col.dim() == 1):
            raise CheckpointError(
                f"{where} needs both '{SECOND_MOMENT_ROW}' and '{SECOND_MOMENT_COL}' as 1-D tensors for a factored "
                f"state (keys: {sorted(saved)})."
            )
        shape = (row.shape[0], col.shape[0])
        if shape[0] * shape[1] != numel:
            raise CheckpointError(
                f"{where}: '{SECOND_MOMENT_ROW}' and '{SECOND_MOMENT_COL}' imply shape {shape} "
                f"({shape[0] * shape[1]} elements), but '{FIRST_MOMENT_CODES}' {tuple(codes.shape)} holds {numel}."
            )
        return shape, "factored"
    if NORMUON_V in saved:
        rows_v = saved[NORMUON_V]
        if not isinstance(rows_v, Tensor) or rows_v.dim() != 1:
            got = f"shape {tuple(rows_v.shape)}" if isinstance(rows_v, Tensor) else type(rows_v).__name__
            raise CheckpointError(f"{where}['{NORMUON_V}'] must be a 1-D tensor (one entry per row), got {got}.")
        rows = rows_v.shape[0]
        if rows == 0 or numel % rows != 0:
            raise CheckpointError(
                f"{where}['{NORMUON_V}'] has {rows} rows, which do not divide the {numel} elements of "
                f"'{FIRST_MOMENT_CODES}' {tuple(codes.shape)}."
            )
        return (rows, numel // rows), "momentum_normuon"
    return (numel,), ("block" if SECOND_MOMENT in saved else "momentum")


def _expected_kind(
    optimizer: str, inferred: SecondMomentKind, shape: tuple[int, ...], group: Mapping[str, Any]
) -> SecondMomentKind | None:
    """The kind ``optimizer`` would give this parameter under ``group``'s saved hyperparameters (what
    ``load_state_dict`` validates against), as far as it can be told without the live shape; ``None`` for an
    optimizer kind this module does not know."""
    if optimizer not in ("Gefen", "GefenMuon"):
        return None
    if optimizer == "Gefen" and inferred != "factored":
        # a block state's real shape is unknown: with factored_v_2d it may be a 1-D or thin 2-D parameter
        return "block"
    expected = second_moment_kind(optimizer, shape, group)
    if inferred == "momentum_normuon" and expected == "momentum" and group.get("normuon") is True:
        # a matrix with rows too short for NorMuon (gefen.state.second_moment_kind), saved before NorMuon left such
        # matrices out: the loader drops its NorMuon entries (gefen.checkpoint.stage_param_state)
        return inferred
    return expected


def _group_flags(optimizer: str, group: Mapping[str, Any]) -> str:
    if optimizer == "GefenMuon":
        return f"normuon={group.get('normuon', False)!r}"
    return f"factored_v_2d={group.get('factored_v_2d', True)!r}"


def _plain(value: object) -> Any:
    """A raw metadata value for the report: ints, bools and strings as they are, anything else as its repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        return int(value.item())
    return repr(value)


def _list_group_params(
    state_dict: Mapping[str, Any], where_prefix: str, report: HalfReport, validate: bool
) -> dict[Any, tuple[Mapping[str, Any], str]]:
    """Walk ``param_groups``: record problems of their layout (and hyperparameters when ``validate``), return
    ``param index -> (its group, its name)``."""
    index: dict[Any, tuple[Mapping[str, Any], str]] = {}
    for g, group in enumerate(state_dict["param_groups"]):
        where = f"{where_prefix}param_groups[{g}]"
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
            report.problems.append(f"{where} must be a dict with a 'params' list.")
            continue
        if validate:
            try:
                check_group(group, where, CheckpointError)
            except CheckpointError as error:
                report.problems.append(str(error))
        names = group.get("param_names")
        for i, pid in enumerate(group["params"]):
            if not isinstance(pid, int) or isinstance(pid, bool) or pid in index:
                report.problems.append(f"{where}['params'][{i}]={pid!r} is not a unique integer index.")
                continue
            name = names[i] if isinstance(names, list) and i < len(names) else f"param_groups[{g}][{i}]"
            index[pid] = (group, str(name))
    report.n_params_listed = len(index)
    return index


def _as_state_dict(state_dict: object, where_prefix: str, report: HalfReport) -> Mapping[str, Any] | None:
    """``state_dict`` when it has torch's layout, else ``None`` with the problem recorded."""
    if (
        isinstance(state_dict, Mapping)
        and isinstance(state_dict.get("state"), Mapping)
        and isinstance(state_dict.get("param_groups"), list)
    ):
        return state_dict
    keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
    report.problems.append(
        f"{where_prefix}a state dict must be a dict with 'state' (dict) and 'param_groups' (list); got {keys}."
    )
    return None


def inspect_gefen_state_dict(state_dict: object, optimizer: str | None, label: str = "optimizer") -> HalfReport:
    """Validate a Gefen or GefenMuon state dict without live parameters and summarise it.

    Runs, collecting every failure: :func:`gefen.checkpoint.read_metadata` (metadata copies, schema version and
    migration, optimizer kind, period-search variant, global step, deterministic tag, codebook);
    :func:`gefen.hyperparams.check_group` on every saved group; unique integer parameter indices; for every
    ``state`` entry, that a group lists it, :func:`infer_param_shape`, :func:`gefen.checkpoint.stage_param_state`
    (keys, dtypes, shapes, period, counters, magnitudes) and that its second-moment kind is the one its group's
    ``factored_v_2d`` / ``normuon`` gives; and that state exists only with a codebook.

    Args:
        state_dict: the untrusted dict (never modified).
        optimizer: the kind it must have been saved by (``"Gefen"`` or ``"GefenMuon"``); ``None`` when unknown
            (a problem is recorded and the other checks still run).
        label: the report's label; any label but ``"optimizer"`` prefixes messages with ``"<label> half: "``.

    Returns:
        :class:`HalfReport`; ``problems`` is empty when ``load_state_dict`` would accept the dict for parameters
        of the inferred shapes.
    """
    prefix = "" if label == "optimizer" else f"{label} half: "
    report = HalfReport(label=label, optimizer=optimizer or "unknown")
    sd = _as_state_dict(state_dict, prefix, report)
    if sd is None:
        return report
    if optimizer is None:
        report.problems.append(
            f"{prefix}this is not a Gefen checkpoint: no '{METADATA_KEY}' metadata entry names the optimizer (at "
            f"the top level or in param_groups[0]['{GROUP_METADATA_KEY}']); was it saved by another optimizer?"
        )
        states = [v for v in sd["state"].values() if isinstance(v, Mapping)]
        if states and not any(FIRST_MOMENT_CODES in v for v in states):
            # no quantized first moment anywhere: another optimizer's state (e.g. AdamW's exp_avg), not a damaged
            # Gefen one, so one problem says it all
            other = inspect_torch_state_dict(sd, "unknown", label)
            other.problems[:0] = [f"{report.problems[0]} Its parameter state has keys {sorted(map(str, states[0]))}."]
            return other
    elif optimizer not in _GEFEN_KINDS:
        report.problems.append(f"{prefix}unknown optimizer kind {optimizer!r}; expected one of {_GEFEN_KINDS}.")
    meta: Metadata | None = None
    try:
        meta = read_metadata(sd, optimizer or "Gefen")
    except CheckpointError as error:
        if optimizer is not None:  # an unnamed optimizer has its problem already
            report.problems.append(f"{prefix}{error}")
    raw = _raw_metadata(sd) or {}
    if meta is not None:
        report.saved_schema_version = meta.saved_version
        report.deterministic = meta.deterministic
        report.global_step = meta.global_step
        report.skipped_steps = meta.skipped_steps
        report.codebook = meta.codebook
    else:
        report.saved_schema_version = _plain(raw.get("schema_version"))
        report.deterministic = _plain(raw.get("deterministic"))
        report.global_step = _plain(raw.get("global_step"))
        report.skipped_steps = _plain(raw.get("skipped_steps"))
        codebook = raw.get("codebook")
        report.codebook = codebook if isinstance(codebook, Tensor) else None

    report.n_groups = len(sd["param_groups"])
    index = _list_group_params(sd, f"{prefix}checkpoint ", report, validate=True)
    periods: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    for pid, saved in sd["state"].items():
        if is_placeholder(saved) and pid in index:  # zero counters: the parameter has no state yet
            continue
        report.n_params_with_state += 1
        group, name = index.get(pid, (None, "listed by no group"))
        where = f"checkpoint state[{pid}] ({name})"
        try:
            if not isinstance(saved, Mapping):
                raise CheckpointError(f"{where} must be a dict of tensors, got {type(saved).__name__}.")
            report.state_bytes += state_bytes(dict(saved))
            # accounting describes the state as saved (also a refused one), so bytes/param stays meaningful
            shape, kind = infer_param_shape(saved, where)
            report.numel_with_state += math.prod(shape)
            kinds[kind] += 1
            period = _plain(saved.get(PERIOD))
            if isinstance(period, int) and not isinstance(period, bool):
                periods[period] += 1
            if group is None:
                raise CheckpointError(
                    f"checkpoint state has an entry for parameter index {pid!r}, which no group lists."
                )
            stage_param_state(saved, shape, kind, where)
            expected = _expected_kind(report.optimizer, kind, shape, group)
            if expected is not None and expected != kind:
                raise CheckpointError(
                    f"{where} holds a {kind} state (keys {sorted(saved)}), but {report.optimizer} with its group's "
                    f"{_group_flags(report.optimizer, group)} keeps a {expected} state for it; the group's "
                    "hyperparameters were edited or the state comes from another configuration."
                )
        except CheckpointError as error:
            report.problems.append(f"{prefix}{error}")
    if report.codebook is not None:
        report.state_bytes += tensor_bytes(report.codebook)
    elif report.n_params_with_state and meta is not None:
        report.problems.append(
            f"{prefix}checkpoint has quantized first moments but no frozen codebook (neither at the top level nor "
            "in the param groups' metadata); the uint8 codes cannot be read without it."
        )
    report.periods = dict(sorted(periods.items()))
    report.second_moment_kinds = dict(sorted(kinds.items()))
    return report


def inspect_torch_state_dict(state_dict: object, optimizer: str, label: str) -> HalfReport:
    """Summarise a ``torch.optim`` state dict (the AdamW backup of a hybrid): layout, counts and bytes only.

    Args:
        state_dict: the dict (never modified).
        optimizer: its class name for the report, e.g. ``"AdamW"``.
        label: the report's label (``"backup"``); any label but ``"optimizer"`` prefixes messages with
            ``"<label> half: "``.

    Returns:
        :class:`HalfReport` with counts, ``numel_with_state`` (elements of each state's largest tensor, i.e.
        ``exp_avg``) and ``state_bytes`` (every tensor in ``state``, ``step`` counters included, in bytes); its
        only problems are layout ones (torch validates the rest when it loads).
    """
    prefix = "" if label == "optimizer" else f"{label} half: "
    report = HalfReport(label=label, optimizer=optimizer, gefen_layout=False)
    sd = _as_state_dict(state_dict, prefix, report)
    if sd is None:
        return report
    report.n_groups = len(sd["param_groups"])
    _list_group_params(sd, f"{prefix}checkpoint ", report, validate=False)
    for saved in sd["state"].values():
        report.n_params_with_state += 1
        if isinstance(saved, Mapping):
            tensors = [v for v in saved.values() if isinstance(v, Tensor)]
            report.state_bytes += sum(tensor_bytes(t) for t in tensors)
            report.numel_with_state += max((t.numel() for t in tensors), default=0)
    return report


def inspect_state_dict(state_dict: object) -> CheckpointReport:
    """Inspect a whole checkpoint: a Gefen / GefenMuon state dict or a GefenMuonHybrid one.

    A hybrid checkpoint (torch's layout with ``hybrid_half`` groups, or the gefen 0.1 layout with the keys
    ``muon``, ``backup``, ``backup_optimizer``) is taken apart by
    :func:`gefen.checkpoint_hybrid.split_hybrid_state_dict`; the Muon half must be a ``"GefenMuon"`` state dict
    and a Gefen backup a ``"Gefen"`` one (each checked by :func:`inspect_gefen_state_dict`); an AdamW backup is
    only summarised (:func:`inspect_torch_state_dict`).

    Args:
        state_dict: what ``torch.load`` returned (never modified).

    Returns:
        :class:`CheckpointReport`; ``all_problems`` is empty when the checkpoint would load into an optimizer
        over parameters of the inferred shapes.
    """
    if not isinstance(state_dict, Mapping):
        return CheckpointReport(
            optimizer=None,
            problems=[f"a checkpoint must be a dict (an optimizer's state_dict()), got {type(state_dict).__name__}."],
        )
    if not is_hybrid_state_dict(state_dict):
        kind = optimizer_kind(state_dict) if isinstance(state_dict.get("param_groups"), list) else None
        return CheckpointReport(optimizer=kind, halves=[inspect_gefen_state_dict(state_dict, kind)])
    if HYBRID_KEYS.intersection(state_dict):  # the gefen 0.1 layout: report what each half holds, even if damaged
        halves: Mapping[str, Any] = state_dict
        report = CheckpointReport("GefenMuonHybrid", backup_optimizer=_plain(state_dict.get("backup_optimizer")))
        try:
            report.skipped_steps = check_hybrid_layout(state_dict)
        except CheckpointError as exc:
            report.problems.append(str(exc))
            report.skipped_steps = _plain(state_dict.get("skipped_steps"))
    else:
        report = CheckpointReport("GefenMuonHybrid")
        try:
            split = split_hybrid_state_dict(state_dict)
        except CheckpointError as exc:
            report.problems.append(str(exc))
            return report
        halves = {"muon": split.muon, "backup": split.backup, "backup_optimizer": split.backup_optimizer}
        report.backup_optimizer, report.skipped_steps = split.backup_optimizer, split.skipped_steps
    backup_name = halves.get("backup_optimizer")
    backup_kind = _BACKUP_KINDS.get(backup_name) if isinstance(backup_name, str) else None
    if halves.get("muon") is not None:
        report.halves.append(inspect_gefen_state_dict(halves["muon"], "GefenMuon", "muon"))
    backup = halves.get("backup")
    if backup is not None and backup_kind == "AdamW":
        report.halves.append(inspect_torch_state_dict(backup, "AdamW", "backup"))
    elif backup is not None and backup_kind == "Gefen":
        report.halves.append(inspect_gefen_state_dict(backup, "Gefen", "backup"))
    return report
