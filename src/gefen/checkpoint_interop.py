"""What torch's tooling does to an optimizer state dict on its way back to :meth:`load_state_dict`, undone or
refused here (used by :func:`gefen.checkpoint.stage_load`):

* ``torch.distributed.checkpoint``'s flattened layout (``flatten_optimizer_state_dict=True``) rebuilds each
  parameter's state from the keys the *live* optimizer holds: :func:`drop_flattened_stand_ins`.
* torch's documented ``register_load_state_dict_pre_hook`` recipe assembles a dict from the live optimizer's
  ``state_dict()`` and a checkpoint; uint8 codes are only meaningful with the codebook they were quantized
  against, so a dict whose states and metadata come from different optimizers is refused:
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

__all__ = ["drop_flattened_stand_ins", "check_codebook_provenance"]


def _other_codebook(a: Tensor | None, b: Tensor | None) -> bool:
    return a is not None and b is not None and not torch.equal(a.cpu(), b.cpu())


def _same_codes(staged: Mapping[str, Tensor], live: object) -> bool:
    """Whether a staged state is a copy of a live one (same first-moment codes and magnitudes)."""
    if not isinstance(live, Mapping) or FIRST_MOMENT_CODES not in live:
        return False
    return all(
        isinstance(live.get(k), Tensor)
        and local(staged[k]).shape == local(live[k]).shape
        and torch.equal(local(staged[k]).cpu(), local(live[k]).cpu())
        for k in (FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE)
    )


def drop_flattened_stand_ins(saved: object, where: str, global_step: int) -> Any:
    """Undo what torch's flattened DCP layout puts in a parameter's state (``flatten_optimizer_state_dict=True``).

    ``set_optimizer_state_dict`` rebuilds each parameter's state from the keys the *live* optimizer holds, with
    ``{}`` for a key the flattened dict lacks (a live key the checkpoint never had). Those stand-ins are dropped.
    An entry that is ``{}`` as a whole means the live optimizer held no state for the parameter, so whatever the
    checkpoint had for it was not read: harmless when the checkpoint never stepped, refused otherwise.

    Args:
        saved: one untrusted per-parameter entry of ``state_dict["state"]``.
        where: prefix for messages.
        global_step: the checkpoint's global step.

    Returns:
        ``saved`` without stand-ins (the same object when it has none), or ``None`` for "no state".

    Raises:
        CheckpointError: an empty entry in a checkpoint of a trained optimizer.
    """
    if not isinstance(saved, Mapping):
        return saved
    if not saved:
        if global_step == 0:
            return None
        raise CheckpointError(
            f"{where} is empty, in a checkpoint of an optimizer that took {global_step} steps. This is what "
            "torch.distributed.checkpoint's flattened layout (flatten_optimizer_state_dict=True) leaves when the "
            "live optimizer holds no state for the parameter: set_optimizer_state_dict reads only the state keys "
            "the live optimizer has, and a Gefen optimizer has state only after its first step with a gradient, "
            "so the saved state was not read. Load with flatten_optimizer_state_dict=False (or torch.load and "
            "load_state_dict), or take the first step before loading."
        )
    if not any(isinstance(v, Mapping) and not v for v in saved.values()):
        return saved
    return {k: v for k, v in saved.items() if not (isinstance(v, Mapping) and not v)}


def check_codebook_provenance(
    staged: Mapping[Any, Any],
    names: Mapping[Tensor, tuple[Any, str]],
    assembled: bool,
    codebook: Tensor | None,
    global_step: int,
    live_metadata: Mapping[str, Any] | None,
    live_state: Mapping[Any, Any] | None,
) -> None:
    """Refuse a load whose per-parameter codes were quantized against another codebook than the one it loads.

    Two shapes of a dict a load pre-hook assembled from the live ``state_dict()`` and a checkpoint give that away
    (both only checkable against a live optimizer that holds a codebook):

    * ``assembled`` (the checkpoint's metadata won over the live top-level copy) and the codebooks differ: a
      parameter whose staged codes and magnitudes equal its live ones kept the live optimizer's state;
    * the dict's metadata *is* the live optimizer's (same codebook and global step) but a parameter's state is
      not its live one: it was copied from a checkpoint without that checkpoint's metadata.

    Args:
        staged: parameter -> staged state (other keys are ignored).
        names: parameter -> ``(saved id, name)`` for messages.
        assembled: see :class:`gefen.checkpoint.Metadata`.
        codebook: the codebook being loaded (fp32 (256,)), or ``None``.
        global_step: the global step being loaded.
        live_metadata: the live optimizer's own metadata (``None``: no check).
        live_state: the live optimizer's ``state`` (``None``: no check).

    Raises:
        CheckpointError: naming the parameter and the fix.
    """
    live_codebook = None if live_metadata is None else live_metadata.get("codebook")
    if live_state is None or live_codebook is None or codebook is None:
        return
    other = _other_codebook(codebook, live_codebook)
    if not assembled and not other and global_step == live_metadata.get("global_step"):  # type: ignore[union-attr]
        for param, (pid, name) in names.items():
            if param in staged and not _same_codes(staged[param], live_state.get(param)):
                raise CheckpointError(
                    f"checkpoint state[{pid!r}] ({name}) is not this optimizer's, but the dict's metadata (codebook, "
                    "global step) is this optimizer's own: the state was quantized against another codebook. A "
                    "load pre-hook built the dict from the live state_dict() and copied per-parameter state from a "
                    "checkpoint without its metadata; copy the saved groups' 'gefen_metadata' (and any top-level "
                    "'gefen' entry) too."
                )
    if assembled and other:
        for param, (pid, name) in names.items():
            if param in staged and _same_codes(staged[param], live_state.get(param)):
                raise CheckpointError(
                    f"checkpoint state[{pid!r}] ({name}) is this optimizer's own live state, quantized against its "
                    "codebook, but the dict's metadata is the checkpoint's, whose codebook differs: a load pre-hook "
                    "mixed the state of two optimizers. Copy every parameter's state from the checkpoint, or give "
                    "the parameters it lacks zero counters {'step': 0, 'period': 0} (no state)."
                )
