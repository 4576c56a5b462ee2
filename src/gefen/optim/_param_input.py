"""What the optimizers tell a user about the ``params`` they were given, before torch.optim sees them.

Owns the refusals of the params argument itself (a module, a single tensor, an empty or already consumed
iterable) and of a parameter listed twice (in one group, in two groups, or re-added by ``add_param_group``), and
how a message names a parameter: by the name the caller gave, with its position, or by its position alone. The
per-tensor checks (dtype, shape, backend, sharding) stay with the optimizers; they name the parameter through
:func:`param_label`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from gefen.errors import ConfigError

__all__ = ["given_names", "param_label", "read_params", "refuse_duplicates"]


def param_label(where: str, index: int, name: str | None) -> str:
    """How a message names ``params[index]`` of the group at ``where``.

    Args:
        where: the group, e.g. ``"Gefen param_groups[1]"``.
        index: the parameter's position in the group.
        name: the name the caller gave it, ``None`` when it has none.

    Returns:
        ``"Gefen param_groups[1]['params'][0] ('encoder.w')"``, or the position alone when there is no name.
    """
    position = f"{where}['params'][{index}]"
    return position if name is None else f"{position} ({name!r})"


def given_names(items: Sequence[Any], param_names: Any) -> list[str | None]:
    """The name of each item of a group's ``params``: from a ``(name, tensor)`` pair, else from the group's
    ``param_names`` when that is a list of the right length, else ``None``."""
    listed = param_names if isinstance(param_names, (list, tuple)) and len(param_names) == len(items) else None
    names: list[str | None] = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names.append(item[0])
        else:
            names.append(listed[i] if listed is not None and isinstance(listed[i], str) else None)
    return names


def read_params(kind: str, params: Any, module_hint: str) -> list[Any]:
    """The constructor's ``params`` as a list, refusing what torch.optim would refuse with a less useful message.

    Args:
        kind: the optimizer's name for messages.
        params: the constructor's ``params``.
        module_hint: what to pass instead of an ``nn.Module``, e.g. ``"model.named_parameters()"``.

    Returns:
        The items of ``params`` (tensors, ``(name, tensor)`` pairs or param-group dicts), read once.

    Raises:
        TypeError: a single tensor or an ``nn.Module``.
        ConfigError: no parameter at all; for an iterator, the hint that it may have been consumed already.
    """
    if isinstance(params, Tensor):
        raise TypeError(
            f"{kind} params must be an iterable of tensors, (name, tensor) pairs or dicts, got a single Tensor; pass "
            "[tensor] or model.parameters()."
        )
    if isinstance(params, nn.Module):
        raise TypeError(f"{kind} params is a {type(params).__name__} (an nn.Module); pass {module_hint}.")
    is_iterator = isinstance(params, Iterable) and iter(params) is params
    items = list(params)
    if not items:
        if is_iterator:
            raise ConfigError(
                f"{kind} got an empty parameter list from an iterator: was it consumed already (e.g. "
                "params = model.parameters() passed to an earlier optimizer)? A generator can be read once; call "
                "model.named_parameters() again for each optimizer, or pass list(...)."
            )
        raise ConfigError(f"{kind} got an empty parameter list; pass model.named_parameters().")
    return items


def refuse_duplicates(
    kind: str,
    where: str,
    labels: Sequence[str],
    tensors: Sequence[Tensor],
    groups: Sequence[dict[str, Any]],
    new_has_names: bool,
) -> None:
    """Refuse a new group that lists a tensor twice or one another group holds, naming both places.

    Args:
        kind: the optimizer's name for messages.
        where: the new group, e.g. ``"Gefen param_groups[1]"``.
        labels: how messages name each new tensor (:func:`param_label`).
        tensors: the new group's tensors.
        groups: the optimizer's groups so far (``params`` as tensors, ``param_names`` where named).
        new_has_names: whether the new group names its parameters (all groups must, or none: torch's rule).

    Raises:
        ConfigError: the first duplicate, or names in some groups only (checked after duplicates, which that rule
            would otherwise hide).
    """
    seen: dict[int, str] = {}
    for g, group in enumerate(groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            seen.setdefault(id(p), param_label(f"param_groups[{g}]", i, names[i] if names else None))
    first_here: dict[int, str] = {}
    for label, tensor in zip(labels, tensors):
        if id(tensor) in first_here:
            raise ConfigError(
                f"{label} is the same tensor as {first_here[id(tensor)]}: the group lists the same parameter twice; "
                "pass each parameter once."
            )
        if id(tensor) in seen:
            raise ConfigError(
                f"{label} is already in this {kind} as {seen[id(tensor)]}: a parameter belongs to one param group; "
                "remove it from one of them (to change its hyperparameters, edit that group's entries)."
            )
        first_here[id(tensor)] = label
    if groups and any("param_names" in g for g in groups) != new_has_names:
        mine, theirs = ("names its parameters", "do not") if new_has_names else ("does not name its parameters", "do")
        raise ConfigError(
            f"{where} {mine}, this {kind}'s earlier groups {theirs}: as in torch.optim, all "
            "param groups name their parameters or none does; pass (name, tensor) pairs in every group, or bare "
            "tensors in every group."
        )
