"""The drop-in rules: what ``Gefen`` and ``GefenMuon`` do with the inputs their anchors (``torch.optim.AdamW``,
``torch.optim.Muon``) accept, where torch's base ``Optimizer`` alone does not already give the same result.

* ``betas`` are stored as AdamW stores them: a tuple, a 1-element tensor squeezed to 0-dim (:func:`as_torch_betas`).
* AdamW's implementation flags in a param group (``amsgrad``, ``maximize``, ``differentiable``, ``foreach``,
  ``capturable``, ``decoupled_weight_decay``) are honoured at the values Gefen implements and refused otherwise,
  never ignored (:func:`check_adamw_flags`); GefenMuon's anchor has none, so there they are user keys, as in torch.
* Param-group dicts are the caller's own objects once accepted, as in torch (``opt.param_groups[-1] is group``),
  filled in only after every check has passed (:func:`publish_group`).

README "torch.optim compatibility" lists the deliberate differences that remain, each with its test
(``tests/optim/test_dropin_rules.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from gefen.errors import ConfigError

__all__ = ["ADAMW_GROUP_FLAGS", "as_torch_betas", "check_adamw_flags", "publish_group"]

#: AdamW's per-group implementation flags and the values Gefen implements (``foreach`` only picks torch's loop, so
#: every value means "Gefen's own step"; ``decoupled_weight_decay=False`` would be Adam's L2 decay).
ADAMW_GROUP_FLAGS: dict[str, tuple[object, ...]] = {
    "amsgrad": (False,),
    "maximize": (False,),
    "differentiable": (False,),
    "foreach": (None, False, True),
    "decoupled_weight_decay": (True,),
}


def as_torch_betas(betas: Any) -> Any:
    """``betas`` as ``torch.optim.AdamW``'s constructor stores them: a list or tuple becomes a tuple and a
    1-element tensor of any shape a 0-dim one (torch's ``_to_scalar``); anything else is returned unchanged for
    the validator to refuse.

    Args:
        betas: the constructor's ``betas``.

    Returns:
        The value to store in ``defaults``.
    """
    if not isinstance(betas, (list, tuple)):
        return betas
    return tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 and b.numel() == 1 else b for b in betas)


def check_adamw_flags(
    group: Mapping[str, Any], where: str, capturable: bool, error: type[Exception] = ConfigError
) -> None:
    """Refuse an AdamW implementation flag in a param group that Gefen would otherwise ignore.

    A flag absent from the group is fine (Gefen's groups do not carry them); a present one must hold a value
    Gefen implements (:data:`ADAMW_GROUP_FLAGS`), and ``capturable`` the optimizer's own (it is optimizer-wide
    in Gefen: device counters and the global step are shared by every group).

    Args:
        group: a param group (the constructor's defaults merged with the caller's dict, a live or a saved group).
        where: the group's place for the message, e.g. ``"Gefen param_groups[1]"``.
        capturable: the optimizer's ``capturable``.
        error: the exception class (``CheckpointError`` while loading).

    Raises:
        error: a flag at a value Gefen does not implement.
    """
    for key, allowed in ADAMW_GROUP_FLAGS.items():
        if key in group and not any(group[key] is value for value in allowed):
            raise error(
                f"{where}[{key!r}]={group[key]!r}: Gefen does not implement torch.optim.AdamW's {key}={group[key]!r} "
                f"(it would be ignored); remove the key or set it to {' or '.join(map(repr, allowed))}."
            )
    if "capturable" in group and group["capturable"] is not capturable:
        raise error(
            f"{where}['capturable']={group['capturable']!r}, the optimizer's is {capturable}: Gefen's capturable is "
            "one setting for the whole optimizer (its step counters are shared); pass capturable= to the constructor "
            "and remove the group key."
        )


def publish_group(param_groups: list[dict[str, Any]], index: int, caller: dict[str, Any]) -> None:
    """Make the caller's dict the live group ``param_groups[index]``, as ``torch.optim`` does: its content is
    replaced by the normalised group (tensors in ``params``, names in ``param_names``, defaults filled in).

    Called only once the group has been accepted, so a refused group leaves the caller's dict as it was.

    Args:
        param_groups: the optimizer's list.
        index: the accepted group's position.
        caller: the dict the caller passed (or the live group itself, then nothing changes).
    """
    live = param_groups[index]
    if live is caller:
        return
    caller.clear()
    caller.update(live)
    param_groups[index] = caller
