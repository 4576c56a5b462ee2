"""The param groups of :class:`gefen.GefenMuonHybrid`: one list in torch's order over two children.

The hybrid's ``param_groups`` is a plain ``list`` that the hybrid owns, in the order torch.optim gives (the
constructor's groups, then each ``add_param_group`` appended, whichever half owns it); every dict in it is the very
dict its half (a child optimizer) steps with. Each child's own ``param_groups`` is that list filtered to the child's
groups, in the same order. This module owns what keeps the two in line: how a new group (from the constructor,
``add_param_group``, an assignment ``opt.param_groups = groups`` or a list edited in place) is routed to a half and
normalised for it, and how a whole list is placed into the children at once (validated by the children before any
of them changes). The hybrid calls :func:`place_groups` when it finds its list changed (see ``GefenMuonHybrid._sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gefen.checkpoint_hybrid import HYBRID_HALF_KEY, HYBRID_METADATA_KEY
from gefen.errors import ConfigError
from gefen.optim._param_input import read_params
from gefen.optim.routing import Named, goes_to_muon, split_params_for_muon, validate_split

__all__ = ["HALVES", "GroupSpec", "input_groups", "group_spec", "place_groups", "publish", "same_groups"]

#: The two halves, in the order the hybrid steps them.
HALVES = ("muon", "backup")

#: A routed, normalised group: ``(half, group dict ready for that child's add_param_group)``.
GroupSpec = tuple[str, dict[str, Any]]


def publish(groups: list[dict[str, Any]], index: int, caller: dict[str, Any]) -> None:
    """Make the caller's dict the live group ``groups[index]``, as torch.optim's ``add_param_group`` does: its content
    becomes the normalised group (tensors in ``params``, names in ``param_names``, defaults filled in). Called only
    once the group was accepted, so a refused group leaves the caller's dict as it was."""
    live = groups[index]
    if live is not caller:
        caller.clear()
        caller.update(live)
        groups[index] = caller


def same_groups(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two group lists hold the same dict objects in the same order (identity, not equality)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def input_groups(
    model_or_params: nn.Module | Iterable[Any], substrings: Sequence[str]
) -> tuple[list[GroupSpec], bool, Named, Named, list[dict[str, Any] | None]]:
    """The constructor's ``model_or_named_params`` as routed groups, in the order the hybrid's list gets them.

    Args:
        model_or_params: an ``nn.Module`` (routing by module type and name), ``(name, tensor)`` pairs (by name and
            ``ndim``), bare tensors (by ``ndim`` only: 2-D to Muon) or param-group dicts (each routed whole, as by
            ``add_param_group``).
        substrings: lower-case name fragments that send a parameter to the backup.

    Returns:
        ``(specs, named, muon, backup, callers)``: the groups (a module, pairs or tensors give one group per half
        that has a parameter, Muon's first; dicts keep their order), whether the parameters carry names (torch's
        rule: all or none), every parameter per half as ``(name, tensor)`` (``params[i]`` where it has no name)
        for the construction checks and messages, and per group the caller's dict (``None`` where the hybrid made
        the group), to :func:`publish` once the group is accepted.

    Raises:
        TypeError: a single tensor, or items mixing kinds or of another kind.
        ConfigError: no parameter (an iterator consumed already?), a parameter twice.
        ValueError: names not unique, a model's trainable parameter missing (see
            :func:`gefen.optim.routing.validate_split`), names on some parameters only.
        ConfigError: a dict whose parameters the rule sends to both halves, an unknown ``hybrid_half``.
    """
    if isinstance(model_or_params, Tensor):
        raise TypeError(
            "GefenMuonHybrid needs an nn.Module, (name, tensor) pairs, tensors or param-group dicts, got a single "
            "Tensor; pass model, model.named_parameters() or [tensor]."
        )
    if isinstance(model_or_params, nn.Module):
        muon, backup = split_params_for_muon(model_or_params, substrings)
        validate_split(muon, backup, model_or_params)
        specs = _two_groups(muon, backup, named=True)
        return specs, True, muon, backup, [None] * len(specs)
    items = read_params("GefenMuonHybrid", model_or_params, "the model itself")
    if all(isinstance(item, Tensor) for item in items):
        numbered = [(f"params[{i}]", t) for i, t in enumerate(items)]
        muon = [(n, t) for n, t in numbered if goes_to_muon("", t, set(), substrings)]
        backup = [(n, t) for n, t in numbered if not goes_to_muon("", t, set(), substrings)]
        validate_split(muon, backup)
        specs = _two_groups(muon, backup, named=False)
        return specs, False, muon, backup, [None] * len(specs)
    if all(isinstance(item, dict) for item in items):
        specs, named, muon, backup = _dict_groups(items, substrings)
        return specs, named, muon, backup, list(items)
    if any(isinstance(item, (Tensor, dict)) for item in items):
        raise TypeError(
            "GefenMuonHybrid params mix kinds; pass one kind: (name, tensor) pairs, tensors or param-group dicts."
        )
    muon, backup = split_params_for_muon(items, substrings)  # (name, tensor) pairs; refuses anything else
    validate_split(muon, backup)
    specs = _two_groups(muon, backup, named=True)
    return specs, True, muon, backup, [None] * len(specs)


def _two_groups(muon: Named, backup: Named, *, named: bool) -> list[GroupSpec]:
    """One group per half that has a parameter (Muon's first, as the hybrid steps them)."""
    specs = []
    for half, items in (("muon", muon), ("backup", backup)):
        if items:
            specs.append((half, {"params": list(items) if named else [t for _, t in items]}))
    return specs


def _dict_groups(groups: list[dict[str, Any]], substrings: Sequence[str]) -> tuple[list[GroupSpec], bool, Named, Named]:
    """Param-group dicts given to the constructor, each routed whole (see :func:`group_spec`); as in torch.optim,
    all of them name their parameters or none does."""
    given = []
    for g in groups:  # an iterator of parameters is read once, here
        raw = g.get("params", [])
        given.append(g if isinstance(raw, (Tensor, set, list)) else {**g, "params": list(raw)})
    has_names = []
    for g in given:
        raw = g.get("params", [])
        items = [raw] if isinstance(raw, Tensor) else raw if isinstance(raw, list) else []
        has_names.append("param_names" in g or any(isinstance(item, tuple) for item in items))
    if len(set(has_names)) > 1:
        raise ValueError(
            "GefenMuonHybrid param groups: some name their parameters and some not; as in torch.optim, all param "
            "groups have names or none."
        )
    named = has_names[0]
    specs = [group_spec(g, i, named=named, substrings=substrings, owners={}) for i, g in enumerate(given)]
    halves: dict[str, Named] = {"muon": [], "backup": []}
    for g, (half, spec) in enumerate(specs):
        for i, item in enumerate(spec["params"]):
            halves[half].append(item if named else (f"param_groups[{g}][{i}]", item))
    validate_split(halves["muon"], halves["backup"])
    return specs, named, halves["muon"], halves["backup"]


def group_spec(
    group: Any,
    index: int,
    *,
    named: bool,
    substrings: Sequence[str],
    owners: Mapping[int, str],
) -> GroupSpec:
    """Route one new param group to a half and normalise it for that half's ``add_param_group``.

    The half is the group's ``hybrid_half`` when given; else the half already holding its parameters (a group
    rebuilt over parameters the hybrid holds, as Lightning's resume does); else the constructor's rule applied to
    each parameter (2-D and no backup substring in its name goes to Muon; a bare tensor has no name).

    Args:
        group: the caller's dict (not modified).
        index: its position in the hybrid's list (for invented names and messages).
        named: whether the hybrid's parameters carry names. A named hybrid names a bare tensor
            ``param_groups[index][i]`` (its halves hold named parameters; torch would refuse the group instead);
            a hybrid without names refuses a group with names, as torch does.
        substrings: lower-case backup name fragments.
        owners: ``id(parameter) -> half`` for the parameters the hybrid holds.

    Returns:
        ``(half, spec)``: ``spec`` is a new dict without the hybrid's own keys, its ``params`` as ``(name, tensor)``
        pairs (named) or tensors.

    Raises:
        TypeError: not a dict, ``params`` a set, an item that is not a tensor.
        ValueError: names on some parameters only, or names in a hybrid without names; ``param_names`` of
            another length.
        ConfigError: the parameters belong (or route) to both halves; an unknown ``hybrid_half``.
    """
    if not isinstance(group, dict):
        raise TypeError(f"GefenMuonHybrid param_group must be a dict, got {type(group).__name__}.")
    spec = {k: v for k, v in group.items() if k not in (HYBRID_HALF_KEY, HYBRID_METADATA_KEY)}
    half = group.get(HYBRID_HALF_KEY)
    raw = spec.get("params", [])
    if isinstance(raw, set):
        raise TypeError(
            f"GefenMuonHybrid param_groups[{index}]['params'] is a set, whose order changes between runs; pass a list."
        )
    items = [raw] if isinstance(raw, Tensor) else list(raw)
    names = spec.pop("param_names", None)
    if names is not None and (not isinstance(names, (list, tuple)) or len(names) != len(items)):
        raise ValueError(f"GefenMuonHybrid param_groups[{index}]['param_names'] must name each parameter once.")
    pairs: list[tuple[str | None, Tensor]] = []
    for i, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"GefenMuonHybrid param_groups[{index}]['params'][{i}] is a {type(tensor).__name__}.")
        pairs.append((names[i] if name is None and names is not None else name, tensor))
    given = [name is not None for name, _ in pairs]
    if any(given) and not all(given):
        raise ValueError(
            f"GefenMuonHybrid param_groups[{index}]: some parameters have names and some not; name all or none."
        )
    if any(given) and not named:
        raise ValueError(
            f"GefenMuonHybrid param_groups[{index}] has parameter names, this hybrid's parameters have none: as in "
            "torch.optim, all param groups have names or none. Pass bare tensors (or build the hybrid from "
            "model.named_parameters())."
        )
    if half is None:
        held = {owners[id(t)] for _, t in pairs if id(t) in owners}
        if len(held) > 1:
            raise ConfigError(
                f"GefenMuonHybrid param_groups[{index}] holds parameters of both halves; one group belongs to one "
                "half: split it into one group per half."
            )
        half = held.pop() if held else _route(pairs, index, substrings)
    if half not in HALVES:
        raise ConfigError(f"GefenMuonHybrid param_groups[{index}]: hybrid_half={half!r} must be 'muon' or 'backup'.")
    if named:
        spec["params"] = [(name or f"param_groups[{index}][{i}]", t) for i, (name, t) in enumerate(pairs)]
    else:
        spec["params"] = [t for _, t in pairs]
    return half, spec


def _route(pairs: list[tuple[str | None, Tensor]], index: int, substrings: Sequence[str]) -> str:
    """The constructor's rule for a whole group (every parameter must go to the same half)."""
    routes = [(n, "muon" if goes_to_muon(n or "", p, set(), substrings) else "backup") for n, p in pairs]
    if len({h for _, h in routes}) > 1:
        listed = ", ".join(f"{n or f'params[{i}]'} -> {h}" for i, (n, h) in enumerate(routes[:6]))
        raise ConfigError(
            f"GefenMuonHybrid cannot route one group to both halves (param_groups[{index}]: {listed}); split it "
            "into one group per half, or pass 'hybrid_half': 'muon' or 'backup'."
        )
    return routes[0][1] if routes else "backup"


def place_groups(
    groups: Sequence[Any],
    children: dict[str, torch.optim.Optimizer | None],
    *,
    named: bool,
    substrings: Sequence[str],
    make_child: Callable[[str, list[dict[str, Any]]], torch.optim.Optimizer],
) -> list[str]:
    """Make each child's ``param_groups`` the hybrid list ``groups`` filtered to its half, or change nothing.

    A dict a child already steps keeps its half and stays the same object (a dict listed twice is listed twice
    in its child, as it is stepped twice in torch). A new dict is routed by :func:`group_spec` and validated by
    its child's ``add_param_group`` (defaults filled in, names, hyperparameters, tensors, a parameter held twice);
    its content is then replaced by the normalised group, so the caller's dict is the one its half steps with.

    Args:
        groups: the hybrid's new list.
        children: ``{"muon": child or None, "backup": child or None}``; updated in place with any half built here.
        named, substrings: see :func:`group_spec`.
        make_child: ``(half, specs) -> optimizer`` building a half that does not exist yet over its first groups.

    Returns:
        The half of each group, in list order.

    Raises:
        TypeError, ValueError, ConfigError: a group that cannot be placed (see :func:`group_spec` and the child's
            ``add_param_group``); every child then keeps its former list and no dict of ``groups`` is changed.
    """
    known = {id(g): half for half, c in children.items() if c is not None for g in c.param_groups}
    owners = {id(p): half for half, c in children.items() if c is not None for g in c.param_groups
              for p in g["params"]}  # fmt: skip
    plan: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []  # (half, group, spec: None = held as is)
    new: dict[int, str] = {}
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError(f"GefenMuonHybrid param_groups[{i}] is a {type(group).__name__}, not a param-group dict.")
        if id(group) in known or id(group) in new:
            plan.append((known.get(id(group)) or new[id(group)], group, None))
            continue
        half, spec = group_spec(group, i, named=named, substrings=substrings, owners=owners)
        new[id(group)] = half
        plan.append((half, group, spec))
    existing = {half: c for half, c in children.items() if c is not None}
    before = {half: c.param_groups for half, c in existing.items()}
    normalised: dict[int, dict[str, Any]] = {}  # id(new group) -> the child's normalised copy
    built: dict[str, torch.optim.Optimizer] = {}
    try:
        for child in existing.values():
            child.param_groups = []
        for half, group, spec in plan:
            child = existing.get(half)
            if child is None:
                continue
            if spec is not None:
                child.add_param_group(spec)  # validates against the groups placed before it
                normalised[id(group)] = child.param_groups[-1]
            else:
                child.param_groups.append(normalised.get(id(group), group))
        for half in HALVES:  # a half that does not exist yet is built over its groups (validated there)
            specs = [(group, spec) for h, group, spec in plan if h == half and spec is not None]
            if half not in existing and specs:
                built[half] = make_child(half, [spec for _, spec in specs])
                normalised.update((id(g), copy) for (g, _), copy in zip(specs, built[half].param_groups))
    except BaseException:
        for half, child in existing.items():
            child.param_groups = before[half]
        raise
    final: dict[str, list[dict[str, Any]]] = {half: [] for half in HALVES}
    for half, group, spec in plan:  # the commit: nothing below can fail
        if spec is not None:
            copy = normalised[id(group)]
            group.clear()
            group.update(copy)
        final[half].append(group)
    children.update(built)
    for half, child in children.items():
        if child is not None:
            child.param_groups = final[half]
    return [half for half, _, _ in plan]
