"""Checkpoint schema of Gefen optimizers: the only code that writes the metadata and validates an untrusted
state dict.

``state_dict()`` of a Gefen optimizer is torch's layout plus one metadata entry, mirrored into every param group::

    {"state": {i: {<keys of gefen.state>}},
     "param_groups": [{..., "gefen_metadata": <the same dict>}, ...],
     "gefen": {"schema_version": 3, "optimizer": "Gefen", "period_search": "<variant>",
               "codebook": fp32 (256,) tensor (absent before the first step), "global_step": int,
               "deterministic": bool, "skipped_steps": int, "stateful_params": int}}

A parameter without state yet (before its first gradient) is saved as zero counters ``{"step": 0, "period": 0}``:
``torch.distributed.checkpoint``'s full-state load can only merge 0-dim entries the live dict already has.

The mirror exists because tools such as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keep
only ``state`` and ``param_groups``: without it the codebook would be lost and the uint8 codes unreadable. Every
*live* param group holds the key with the stand-in value ``None`` (:data:`LIVE_GROUP_CARRIERS`): DCP's flattened
layout (``flatten_optimizer_state_dict=True``, torchtitan's default) rebuilds the saved groups from the keys of the
live ones, so a key the live groups lacked would be dropped on load. The loader never publishes the saved mirror.
The same rebuild keeps only the per-parameter state keys the live optimizer holds, standing in ``{}`` for the
others; :func:`stage_load` drops those stand-ins and refuses an entry left empty (see
:mod:`gefen.checkpoint_interop`).

Everything in it is a tensor, a number, a string, a list or a dict, so ``torch.load(weights_only=True)`` reads it.

Loading is staged: :func:`stage_load` reconciles the metadata copies, migrates older schemas explicitly
(:data:`MIGRATIONS`), validates the whole dict against the live parameters and the spec of :mod:`gefen.state`,
and builds brand-new state tensors (saved dtypes kept, placed on each parameter's device — unlike
``torch.optim.Optimizer.load_state_dict``, which would cast uint8 codes and fp32 moments to a bf16 parameter's
dtype). The optimizer then publishes the staged result with plain assignments, so a refused load leaves it
bit-identical and never touches the caller's dict.

Schema history:

* 1 — top-level ``"gefen"`` entry only; no ``deterministic`` tag.
* 2 — adds ``deterministic`` and the per-group mirror. A v1 checkpoint migrates with an untagged policy (it loads
  under the live one).
* 3 — adds ``skipped_steps`` (steps skipped for NaN/Inf gradients under ``nonfinite="skip"``); a v2 checkpoint
  migrates with 0.
* 4 — adds ``stateful_params`` (how many parameters hold state), which tells a flattened DCP load whose rebuild
  dropped state from one that had none to drop; a v3 checkpoint migrates with ``None`` (unknown).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.checkpoint_interop import check_codebook_provenance, check_flattened_loss, drop_flattened_stand_ins
from gefen.checkpoint_params import int_counter as _int_counter
from gefen.checkpoint_params import is_placeholder, stage_param_state
from gefen.errors import CheckpointError
from gefen.hyperparams import check_group
from gefen.math.codebook import validate_codebook
from gefen.math.period import PERIOD_SEARCH_VARIANT
from gefen.sharding import (
    RowShard,
    is_dtensor,
)
from gefen.state import (
    SecondMomentKind,
)

__all__ = [
    "SCHEMA_VERSION",
    "METADATA_KEY",
    "GROUP_METADATA_KEY",
    "LIVE_GROUP_CARRIERS",
    "MIGRATIONS",
    "Metadata",
    "build_metadata",
    "attach_metadata",
    "read_metadata",
    "is_placeholder",
    "stage_param_state",
    "HYBRID_KEYS",
    "HYBRID_BACKENDS",
    "check_hybrid_layout",
    "StagedLoad",
    "stage_load",
]

#: Version of the layout above. Bump it (and add a migration to :data:`MIGRATIONS`) whenever the layout changes.
SCHEMA_VERSION = 4
#: Top-level key of the metadata entry.
METADATA_KEY = "gefen"
#: Key of the metadata mirror inside every saved param group.
GROUP_METADATA_KEY = "gefen_metadata"
#: Group keys every live param group holds with a fixed stand-in value, never a saved one (see the module
#: docstring): ``key -> live value``.
LIVE_GROUP_CARRIERS: dict[str, Any] = {GROUP_METADATA_KEY: None}


def build_metadata(
    optimizer_kind: str,
    codebook: Tensor | None,
    global_step: int,
    deterministic: bool,
    skipped_steps: int = 0,
    stateful_params: int = 0,
) -> dict[str, Any]:
    """The metadata entry written next to ``state`` and ``param_groups``.

    Args:
        optimizer_kind: class name, e.g. ``"Gefen"``.
        codebook: fp32 (256,) codebook, or ``None`` before the first step.
        global_step: number of completed ``step()`` calls that updated anything.
        deterministic: the optimizer's ``deterministic`` policy.
        skipped_steps: number of ``step()`` calls skipped for NaN/Inf gradients (``nonfinite="skip"``).
        stateful_params: number of parameters holding state (this rank's, for a sharded optimizer).

    Returns:
        A dict of plain values (the codebook is cloned so later steps cannot change a saved dict).
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "optimizer": optimizer_kind,
        "period_search": PERIOD_SEARCH_VARIANT,
        "codebook": None if codebook is None else codebook.detach().clone(),
        "global_step": int(global_step),
        "deterministic": bool(deterministic),
        "skipped_steps": int(skipped_steps),
        "stateful_params": int(stateful_params),
    }


def attach_metadata(state_dict: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Put ``metadata`` at the top level and (the same object) into every saved param group, in place.

    ``state_dict["param_groups"]`` must hold the dicts packed by ``torch.optim.Optimizer.state_dict`` (fresh
    dicts, not the live groups).
    """
    state_dict[METADATA_KEY] = metadata
    for group in state_dict["param_groups"]:
        group[GROUP_METADATA_KEY] = metadata


def _migrate_v1_to_v2(meta: dict[str, Any]) -> dict[str, Any]:
    """v1 had no ``deterministic`` tag: the checkpoint is untagged and loads under the live policy."""
    return {**meta, "schema_version": 2, "deterministic": None}


def _migrate_v2_to_v3(meta: dict[str, Any]) -> dict[str, Any]:
    """v2 had no ``skipped_steps``: nothing was ever skipped for NaN/Inf gradients."""
    return {**meta, "schema_version": 3, "skipped_steps": 0}


def _migrate_v3_to_v4(meta: dict[str, Any]) -> dict[str, Any]:
    """v3 did not count the parameters holding state: unknown."""
    return {**meta, "schema_version": 4, "stateful_params": None}


#: ``version -> function`` taking a metadata dict of that version to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _migrate_v1_to_v2,
    2: _migrate_v2_to_v3,
    3: _migrate_v3_to_v4,
}


@dataclass(frozen=True)
class Metadata:
    """Validated, migrated checkpoint metadata.

    Attributes:
        saved_version: the schema version the checkpoint was written with.
        optimizer: optimizer class name.
        codebook: fp32 (256,) tensor or ``None``.
        global_step: ``>= 0``.
        deterministic: the saved policy, or ``None`` for an untagged (v1) checkpoint.
        skipped_steps: ``>= 0``, steps skipped for NaN/Inf gradients (0 for checkpoints before schema 3).
        stateful_params: ``>= 0``, parameters holding state, ``None`` for checkpoints before schema 4.
        assembled: the dict held the loading optimizer's own metadata copies too, overruled by the checkpoint's
            (a load pre-hook built it from the live ``state_dict()``; see :func:`read_metadata`).
    """

    saved_version: int
    optimizer: str
    codebook: Tensor | None
    global_step: int
    deterministic: bool | None
    skipped_steps: int = 0
    assembled: bool = False
    stateful_params: int | None = None


def _same_metadata(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a is b:
        return True
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.cpu(), y.cpu()):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def recipe_shape(top: object, mirrors: list[Any], live: Mapping[str, Any] | None) -> bool:
    """Whether metadata copies that disagree have the shape torch's ``register_load_state_dict_pre_hook`` recipe
    gives them: the live optimizer's own entry (``live``) at the top level, the checkpoint's (all equal) in every
    group's mirror. Then the mirrors win (Gefen's ``gefen`` entry and the hybrid's ``gefen_hybrid`` alike)."""
    return (
        live is not None
        and isinstance(top, Mapping)
        and bool(mirrors)
        and all(isinstance(m, Mapping) for m in mirrors)
        and _same_metadata(top, live)
        and all(_same_metadata(m, mirrors[0]) for m in mirrors)
    )


def _find_metadata(
    state_dict: Mapping[str, Any], optimizer_kind: str, live: Mapping[str, Any] | None = None
) -> tuple[Mapping[str, Any], bool]:
    """The one metadata dict of a checkpoint: the top-level entry and/or the group mirrors, which must agree.

    A dict assembled from two sources (torch's documented ``register_load_state_dict_pre_hook`` recipe starts
    from the live optimizer's ``state_dict()`` and copies the saved groups' keys, mirror included, and the saved
    per-parameter state) holds two metadata dicts: the live optimizer's own (``live``) at the top level and the
    checkpoint's in every group's mirror. Then the mirrors win; any other disagreement is refused.

    Returns:
        ``(metadata, assembled)``; ``assembled`` tells that the live optimizer's own copies were overruled.
    """
    top = state_dict.get(METADATA_KEY)
    groups = state_dict["param_groups"]
    mirrors = [g.get(GROUP_METADATA_KEY) if isinstance(g, Mapping) else None for g in groups]
    present = [m for m in mirrors if m is not None]
    if present and len(present) != len(mirrors):
        raise CheckpointError(
            f"inconsistent optimizer metadata: '{GROUP_METADATA_KEY}' is present on only some parameter groups "
            f"({len(present)} of {len(mirrors)}); the checkpoint was edited or assembled from different saves."
        )
    for i, mirror in enumerate(present):
        if not isinstance(mirror, Mapping):
            raise CheckpointError(f"param_groups[{i}]['{GROUP_METADATA_KEY}'] must be a dict.")
    if top is not None and not isinstance(top, Mapping):
        raise CheckpointError(f"checkpoint '{METADATA_KEY}' entry must be a dict, got {type(top).__name__}.")
    copies = ([top] if top is not None else []) + present
    if not copies:
        raise CheckpointError(
            f"this is not a {optimizer_kind} checkpoint: the '{METADATA_KEY}' metadata entry is missing at the top "
            f"level and in the param groups (was it saved by another optimizer?); load the dict returned by "
            f"{optimizer_kind}.state_dict()."
        )
    if all(_same_metadata(m, copies[0]) for m in copies):
        return copies[0], False
    if recipe_shape(top, present, live):
        return present[0], True
    for i, mirror in enumerate(present):
        if not _same_metadata(mirror, present[0]):
            raise CheckpointError(
                f"inconsistent optimizer metadata: param_groups[{i}]['{GROUP_METADATA_KEY}'] differs from "
                "param_groups[0]'s (global step, codebook or policy); the checkpoint was edited."
            )
    raise CheckpointError(
        f"inconsistent optimizer metadata: the top-level '{METADATA_KEY}' entry and the param groups' "
        f"'{GROUP_METADATA_KEY}' copies differ (global step, codebook or policy); the checkpoint was edited."
    )


def read_metadata(
    state_dict: Mapping[str, Any], optimizer_kind: str, live: Mapping[str, Any] | None = None
) -> Metadata:
    """Find, reconcile, migrate and validate a checkpoint's metadata.

    Args:
        state_dict: a dict with ``param_groups`` (a list); never modified.
        optimizer_kind: the class name the checkpoint must have been saved by.
        live: the loading optimizer's own metadata (as its ``state_dict()`` writes it), to tell its copies from
            the checkpoint's in a dict assembled by a load pre-hook; ``None``: all copies must agree.

    Returns:
        :class:`Metadata` at :data:`SCHEMA_VERSION`.

    Raises:
        CheckpointError: missing or inconsistent copies, a newer or invalid schema version, another optimizer
            kind or period-search variant, a bad global step, deterministic tag or codebook.
    """
    found, assembled = _find_metadata(state_dict, optimizer_kind, live)
    meta = dict(found)
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"checkpoint schema_version={version!r} is not a positive integer.")
    if version > SCHEMA_VERSION:
        raise CheckpointError(
            f"checkpoint schema_version={version} is newer than this gefen supports ({SCHEMA_VERSION}); "
            "upgrade gefen to load it."
        )
    saved_version = version
    while version < SCHEMA_VERSION:
        meta = MIGRATIONS[version](meta)
        version = meta["schema_version"]
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
    deterministic = meta.get("deterministic")
    if saved_version >= 2 and not isinstance(deterministic, bool):
        raise CheckpointError(
            f"checkpoint deterministic policy must be a bool, got {deterministic!r}; the checkpoint was edited."
        )
    codebook = meta.get("codebook")
    if codebook is not None:
        reason = validate_codebook(codebook)
        if reason is not None:
            raise CheckpointError(f"checkpoint codebook is invalid: {reason}.")
    skipped = _int_counter(meta.get("skipped_steps"), "checkpoint skipped_steps")
    if skipped < 0:
        raise CheckpointError(f"checkpoint skipped_steps={skipped} must be >= 0.")
    stateful = meta.get("stateful_params")
    if stateful is not None:
        stateful = _int_counter(stateful, "checkpoint stateful_params")
        if stateful < 0:
            raise CheckpointError(f"checkpoint stateful_params={stateful} must be >= 0.")
    return Metadata(saved_version, kind, codebook, global_step, deterministic, skipped, assembled, stateful)


@dataclass
class StagedLoad:
    """A fully validated load, ready to publish.

    Attributes:
        state: live parameter -> fresh state dict (tensors owned by nobody else); keys that are not parameters
            (torch's ``state`` takes any key) map to a deep copy of their saved value.
        param_groups: new group dicts (saved hyperparameters, live ``params``, the live stand-ins of
            :data:`LIVE_GROUP_CARRIERS`).
        codebook: fp32 (256,) on the codebook device, or ``None``.
        global_step: restored global step.
        metadata: the validated metadata (schema version it was saved with, policy).
    """

    state: dict[Any, Any]
    param_groups: list[dict[str, Any]]
    codebook: Tensor | None
    global_step: int
    metadata: Metadata


#: Group keys that describe the live process, not the run: absent from a saved group is fine.
_LIVE_ONLY_GROUP_KEYS = frozenset({"params", "param_names", "fused", "backend"})
#: Group options added after checkpoints existed: a checkpoint without one keeps the live value.
_ADDED_GROUP_KEYS = frozenset({"sharded_mode", "ns_coefficients"})

#: Keys of a :class:`gefen.GefenMuonHybrid` state dict (``"deterministic"`` since gefen 0.x schema 2 of the
#: children; older hybrid checkpoints lack it and load under the live policy).
HYBRID_KEYS = frozenset({"muon", "backup", "backup_optimizer"})
HYBRID_POLICY_KEY = "deterministic"
#: Steps the hybrid skipped for NaN/Inf gradients (optional: older hybrid checkpoints lack it, meaning 0).
HYBRID_SKIPPED_KEY = "skipped_steps"
#: Accepted ``backup_optimizer`` tags.
HYBRID_BACKENDS = ("gefen", "adamw")


def check_hybrid_layout(state_dict: object, backend: str | None = None, deterministic: bool | None = None) -> int:
    """Validate the top level of a hybrid checkpoint (the halves are validated by their children).

    Args:
        state_dict: the untrusted dict.
        backend: the live hybrid's ``backup_optimizer`` (``None``: not compared, e.g. offline inspection).
        deterministic: the live hybrid's policy (``None``: not compared).

    Returns:
        The checkpoint's ``skipped_steps`` (0 where it predates the key).

    Raises:
        CheckpointError: not ``{"muon", "backup", "backup_optimizer"[, "deterministic", "skipped_steps"]}``, an
            unknown or other backend, a non-bool or other policy tag, a bad skipped-step count, both halves empty.
    """
    optional = {HYBRID_POLICY_KEY, HYBRID_SKIPPED_KEY}
    if not isinstance(state_dict, Mapping) or not (HYBRID_KEYS <= set(state_dict) <= HYBRID_KEYS | optional):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise CheckpointError(
            f"not a GefenMuonHybrid checkpoint (keys {keys}); expected 'muon', 'backup', 'backup_optimizer' "
            "(and 'deterministic')."
        )
    tag = state_dict["backup_optimizer"]
    if tag not in HYBRID_BACKENDS:
        raise CheckpointError(f"hybrid backup_optimizer={tag!r} must be one of {list(HYBRID_BACKENDS)}.")
    if backend is not None and tag != backend:
        raise CheckpointError(
            f"checkpoint's backup optimizer is {tag!r}, this hybrid's {backend!r}; build the hybrid with "
            f"backup_optimizer={tag!r}."
        )
    if state_dict["muon"] is None and state_dict["backup"] is None:
        raise CheckpointError("both halves of the hybrid checkpoint are empty (muon and backup are None).")
    policy = state_dict.get(HYBRID_POLICY_KEY)
    if HYBRID_POLICY_KEY in state_dict and not isinstance(policy, bool):
        raise CheckpointError(f"hybrid deterministic policy must be a bool, got {policy!r}; the checkpoint was edited.")
    if deterministic is not None and isinstance(policy, bool):
        _check_policy(policy, deterministic)
    skipped = _int_counter(state_dict.get(HYBRID_SKIPPED_KEY, 0), f"hybrid {HYBRID_SKIPPED_KEY}")
    if skipped < 0:
        raise CheckpointError(f"hybrid {HYBRID_SKIPPED_KEY}={skipped} must be >= 0.")
    return skipped


def _check_policy(saved: bool | None, live: bool) -> None:
    if saved is None or saved == live:
        return
    raise CheckpointError(
        f"checkpoint was saved with deterministic={saved}, this optimizer has deterministic={live}: resuming "
        "would change the run's reproducibility policy half-way, which requires an intentional state migration "
        f"or a fresh optimizer restart. Build the optimizer with deterministic={saved} to resume this run."
    )


def stage_load(
    state_dict: object,
    *,
    optimizer_kind: str,
    live_groups: list[dict[str, Any]],
    second_moment_kind: Callable[[Tensor, Mapping[str, Any]], SecondMomentKind],
    codebook_device: torch.device,
    deterministic: bool = False,
    capturable: bool = False,
    group_validator: Callable[[Mapping[str, Any], int], None] | None = None,
    shard_of: Callable[[Tensor], RowShard | None] | None = None,
    hyperparameters: Collection[str] | None = None,
    live_metadata: Mapping[str, Any] | None = None,
    live_state: Mapping[Any, Any] | None = None,
) -> StagedLoad:
    """Validate ``state_dict`` against the live param groups and build the state to publish.

    Args:
        state_dict: the untrusted dict (never modified).
        optimizer_kind: class name the checkpoint must have been saved by.
        live_groups: the optimizer's current ``param_groups``.
        second_moment_kind: ``(param, group) -> "block" | "factored"``; called with the *saved* group's
            hyperparameters, which replace the live ones on load (torch semantics).
        codebook_device: where the restored codebook lives.
        deterministic: the live optimizer's policy; a checkpoint tagged with the other one is refused.
        capturable: put the step counters on each parameter's device (``capturable=True``) instead of the CPU.
        group_validator: the optimizer's own per-group check ``(group, index)`` (e.g. GefenMuon's momentum,
            Newton–Schulz and NorMuon options), run on every saved group; its ``ValueError`` becomes a
            :class:`CheckpointError`.
        shard_of: ``param -> RowShard | None`` for sharded (DTensor) parameters (see :func:`stage_param_state`).
        hyperparameters: the optimizer's own group keys (its ``defaults``); a saved group must have each of them
            (except those added after checkpoints existed, which keep the live value). Keys the live groups hold
            beyond these (an LR scheduler's ``initial_lr``, a user's tag) are not required and keep their live
            value where the checkpoint lacks them; where both have a key, the saved value wins (torch semantics).
            ``None``: every live key is required.
        live_metadata, live_state: the loading optimizer's own metadata (as its ``state_dict()`` writes it) and
            its ``state``, for a dict a load pre-hook assembled from the live ``state_dict()`` and a checkpoint
            (see :func:`read_metadata`): the checkpoint's metadata wins; and a parameter whose state is still the
            live optimizer's (codes quantized against another codebook than the one loaded) is refused.

    Returns:
        :class:`StagedLoad`.

    Raises:
        CheckpointError: anything that does not fit: wrong layout, optimizer kind, newer schema, inconsistent
            metadata copies, another deterministic policy, group or parameter counts, names, shapes, dtypes,
            periods, counters, invalid hyperparameters, quantized state without a codebook.
    """
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), list)
    ):
        raise CheckpointError("a state dict must be a dict with 'state' (dict) and 'param_groups' (list).")
    meta = read_metadata(state_dict, optimizer_kind, live_metadata)
    _check_policy(meta.deterministic, deterministic)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved_groups)} param groups, this optimizer has {len(live_groups)} "
            "(different number of parameter groups)."
        )
    index_to_param: dict[int | str, tuple[Tensor, Mapping[str, Any], str]] = {}
    new_groups: list[dict[str, Any]] = []
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        where = f"checkpoint param_groups[{g}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
            raise CheckpointError(f"{where} must be a dict with a 'params' list.")
        if len(saved["params"]) != len(live["params"]):
            raise CheckpointError(
                f"{where} has {len(saved['params'])} parameters, the live group has {len(live['params'])}."
            )
        required = live.keys() if hyperparameters is None else set(hyperparameters) & live.keys()
        missing = sorted(
            k for k in required if k not in saved and k not in _LIVE_ONLY_GROUP_KEYS and k not in _ADDED_GROUP_KEYS
        )
        if missing:
            raise CheckpointError(
                f"{where} lacks the hyperparameters {missing} that this optimizer's groups have; the checkpoint "
                "was edited or written by another optimizer (a schema change would have migrated them)."
            )
        check_group(saved, where, CheckpointError)
        if group_validator is not None:
            try:
                group_validator(saved, g)
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"{where}: {exc}") from None
        saved_names, live_names = saved.get("param_names"), live.get("param_names")
        if saved_names is not None and (
            not isinstance(saved_names, list)
            or len(saved_names) != len(saved["params"])
            or not all(isinstance(n, str) for n in saved_names)
        ):
            raise CheckpointError(f"{where}['param_names'] must be a list of one name (str) per parameter.")
        # names never block a load (torch.optim loads by position; a torch.compile or DDP wrapper prefixes them
        # with "_orig_mod." or "module."): what makes a checkpoint not fit is a count or shape, checked below
        for i, (pid, param) in enumerate(zip(saved["params"], live["params"])):
            # torch.optim saves integer indices; torch.distributed.checkpoint's helpers pass parameter names (FQNs)
            if not isinstance(pid, (int, str)) or isinstance(pid, bool) or pid in index_to_param:
                raise CheckpointError(
                    f"{where}['params'][{i}]={pid!r} is not a unique integer index (or parameter name)."
                )
            name = live_names[i] if live_names is not None else f"param_groups[{g}][{i}]"
            index_to_param[pid] = (param, saved, name)
        group = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in saved.items()}
        group.update(LIVE_GROUP_CARRIERS)
        group["params"] = live["params"]
        for key, value in live.items():  # keys the checkpoint predates or never had (scheduler, user tags)
            if key not in group and key not in ("param_names",):
                group[key] = value
        if live_names is not None:
            group["param_names"] = live_names
        new_groups.append(group)

    new_state: dict[Any, Any] = {}
    emptied: list[str] = []
    for pid, saved_state in state_dict["state"].items():
        if pid not in index_to_param:
            if isinstance(pid, int):
                raise CheckpointError(
                    f"checkpoint state has an entry for parameter index {pid!r}, which no group lists."
                )
            new_state[pid] = copy.deepcopy(saved_state)  # a key that is not a parameter: kept as-is (torch.optim)
            continue
        param, group, name = index_to_param[pid]
        where = f"checkpoint state[{pid}] ({name})"
        saved_state = drop_flattened_stand_ins(saved_state)
        if saved_state is None:  # a whole entry DCP's flattened rebuild left empty: checked below
            emptied.append(f"{where}")
            continue
        if is_placeholder(saved_state):  # the stand-in for "no state yet"
            continue
        new_state[param] = stage_param_state(
            saved_state,
            tuple(param.shape),
            second_moment_kind(param, group),
            where,
            device=(param.to_local() if is_dtensor(param) else param).device,
            counter_device=param.device if capturable else None,
            shard=None if shard_of is None else shard_of(param),
        )
    codebook = meta.codebook
    check_flattened_loss(emptied, sum(isinstance(k, Tensor) for k in new_state), meta.stateful_params, meta.global_step)
    names = {param: (pid, name) for pid, (param, _, name) in index_to_param.items()}
    live_codebook = None if live_metadata is None else live_metadata.get("codebook")
    check_codebook_provenance(new_state, names, codebook, live_codebook, live_state)
    if codebook is None and any(isinstance(k, Tensor) for k in new_state):
        raise CheckpointError(
            "checkpoint has quantized first moments but no frozen codebook (neither at the top level nor in the "
            "param groups' metadata); the uint8 codes cannot be read without it. Resume from the unmodified dict "
            "returned by state_dict()."
        )
    if codebook is not None:
        codebook = codebook.detach().to(codebook_device).clone()
    return StagedLoad(new_state, new_groups, codebook, meta.global_step, meta)
