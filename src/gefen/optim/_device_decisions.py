"""The steps an optimizer decided on the device (``nonfinite="skip"`` without a host read), and their settlement on
the host: one mixin of :class:`gefen.optim._base.GefenOptimizer`.

Two kinds (see :mod:`gefen.nonfinite`): a step whose usable flags are copied back asynchronously
(:class:`gefen.nonfinite.PendingCheck`, the host counters advanced when it settles), and under ``capturable=True`` a
step counted on the device itself (the state's device counters advanced by the kernels, the skips in a device
counter folded into :attr:`skipped_steps` when the host looks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from gefen._warnings import warn_user

if TYPE_CHECKING:
    from gefen.nonfinite import PendingCheck

__all__ = ["DeviceDecisions"]


class DeviceDecisions:
    """Settlement of device-decided steps. Needs the optimizer's ``kind``, ``_skipped_steps``, ``_global_step_t``,
    ``_skipped_t``, ``_record_skip`` and ``_advance_global_step``; keeps ``_pending_checks`` (oldest first)."""

    _pending_checks: list[PendingCheck]
    _skipped_t: Tensor | None
    _global_step_t: Tensor | None
    _skipped_steps: int
    kind: str

    def _settle_pending_check(self, wait: bool = True) -> bool:
        """Settle the steps whose ``nonfinite="skip"`` decision was taken on the device (see
        :class:`gefen.nonfinite.PendingCheck`), oldest first: advance their counters and the global step, or count
        and warn about the skip. Called wherever the host looks (``skipped_steps``, ``global_step``, checkpoints),
        and at the start of each step.

        Args:
            wait: ``True``: settle every pending step, waiting for the device where needed. ``False``: settle only
                those whose flags have arrived (:meth:`~gefen.nonfinite.PendingCheck.ready`) and stop at the first
                that has not: no host wait (a steady Triton step; its counters are on the device).

        Returns:
            ``False`` when the last step settled was skipped; ``True`` otherwise (also when there was none).
        """
        from gefen.optim._base import StepSkip  # the base class imports this module

        pending = self.__dict__.setdefault("_pending_checks", [])
        if wait:
            self._fold_device_skips()
        applied = True
        while pending and (wait or pending[0].ready()):
            bad = pending.pop(0).outcome()
            if bad:
                self._record_skip(StepSkip(nonfinite=True, names=bad))
            else:
                self._advance_global_step()
            applied = not bad
        return applied

    def _count_on_device(self, applied: Tensor) -> None:
        """``capturable=True``: count a step decided on the device (``applied``: 0-dim int32, 1 when applied) in
        the device counters, with no host read (a CUDA graph replays it)."""
        assert self._global_step_t is not None and self._skipped_t is not None
        self._global_step_t.add_(applied)
        self._skipped_t.add_(1 - applied)

    def _fold_device_skips(self) -> None:
        """Move the steps skipped on the device (``capturable=True``) into :attr:`skipped_steps`, with one warning
        for them (one host read; the parameters are not named: under capture the host saw none of those steps)."""
        counter = self.__dict__.get("_skipped_t")
        if counter is None:
            return
        skipped = int(counter)
        if skipped:
            counter.zero_()
            self._skipped_steps += skipped
            warn_user(
                f"{self.kind}: {skipped} step(s) were skipped on the device because a gradient held NaN/Inf "
                f"(capturable=True decides there, so the parameters are not named); nothing was changed by them "
                f"({self._skipped_steps} skipped steps so far, see skipped_steps)."
            )
