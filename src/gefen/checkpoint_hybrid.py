"""Checkpoint layout of :class:`gefen.GefenMuonHybrid`: one ``torch.optim`` state dict over both halves.

``GefenMuonHybrid.state_dict()`` is torch's layout, so tools written for ``torch.optim`` (the DCP helpers
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, FSDP's converters, anything that reads
``sd["state"]`` and ``sd["param_groups"]``) take the hybrid itself::

    {"state": {i: <the owning half's per-parameter state>},          # i: position in param_groups order
     "param_groups": [<groups in the hybrid's list order>...],        # each with "hybrid_half": "muon"|"backup",
                                                                      # the half's own "gefen_metadata" mirror
                                                                      # (Gefen halves) and "gefen_hybrid"
     "gefen_hybrid": {"schema_version": 2, "optimizer": "GefenMuonHybrid", "backup_optimizer": "gefen"|"adamw",
                      "deterministic": bool, "skipped_steps": int}}

Parameters are numbered as ``torch.optim.Optimizer.state_dict`` numbers them: by position over the groups in list
order, a parameter listed again (a group repeated in ``param_groups``) keeping its first index; a group has
``param_names`` exactly when its live group has them (a hybrid built from bare tensors writes none).

The ``gefen_hybrid`` entry is mirrored into every group (the DCP helpers keep only ``state`` and
``param_groups``). The live groups (the children's) hold ``hybrid_half`` and a ``None`` stand-in for the mirror,
because DCP's flattened layout rebuilds the saved groups from the live groups' keys (see :mod:`gefen.checkpoint`).
Each half is rebuilt as its own child's state dict (its groups in list order, the states of their parameters, its
metadata mirror) and validated by that child.

Versions: schema 2 writes the groups in the hybrid's list order (``add_param_group`` appends, whichever half owns
the group), so a loader matches them with the live list position by position; schema 1 (gefen before the list
order) wrote every Muon group, then every backup group, whatever order they were added in: it loads half by half
(each half's groups in their saved order), which is the order it was written from. The older "halves" layout
(``{"muon": ..., "backup": ..., "backup_optimizer": ...}``, gefen 0.1) migrates explicitly in
:func:`split_hybrid_state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gefen.checkpoint import (
    HYBRID_BACKENDS,
    HYBRID_KEYS,
    _check_policy,
    _int_counter,
    _same_metadata,
    check_hybrid_layout,
    recipe_shape,
)
from gefen.errors import CheckpointError
from gefen.hyperparams import check_group

__all__ = [
    "HYBRID_HALF_KEY",
    "HYBRID_METADATA_KEY",
    "HYBRID_SCHEMA_VERSION",
    "HybridHalves",
    "hybrid_metadata",
    "build_hybrid_state_dict",
    "check_adamw_state",
    "is_hybrid_state_dict",
    "split_hybrid_state_dict",
]

#: Key of every saved group naming the half that owns it.
HYBRID_HALF_KEY = "hybrid_half"
#: Top-level key (and group mirror) of the hybrid's own metadata.
HYBRID_METADATA_KEY = "gefen_hybrid"
#: Version of the layout above (2: groups in list order; 1: Muon groups first, still read).
HYBRID_SCHEMA_VERSION = 2
#: Versions :func:`split_hybrid_state_dict` reads.
_READABLE_VERSIONS = (1, 2)
_HALVES = ("muon", "backup")


@dataclass(frozen=True)
class HybridHalves:
    """A hybrid checkpoint taken apart (validated layout; the halves are validated by their children).

    Attributes:
        muon, backup: each half's own state dict (``None`` for a half the checkpoint does not have).
        backup_optimizer: ``"gefen"`` or ``"adamw"``.
        deterministic: the saved policy, ``None`` when the checkpoint predates the tag.
        skipped_steps: steps the hybrid skipped for NaN/Inf gradients (``>= 0``).
        layout: ``"torch"`` or ``"halves"`` (the gefen 0.1 layout, migrated).
        extra_state: ``state`` entries whose key is not a parameter (torch's ``state`` takes any key), as saved.
    """

    muon: dict[str, Any] | None
    backup: dict[str, Any] | None
    backup_optimizer: str
    deterministic: bool | None
    skipped_steps: int
    layout: str
    extra_state: dict[Any, Any] = field(default_factory=dict)


def hybrid_metadata(backup_optimizer: str, deterministic: bool, skipped_steps: int) -> dict[str, Any]:
    """The ``gefen_hybrid`` entry of a hybrid with these settings (see the module docstring)."""
    return {
        "schema_version": HYBRID_SCHEMA_VERSION,
        "optimizer": "GefenMuonHybrid",
        "backup_optimizer": backup_optimizer,
        "deterministic": bool(deterministic),
        "skipped_steps": int(skipped_steps),
    }


def build_hybrid_state_dict(
    groups: Sequence[tuple[str, Sequence[Tensor]]],
    halves: Mapping[str, dict[str, Any] | None],
    backup_optimizer: str,
    deterministic: bool,
    skipped_steps: int,
    extra_state: Mapping[Any, Any] | None = None,
) -> dict[str, Any]:
    """Merge the children's state dicts into the hybrid's torch-layout state dict, in the hybrid's list order.

    Args:
        groups: the hybrid's param groups in list order, each as ``(half, params)`` (its live parameter tensors).
        halves: ``{"muon": sd or None, "backup": sd or None}``, each a child's ``state_dict()``; the k-th group of
            a half in ``groups`` is the k-th group of that child (the child's list is the hybrid's, filtered).
        backup_optimizer, deterministic, skipped_steps: the hybrid's settings and counter.
        extra_state: the hybrid's ``state`` entries whose key is not a parameter, saved as-is (as torch does).

    Returns:
        The dict above; the children's tensors are shared, not copied (as ``torch.optim`` does).

    Raises:
        ValueError: ``groups`` and the children's state dicts disagree (a group count or size; a bug, not a user
            input).
    """
    meta = hybrid_metadata(backup_optimizer, deterministic, skipped_steps)
    state: dict[Any, Any] = {}
    packed_groups: list[dict[str, Any]] = []
    index: dict[int, int] = {}  # id(parameter) -> its first position, as torch.optim numbers a repeated parameter
    taken = dict.fromkeys(_HALVES, 0)
    position = 0
    for half, params in groups:
        sd = halves.get(half)
        if sd is None or taken[half] >= len(sd["param_groups"]):
            raise ValueError(f"hybrid state dict: the {half} half has fewer groups than the hybrid's list")
        saved = sd["param_groups"][taken[half]]
        taken[half] += 1
        if len(saved["params"]) != len(params):
            raise ValueError(
                f"hybrid state dict: a {half} group has {len(saved['params'])} parameters, not {len(params)}"
            )
        ids = []
        for offset, (param, child_id) in enumerate(zip(params, saved["params"])):
            i = index.setdefault(id(param), position + offset)
            ids.append(i)
            if i not in state and child_id in sd["state"]:
                state[i] = sd["state"][child_id]
        position += len(params)
        packed = {k: v for k, v in saved.items() if k != "params"}
        packed["params"] = ids
        packed[HYBRID_HALF_KEY] = half
        packed[HYBRID_METADATA_KEY] = meta
        packed_groups.append(packed)
    for half in _HALVES:
        sd = halves.get(half)
        if sd is not None and taken[half] != len(sd["param_groups"]):
            raise ValueError(f"hybrid state dict: the {half} half has more groups than the hybrid's list")
        if sd is not None:  # keys that are not parameters (torch's state takes any key): as the child saved them
            state.update({k: v for k, v in sd["state"].items() if not isinstance(k, int)})
    state.update(extra_state or {})
    return {"state": state, "param_groups": packed_groups, HYBRID_METADATA_KEY: meta}


def is_hybrid_state_dict(state_dict: object) -> bool:
    """Whether a dict looks like a hybrid checkpoint of either layout (for messages and ``gefen inspect``)."""
    if not isinstance(state_dict, Mapping):
        return False
    if HYBRID_KEYS.intersection(state_dict) or HYBRID_METADATA_KEY in state_dict:
        return True
    groups = state_dict.get("param_groups")  # a child's own dict has "hybrid_half" too, but no mirror
    return isinstance(groups, list) and any(
        isinstance(g, Mapping) and g.get(HYBRID_METADATA_KEY) is not None for g in groups
    )


def split_hybrid_state_dict(
    state_dict: object,
    backend: str | None = None,
    deterministic: bool | None = None,
    live: Mapping[str, Any] | None = None,
    live_halves: Sequence[str] | None = None,
) -> HybridHalves:
    """Take a hybrid checkpoint apart into its halves' own state dicts (never modifies the caller's dict).

    Args:
        state_dict: the untrusted dict, in torch's layout or the older halves layout.
        backend: the live hybrid's ``backup_optimizer`` (``None``: not compared, e.g. offline inspection).
        deterministic: the live hybrid's policy (``None``: not compared).
        live: the live hybrid's own ``gefen_hybrid`` entry (:func:`hybrid_metadata`): in a dict a load pre-hook
            assembled from the live ``state_dict()`` (the live entry at the top level, the checkpoint's in every
            group mirror), the mirrors win, as for a Gefen half (:func:`gefen.checkpoint.read_metadata`).
        live_halves: the half of each live group, in the live list order (``None``: not compared). A schema-2
            checkpoint's groups must come in the same order of halves: groups load by position, as in torch.

    Returns:
        :class:`HybridHalves`.

    Raises:
        CheckpointError: not a hybrid checkpoint; a group without (or with an unknown) ``hybrid_half``; groups in
            another order of halves than the live list (schema 2) or backup groups before Muon groups (schema 1);
            metadata missing, of another schema, or differing between copies; another backup optimizer or
            policy; a bad skipped-step count; a state entry no group lists.
    """
    if isinstance(state_dict, Mapping) and HYBRID_KEYS <= set(state_dict):  # gefen 0.1: migrate
        skipped = check_hybrid_layout(state_dict, backend, deterministic)
        policy = state_dict.get("deterministic")
        return HybridHalves(
            _copy(state_dict["muon"]),
            _copy(state_dict["backup"]),
            state_dict["backup_optimizer"],
            policy if isinstance(policy, bool) else None,
            skipped,
            "halves",
        )
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("param_groups"), list):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise CheckpointError(
            f"not a GefenMuonHybrid checkpoint (keys {keys}); expected torch's layout ('state', 'param_groups') "
            "with each group's 'hybrid_half', as GefenMuonHybrid.state_dict() returns."
        )
    state = state_dict.get("state")
    if not isinstance(state, Mapping):
        raise CheckpointError(f"hybrid checkpoint 'state' must be a dict, got {type(state).__name__}.")
    meta = _hybrid_metadata(state_dict, live)
    halves: dict[str, dict[str, Any]] = {}
    listed: set[Any] = set()
    for g, group in enumerate(state_dict["param_groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
            raise CheckpointError(f"hybrid checkpoint param_groups[{g}] must be a dict with a 'params' list.")
        half = group.get(HYBRID_HALF_KEY)
        if half not in _HALVES:
            raise CheckpointError(
                f"hybrid checkpoint param_groups[{g}]['{HYBRID_HALF_KEY}']={half!r} must be 'muon' or 'backup'; "
                "the checkpoint was not saved by GefenMuonHybrid.state_dict() or was edited."
            )
        if meta["schema_version"] == 1 and half == "muon" and "backup" in halves:
            raise CheckpointError(
                f"hybrid checkpoint param_groups[{g}] is a Muon group after backup groups; schema 1 wrote the Muon "
                "groups first (the checkpoint was edited)."
            )
        own = {k: v for k, v in group.items() if k not in (HYBRID_HALF_KEY, HYBRID_METADATA_KEY)}
        target = halves.setdefault(half, {"state": {}, "param_groups": []})
        target["param_groups"].append(own)
        for pid in group["params"]:
            if not isinstance(pid, (int, str)) or isinstance(pid, bool):
                raise CheckpointError(
                    f"hybrid checkpoint param_groups[{g}]['params'] holds {pid!r:.60}; parameter ids are ints "
                    "(or parameter names, from the DCP helpers)."
                )
            if pid in listed:
                raise CheckpointError(f"hybrid checkpoint lists parameter {pid!r} twice in its param groups.")
            listed.add(pid)
            if pid in state:
                target["state"][pid] = state[pid]
    unlisted = [pid for pid in state if pid not in listed and isinstance(pid, int)]
    if unlisted:
        raise CheckpointError(f"hybrid checkpoint state has entries for {unlisted[:5]!r}, which no param group lists.")
    extra = {k: v for k, v in state.items() if k not in listed}  # keys that are not parameters: as torch keeps them
    tag = meta["backup_optimizer"]
    if backend is not None and tag != backend:
        raise CheckpointError(
            f"checkpoint's backup optimizer is {tag!r}, this hybrid's {backend!r}; build the hybrid with "
            f"backup_optimizer={tag!r}."
        )
    if not halves:
        raise CheckpointError("the hybrid checkpoint has no param group in either half.")
    if deterministic is not None:
        _check_policy(meta["deterministic"], deterministic)
    saved_halves = [g[HYBRID_HALF_KEY] for g in state_dict["param_groups"]]
    live_order = None if live_halves is None else list(live_halves)
    if (
        meta["schema_version"] >= 2
        and live_order is not None
        and set(saved_halves) == set(live_order)  # a half missing on one side: the hybrid says so
        and saved_halves != live_order
    ):
        raise CheckpointError(
            f"the checkpoint's param groups belong to the halves {saved_halves}, this hybrid's to {live_order}: "
            "groups load by position, as in torch.optim. Rebuild the groups in the saved run's order (add_param_group "
            "appends; or assign param_groups in that order) before loading."
        )
    return HybridHalves(
        halves.get("muon"), halves.get("backup"), tag, meta["deterministic"], meta["skipped_steps"], "torch", extra
    )


def _copy(half: Any) -> Any:
    """A shallow copy of a half's top level (the children never mutate what they are given)."""
    return dict(half) if isinstance(half, Mapping) else half


def _hybrid_metadata(state_dict: Mapping[str, Any], live: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The hybrid metadata: the top-level entry and/or the group mirrors, which must agree (or, in a dict assembled
    from the live one, the mirrors win over the live top-level entry); validated."""
    top = state_dict.get(HYBRID_METADATA_KEY)
    mirrors = [g.get(HYBRID_METADATA_KEY) for g in state_dict["param_groups"] if isinstance(g, Mapping)]
    present = [m for m in mirrors if m is not None]
    candidates = ([top] if top is not None else []) + present
    if recipe_shape(top, present, live):
        candidates = present
    if not candidates:
        raise CheckpointError(
            f"not a GefenMuonHybrid checkpoint: the '{HYBRID_METADATA_KEY}' entry is missing at the top level and "
            "in the param groups; load the dict returned by GefenMuonHybrid.state_dict()."
        )
    first = candidates[0]
    if not all(isinstance(m, Mapping) for m in candidates) or not all(_same_metadata(m, first) for m in candidates):
        raise CheckpointError(
            f"inconsistent hybrid metadata: the '{HYBRID_METADATA_KEY}' copies differ; the checkpoint was edited."
        )
    version = first.get("schema_version")
    # an int first: an edited value of another type (a tensor, a list) must not reach the comparison, where a tensor
    # would answer with a tensor and its truth value raise a RuntimeError instead of this CheckpointError
    if type(version) is not int or version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"hybrid checkpoint schema_version={version!r} is not one of {list(_READABLE_VERSIONS)} (a newer gefen "
            "wrote it, or it was edited); upgrade gefen to load it."
        )
    if first.get("optimizer") != "GefenMuonHybrid":
        raise CheckpointError(f"hybrid checkpoint optimizer={first.get('optimizer')!r} is not 'GefenMuonHybrid'.")
    tag = first.get("backup_optimizer")
    if tag not in HYBRID_BACKENDS:
        raise CheckpointError(f"hybrid backup_optimizer={tag!r} must be one of {list(HYBRID_BACKENDS)}.")
    policy = first.get("deterministic")
    if not isinstance(policy, bool):
        raise CheckpointError(f"hybrid deterministic policy must be a bool, got {policy!r}; the checkpoint was edited.")
    skipped = _int_counter(first.get("skipped_steps"), "hybrid skipped_steps")
    if skipped < 0:
        raise CheckpointError(f"hybrid skipped_steps={skipped} must be >= 0.")
    return {"backup_optimizer": tag, "deterministic": policy, "skipped_steps": skipped, "schema_version": version}


def check_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Check the AdamW backup half of a hybrid checkpoint once torch loaded it into a throw-away twin optimizer
    (torch checks only counts): every entry has ``step``; moment tensors have the parameter's shape, are finite,
    and second moments are ``>= 0``.

    Raises:
        CheckpointError: the first problem found.
    """
    for g, group in enumerate(optimizer.param_groups):
        check_group(group, f"param_groups[{g}]", CheckpointError)
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            st = optimizer.state.get(p)
            if not st:
                continue
            name = names[i] if names else f"param_groups[{g}][{i}]"
            if "step" not in st:
                raise CheckpointError(f"state of {name} has no 'step'.")
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                value = st.get(key)
                if value is None:
                    continue
                if not isinstance(value, Tensor) or value.shape != p.shape:
                    shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise CheckpointError(
                        f"state of {name}: '{key}' has shape {shape}, the parameter {tuple(p.shape)}."
                    )
                bad = ~torch.isfinite(value) if key == "exp_avg" else ~(torch.isfinite(value) & (value >= 0))
                if bool(bad.any()):
                    raise CheckpointError(f"state of {name}: '{key}' has negative or non-finite values.")
