"""What a step does with NaN/Inf gradients: the ``nonfinite`` policy, and the skipped-step record.

Policies (the ``nonfinite=`` option of every Gefen optimizer):

* ``"skip"`` (the default) — a step in which any gradient of the optimizer holds a NaN, an Inf or a value whose
  square overflows float32 (see :func:`gefen.amp.usable_bound`) changes nothing: parameters, state, codebook,
  counters and the global step stay as they were; the step warns naming the parameters and counts itself in
  ``skipped_steps`` (saved in checkpoints). Where the check runs, and what it costs, is said below.
* ``"raise"`` — the same check, but the step raises :class:`~gefen.errors.StepError` (nothing changed); the
  default under ``deterministic=True``.
* ``"propagate"`` — let them through like ``torch.optim.AdamW`` (the run is poisoned); only a parameter's first
  gradient is checked (its period search and the codebook need finite values). ``"ignore"`` is its old name.

Where the check runs (``Gefen``; the hybrid and GefenMuon check before the step): on a steady step (every
parameter has state, none sharded) the step applies the policy itself, before its first write — the CPU's native
library inside its own passes; the compiled kernels (CUDA's default) under ``"skip"`` on the device, with no host
read: the per-parameter flags set the kernels' apply entry (:data:`gefen.kernels.fused.APPLY`), so a skipped step
writes nothing, and the host learns the outcome when it next looks (:class:`PendingCheck`: at the next
``step()``, or when ``skipped_steps``, ``global_step``, ``state_dict()`` or ``load_state_dict()`` is called), where
the step counters advance or the skip is counted and warned about. Otherwise (first steps, the eager backend,
``"raise"`` on the compiled path) it is the one host read.

``capturable=True`` steps may not read anything on the host, so there the default is ``"propagate"`` (skip
overflow steps with ``torch.amp.GradScaler``, whose capturable path does it on the device) and ``"skip"`` /
``"raise"`` are refused. Source: hardening.md §2 (nothing fails silently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen._warnings import warn_user
from gefen.amp import policy_name
from gefen.errors import ConfigError

__all__ = ["NONFINITE_POLICIES", "PendingCheck", "resolve_nonfinite", "skip_message"]

#: Accepted ``nonfinite`` values (``"ignore"``: deprecated name of ``"propagate"``).
NONFINITE_POLICIES = ("skip", "raise", "propagate")
_OLD_NAMES = {"ignore": "propagate"}


def resolve_nonfinite(
    kind: str, nonfinite: object, deterministic: bool, capturable: bool, skips_on_device: bool = False
) -> str:
    """The effective ``nonfinite`` policy of an optimizer, validated against the other policies.

    Args:
        kind: the optimizer's class name, for messages.
        nonfinite: the user's value: one of :data:`NONFINITE_POLICIES`, ``"ignore"`` (old name of
            ``"propagate"``, warns ``FutureWarning``) or ``None`` (``"raise"`` under ``deterministic=True``,
            ``"propagate"`` under ``capturable=True``, else ``"skip"``).
        deterministic, capturable: the optimizer's other policies.
        skips_on_device: the optimizer can decide ``"skip"`` on the device with its counters there (``Gefen`` on the
            Triton backend), so ``capturable=True`` may take ``nonfinite="skip"``.

    Returns:
        ``"skip"``, ``"raise"`` or ``"propagate"``.

    Raises:
        ConfigError: an unknown value; ``"propagate"`` with ``deterministic=True`` (a NaN step is not a
            reproducible step); ``"skip"``/``"raise"`` (or ``deterministic=True``) with ``capturable=True``, whose
            step may not read anything on the host.
    """
    if isinstance(nonfinite, str) and nonfinite in _OLD_NAMES:
        warn_user(
            f"{kind}(nonfinite={nonfinite!r}) is the old name of nonfinite={_OLD_NAMES[nonfinite]!r}; it will be "
            "removed in a future release.",
            FutureWarning,
        )
        nonfinite = _OLD_NAMES[nonfinite]
    if nonfinite is not None and nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"{kind} nonfinite={nonfinite!r} must be None, 'skip', 'raise' or 'propagate'.")
    if nonfinite is None:
        policy = "raise" if deterministic else "propagate" if capturable else "skip"
    else:
        policy = str(nonfinite)
    if deterministic and policy == "propagate":
        raise ConfigError(
            f"{kind}(deterministic=True) refuses to let non-finite gradients through (a NaN step is not a "
            "reproducible step); use nonfinite='raise' (the default there) or 'skip', or pass deterministic=False."
        )
    if capturable and policy != "propagate" and not (policy == "skip" and skips_on_device and not deterministic):
        why = policy_name(deterministic) if policy == "raise" else "nonfinite='skip'"
        raise ConfigError(
            f"{kind}(capturable=True) cannot honour {why}: deciding on NaN/Inf gradients needs a host read in "
            "step(), which a captured graph cannot run. Use capturable=False, or capturable=True with "
            "deterministic=False and nonfinite=None (use torch.amp.GradScaler to skip overflow steps)"
            + (", or nonfinite='skip' (decided on the device by the Triton backend)." if skips_on_device else ".")
        )
    return policy


def skip_message(kind: str, names: Sequence[str], skipped: int) -> str:
    """The warning of a skipped step.

    Args:
        kind: the optimizer's class name.
        names: the parameters whose gradients are not usable (on this rank; may be empty when only another
            rank of a sharded run saw them).
        skipped: the optimizer's ``skipped_steps`` after this one.
    """
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        where = f"the gradients of {shown} hold"
    else:
        where = "a gradient on another rank holds"
    return (
        f"{kind}: skipped this step because {where} NaN/Inf (or values whose squares overflow float32); nothing "
        f"was changed ({skipped} skipped step{'s' if skipped != 1 else ''} so far, see skipped_steps). Use "
        "nonfinite='raise' to stop instead, or find the source."
    )


@dataclass
class PendingCheck:
    """A step whose ``nonfinite="skip"`` decision was taken on the device (see the module docstring): its kernels
    wrote only if every flag was true; the host settles it later with :meth:`outcome`.

    Attributes:
        flags: (n,) bool per parameter of the step, on the host (pinned memory, filled by an asynchronous copy on
            CUDA, the device tensor itself on the CPU).
        names: the n parameters' names, in flag order.
        counters: the step counters (int64 CPU tensors) to advance when the step was applied.
        event: a ``torch.cuda.Event`` recorded after the copy into ``flags``, or ``None``.
    """

    flags: Tensor
    names: tuple[str, ...]
    counters: list[Tensor]
    event: Any = None

    @classmethod
    def of(cls, flags: Tensor, names: Sequence[str], counters: list[Tensor]) -> PendingCheck:
        """Start the host copy of the device ``flags`` ((n,) bool) without waiting for it."""
        if flags.device.type != "cuda":
            return cls(flags, tuple(names), counters)
        host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, tuple(names), counters, event)

    def ready(self) -> bool:
        """Whether :meth:`outcome` would return without waiting for the device."""
        return self.event is None or bool(self.event.query())

    def outcome(self) -> tuple[str, ...]:
        """Wait for the flags (only for the step's own check, not for later work) and return the names of the
        unusable gradients; empty when the step was applied. Advances the counters when it was."""
        if self.event is not None:
            self.event.synchronize()
        ok = self.flags.tolist()
        bad = tuple(name for name, flag in zip(self.names, ok) if not flag)
        if not bad and self.counters:
            torch._foreach_add_(self.counters, 1)
        return bad
