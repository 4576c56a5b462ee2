"""Byte accounting and the per-parameter report of :class:`gefen.GefenMuonHybrid`, over its two halves.

A Gefen half (GefenMuon, or a Gefen backup) reports through its own ``state_bytes()`` and ``state_report()``
(:class:`gefen.optim._base.GefenOptimizer`); a torch backup (``torch.optim.AdamW``) is measured here,
as any torch optimizer is: the bytes of every tensor in its per-parameter state, ``step`` included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gefen.optim._base import GefenOptimizer, iter_named_params
from gefen.state import state_bytes

__all__ = ["half_state_bytes", "hybrid_state_report"]

#: What a torch backup's report row says in ``second_moment`` once it has state (AdamW's elementwise
#: ``exp_avg_sq``, the same shape and dtype as the parameter).
TORCH_SECOND_MOMENT = "elementwise (torch AdamW)"


def half_state_bytes(half: torch.optim.Optimizer) -> int:
    """Bytes of one half's persistent state: a Gefen half's own accounting (codebook included); for a torch
    optimizer, the bytes of every tensor in its per-parameter state (``step`` included)."""
    if isinstance(half, GefenOptimizer):
        return half.state_bytes()
    return sum(state_bytes(entry) for key, entry in half.state.items() if isinstance(key, Tensor))


def _torch_row(param: Tensor, entry: dict[str, Any]) -> dict[str, Any]:
    """A :meth:`GefenOptimizer.state_report` row for a parameter of a torch optimizer, with what applies: no
    period or block layout; the second moment and backend once it has state."""
    stepped = bool(entry)
    return {
        "shape": tuple(param.shape),
        "numel": param.numel(),
        "period": None,
        "second_moment": TORCH_SECOND_MOMENT if "exp_avg_sq" in entry else None,
        "layout": None,
        "state_bytes": state_bytes(entry),
        "backend": "torch" if stepped else None,
    }


def hybrid_state_report(
    groups: list[dict[str, Any]], halves: dict[str, torch.optim.Optimizer | None]
) -> list[dict[str, Any]]:
    """One row per parameter of the hybrid, in its ``param_groups`` order (a parameter listed again is reported
    once, where it first appears).

    Args:
        groups: the hybrid's list (in step with its halves).
        halves: ``{"muon": child or None, "backup": child or None}``.

    Returns:
        The keys of :meth:`GefenOptimizer.state_report` plus ``half`` (``"muon"`` or ``"backup"``); ``name`` is
        the parameter's name, else its place ``param_groups[g][i]`` in the hybrid's list. A torch backup's rows
        have ``period`` and ``layout`` ``None``, ``second_moment`` :data:`TORCH_SECOND_MOMENT` and ``backend``
        ``"torch"`` once the parameter has state.
    """
    rows_of: dict[int, tuple[str, dict[str, Any]]] = {}
    for half, child in halves.items():
        if child is None:
            continue
        if isinstance(child, GefenOptimizer):
            params = [p for _g, _i, p, _n in iter_named_params(child.param_groups)]
            for p, row in zip(params, child.state_report()):
                rows_of.setdefault(id(p), (half, row))
        else:
            for group in child.param_groups:
                for p in group["params"]:
                    rows_of.setdefault(id(p), (half, _torch_row(p, child.state.get(p, {}))))
    report = []
    seen: set[int] = set()
    for _g, _i, p, name in iter_named_params(groups):
        if id(p) in seen:
            continue
        seen.add(id(p))
        half, row = rows_of[id(p)]
        report.append({"name": name, **{k: v for k, v in row.items() if k != "name"}, "half": half})
    return report
