"""Cross-rank agreement before any collective: one rank's failure fails every rank, with the same message, and
nothing changes anywhere (hardening.md §5.5, §5.6).

A sharded optimizer (DTensor parameters) enters collectives in parameter order (period search, codebook
histogram, Muon's gathers); a rank that raised locally, skipped a parameter, or holds its parameters in another
order would leave its peers blocked in a collective forever. So before the first collective of a step (or before a
load is published) every rank contributes to **one fixed-size all-reduce**:

* whether it failed locally (closure, gradient checks, GradScaler controls, a checkpoint it cannot load);
* the count and a 62-bit digest of its ordered parameter identities (name, global shape, dtype);
* GradScaler's controls (present, overflow), which must agree;

and, only when those agree, a second all-reduce of the per-parameter gradient-presence vector (whose length is now
known to be equal everywhere). Every rank takes the same decision from the same reduced values, so either all go
on or all raise :class:`gefen.errors.StepError` (``CheckpointError`` for loads) with an identical message; the
details (the failing rank's message, the diverging names) are exchanged with ``all_gather_object`` only on that
failure path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gefen.errors import CheckpointError, StepError
from gefen.sharding import RowShard, collective_device, digest64

__all__ = ["agree"]


def agree(
    kind: str,
    phase: str,
    shard: RowShard,
    failure: BaseException | None,
    identity: Sequence[tuple[str, tuple[int, ...], str]] = (),
    presence: Sequence[bool] = (),
    amp: tuple[bool, bool] = (False, False),
    nonfinite: bool = False,
) -> tuple[bool, bool]:
    """Agree across the mesh of ``shard`` on a step or load, before any other collective (collective).

    Args:
        kind: optimizer class name, for messages.
        phase: ``"step"`` or ``"load_state_dict"``.
        shard: any :class:`~gefen.sharding.RowShard` of the optimizer (gives the mesh and process group).
        failure: this rank's local exception, or ``None``.
        identity: ordered ``(name, global shape, dtype)`` of the sharded parameters.
        presence: per entry of ``identity``, whether this rank has its gradient.
        amp: GradScaler controls ``(present, overflow)``.
        nonfinite: this rank found a NaN/Inf gradient that ``nonfinite="skip"`` skips the step for.

    Returns:
        ``(overflow, nonfinite)``: every rank saw a GradScaler overflow; some rank found a NaN/Inf gradient.
        Either way the step must be skipped on every rank.

    Raises:
        StepError: (``CheckpointError`` for ``phase="load_state_dict"``) on every rank, with the same message:
            a rank failed locally, the parameter order or identity differs, GradScaler's controls differ, or
            gradient presence differs. Nothing has been changed on any rank.
    """
    import torch.distributed as dist

    error = CheckpointError if phase == "load_state_dict" else StepError
    device, group, world = collective_device(shard), shard.group, shard.world
    high, low = digest64(identity)
    header = torch.tensor(
        [failure is not None, len(identity), high, low, amp[0], amp[1], nonfinite], dtype=torch.int64, device=device
    )
    both = torch.cat([header, -header])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    top, bottom = both[:7].tolist(), (-both[7:]).tolist()
    if top[0]:
        messages: list[Any] = [None] * world
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(messages, mine, group=group)
        rank = next(r for r, m in enumerate(messages) if m is not None)
        raise error(
            f"{kind}.{phase}() failed on rank {rank} of {world}, so every rank stops here with nothing changed "
            f"(no rank was left waiting in a collective): {messages[rank]}"
        ) from failure
    if top[1:4] != bottom[1:4]:
        lists: list[Any] = [None] * world
        dist.all_gather_object(lists, [f"{n} {tuple(s)} {d}" for n, s, d in identity], group=group)
        width = max(len(x) for x in lists)
        position = next(i for i in range(width) if len({x[i] if i < len(x) else "<none>" for x in lists}) > 1)
        seen = "; ".join(
            f"rank {r}: {x[position] if position < len(x) else '<no parameter>'}" for r, x in enumerate(lists)
        )
        raise error(
            f"{kind}.{phase}() refused: the sharded parameters differ across ranks at position {position} ({seen}). "
            "Every rank must build the optimizer from the same parameters in the same order (e.g. "
            "model.named_parameters() of the same model). Nothing was changed on any rank."
        )
    if top[4:6] != bottom[4:6]:
        raise error(
            f"{kind}.{phase}() refused: GradScaler's controls differ across ranks (present {bottom[4]}..{top[4]}, "
            f"overflow {bottom[5]}..{top[5]}); use one GradScaler per rank and step it on every rank (DTensor "
            "gradients share the overflow decision). Nothing was changed on any rank."
        )
    if presence:
        counts = torch.tensor([bool(p) for p in presence], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        bad = [(identity[i][0], int(c)) for i, c in enumerate(counts.tolist()) if c not in (0, world)]
        if bad:
            listed = ", ".join(f"{name} ({c}/{world} ranks have a gradient)" for name, c in bad[:5])
            raise error(
                f"{kind}.{phase}() refused: gradient presence differs across ranks: {listed}. A sharded "
                "parameter must have a gradient on every rank or on none (set_to_none / frozen parameters must "
                "agree). Nothing was changed on any rank."
            )
    return bool(top[5]), bool(top[6])
