"""What torch's tooling does to an optimizer state dict on its way back to :meth:`load_state_dict`, undone or
refused here (used by :func:`gefen.checkpoint.stage_load`):

* ``torch.distributed.checkpoint``'s flattened layout (``flatten_optimizer_state_dict=True``) rebuilds each
  parameter's state from the keys the *live* optimizer holds: :func:`drop_flattened_stand_ins` undoes its stand-ins,
  :func:`check_flattened_loss` refuses a load in which it dropped saved state.
* torch's documented ``register_load_state_dict_pre_hook`` recipe assembles a dict from the live optimizer's
  ``state_dict()`` and a checkpoint; uint8 codes are only meaningful with the codebook they were quantized
  against, so a dict that keeps live codes while loading another codebook is refused:
  :func:`check_codebook_provenance`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.errors import CheckpointError
from gefen.sharding import local
from gefen.state import FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE

__all__ = ["drop_flattened_stand_ins", "check_flattened_loss", "check_codebook_provenance"]


def _other_codebook(a: Tensor | None, b: Tensor | None) -> bool:
    return a is not None and b is not None and not torch.equal(a.cpu(), b.cpu())


def _same_codes(staged: Mapping[str, Tensor], live: object) -> bool:
    """Whether a staged state is a copy of a live one (same first-moment codes and non-zero magnitudes)."""
    if not isinstance(live, Mapping) or FIRST_MOMENT_CODES not in live:
        return False
    if not bool(local(staged[FIRST_MOMENT_SCALE]).any()):
        return False
    return all(
        isinstance(live.get(k), Tensor)
        and local(staged[k]).shape == local(live[k]).shape
        and torch.equal(local(staged[k]).cpu(), local(live[k]).cpu())
        for k in (FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE)
    )


def drop_flattened_stand_ins(saved: object) -> Any:
    """Undo what torch's flattened DCP layout puts in a parameter's state (``flatten_optimizer_state_dict=True``).

    ``set_optimizer_state_dict`` rebuilds each parameter's state from the keys the *live* optimizer holds, with
    ``{}`` for a key the flattened dict lacks (a live key the checkpoint never had): those stand-ins are dropped.
    An entry that is ``{}`` as a whole (the live optimizer held no state for the parameter) becomes ``None``; whether
    that lost saved state is decided for the whole dict by :func:`check_flattened_loss`.

    Args:
        saved: one untrusted per-parameter entry of ``state_dict["state"]``.

    Returns:
        ``saved`` without stand-ins (the same object when it has none), or ``None`` for an empty entry.
    """
    if not isinstance(saved, Mapping):
        return saved
    if not saved:
        return None
    if not any(isinstance(v, Mapping) and not v for v in saved.values()):
        return saved
    return {k: v for k, v in saved.items() if not (isinstance(v, Mapping) and not v)}


def check_flattened_loss(emptied: list[str], stateful: int, saved_stateful: int | None, global_step: int) -> None:
    """Refuse a load in which DCP's flattened rebuild dropped saved state.

    Args:
        emptied: the entries (for messages) that came back as ``{}``.
        stateful: parameters the dict gives state.
        saved_stateful: parameters the checkpoint gave state (its metadata; ``None``: unknown, before schema 4).
        global_step: the checkpoint's global step.

    Raises:
        CheckpointError: some entry is empty and the checkpoint had state for more parameters than the dict (or,
            when that is unknown, took any step).
    """
    if not emptied:
        return
    lost = global_step > 0 if saved_stateful is None else stateful < saved_stateful
    if not lost:
        return
    known = "" if saved_stateful is None else f" (state for {saved_stateful} parameters, this dict has {stateful})"
    raise CheckpointError(
        f"{emptied[0]} is empty, and the checkpoint's saved state was not all read{known}. This is what "
        "torch.distributed.checkpoint's flattened layout (flatten_optimizer_state_dict=True) leaves when the live "
        "optimizer holds no state for a parameter: set_optimizer_state_dict reads only the state keys the live "
        "optimizer has, and a Gefen optimizer has state only after a step with a gradient. Load with "
        "flatten_optimizer_state_dict=False (or torch.load and load_state_dict), or load into an optimizer that has "
        "taken its first step."
    )


def check_codebook_provenance(
    staged: Mapping[Any, Any],
    names: Mapping[Tensor, tuple[Any, str]],
    codebook: Tensor | None,
    live_codebook: Tensor | None,
    live_state: Mapping[Any, Any] | None,
) -> None:
    """Refuse a load that keeps some parameter's live state while replacing the codebook it was quantized against.

    torch's documented ``register_load_state_dict_pre_hook`` recipe assembles a dict from the live optimizer's
    ``state_dict()`` and a checkpoint: the checkpoint's state for the parameters it names, the live state for the
    others (a layer the model gained). Into a trained optimizer, the loaded codebook is the checkpoint's, so the
    live codes would be read against the wrong codebook. Such a parameter is recognised by staged codes and
    magnitudes equal to its live ones (a non-zero momentum: equal by chance is out of reach).

    Args:
        staged: parameter -> staged state (other keys are ignored).
        names: parameter -> ``(saved id, name)`` for messages.
        codebook: the codebook being loaded (fp32 (256,)), or ``None``.
        live_codebook: the live optimizer's codebook, or ``None``.
        live_state: the live optimizer's ``state`` (``None``: no check).

    Raises:
        CheckpointError: naming the parameter and the fix.
    """
    if live_state is None or not _other_codebook(codebook, live_codebook):
        return
    for param, (pid, name) in names.items():
        if param in staged and _same_codes(staged[param], live_state.get(param)):
            raise CheckpointError(
                f"checkpoint state[{pid!r}] ({name}) is this optimizer's own live state, quantized against its "
                "codebook, but the dict loads another codebook (the checkpoint's): a load pre-hook mixed the state "
                "of two optimizers. Copy every parameter's state from the checkpoint, or give the parameters it "
                "lacks zero counters {'step': 0, 'period': 0} (no state)."
            )
