"""Sharded (FSDP2 / DTensor) parameters: which rows a rank holds, the sharded state layout, and the few
collectives the optimizers need.

Gefen supports the layout FSDP2's ``fully_shard`` produces: a DTensor on a 1-D ``DeviceMesh`` with one
``Shard(0)`` placement, rows split by ``torch.chunk`` arithmetic (``ceil(R / world)`` rows per rank, trailing ranks
possibly empty). Every optimizer's DTensor parameters must share one mesh.

**State layout.** The one layout rule of every parameter, sharded or not (:func:`gefen.math.period.layout_period`),
keeps blocks inside rows wherever rows are long enough: the period ``P`` divides the row length ``L = numel / R``, so
the ``k = L / P`` blocks of a row live on the rank that holds the row. The state of such a parameter is therefore
sharded exactly like the parameter, as DTensors on the same mesh with ``Shard(0)``:

==========================  ==========  =============  ==========================================
key                         dtype       global shape   meaning
==========================  ==========  =============  ==========================================
``first_moment_codes``      uint8       (R, k, P)      codebook indices
``first_moment_scale``      float32     (R, k)         per-block magnitude
``second_moment``           float32     (R, k)         block second moment (Gefen)
``normuon_v``               float32     (R,)           NorMuon row EMA (GefenMuon)
==========================  ==========  =============  ==========================================

Flattened, ``(R, k, P)`` is exactly the single-process ``(B, P)`` layout (``B = R·k``).

A short-rowed parameter (rows of at most 8 elements: 1-D biases and norm weights, ``(R, 1)`` columns) has blocks
spanning rows (:func:`gefen.math.period.spans_rows`; also a period saved under gefen's earlier free rule). Its
``first_moment_codes`` ``(B, P)``, ``first_moment_scale`` and ``second_moment`` ``(B,)`` are sharded by *blocks*
(``Shard(0)`` of the single-process shapes: ``ceil(B / world)`` blocks per rank, :class:`BlockShard`; NorMuon's
``(R,)`` stays sharded by rows). Its step gathers the full gradient and parameter (the blocks a rank holds cover other
ranks' rows), runs the ordinary kernels on the elements of this rank's blocks, and gathers the updated elements back so
every rank writes its own rows: two all-gathers per step for all such (small) tensors together, each block computed
exactly as in one process. So every shape keeps about one byte of state per element on each rank.

With either layout the codebook is learned from the histogram summed over all ranks, so the state does not depend on
the world size:
``torch.distributed.checkpoint`` reshards it N → M like any DTensor, and a full (gathered) state loads into a single
process. Source: hardening.md §5.2 (FSDP2 stepping), with the rank-independent layout as Gefen's design.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gefen.errors import ConfigError
from gefen.math.period import spans_rows
from gefen.state import (
    FIRST_MOMENT_CODES,
    FIRST_MOMENT_SCALE,
    NORMUON_STEP,
    NORMUON_V,
    SECOND_MOMENT,
    SECOND_MOMENT_ROW,
    SecondMomentKind,
)

__all__ = [
    "RowShard",
    "BlockShard",
    "state_shard",
    "gather_blocks",
    "gather_rows_many",
    "gather_block_jobs_",
    "write_block_jobs_",
    "is_dtensor",
    "row_shard",
    "local",
    "chunk_rows",
    "sharded_shape",
    "as_sharded",
    "gather_rows",
    "mesh_key",
    "digest64",
    "SHARDED_KEYS",
]

#: State keys whose tensors are sharded by rows (DTensors with ``Shard(0)``) for a sharded parameter.
SHARDED_KEYS = (FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE, SECOND_MOMENT, NORMUON_V, SECOND_MOMENT_ROW)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (no import of torch.distributed needed)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of rank ``rank`` when ``rows`` are split like ``torch.chunk`` (DTensor ``Shard(0)``).

    Returns:
        ``(start, stop)``, ``start == stop`` for an empty shard.
    """
    size = -(-rows // world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class RowShard:
    """The rows of a ``Shard(0)`` DTensor parameter held by this rank.

    Attributes:
        mesh: the 1-D ``DeviceMesh``.
        group: its process group.
        rank: this rank's coordinate on the mesh.
        world: the mesh size.
        shape: the parameter's global shape.
        start, stop: global rows ``[start, stop)`` held here.
    """

    mesh: Any
    group: Any
    rank: int
    world: int
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Global row count ``R`` (dim 0)."""
        return self.shape[0]

    @property
    def row_length(self) -> int:
        """Elements per row ``L = numel / R``."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    def chunk(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of another rank of the mesh."""
        return chunk_rows(self.rows, self.world, rank)


@dataclass(frozen=True)
class BlockShard:
    """The blocks this rank holds of a sharded parameter whose blocks straddle rows (see the module docstring).

    Attributes:
        rows: the parameter's rows held here (its :class:`RowShard`).
        blocks: the blocks held here, as a :class:`RowShard` of the ``(B, P)`` block matrix (``torch.chunk``
            arithmetic over ``B``: ``[start, stop)`` blocks).
        period: the block period ``P``.
    """

    rows: RowShard
    blocks: RowShard
    period: int

    @property
    def world(self) -> int:
        """The mesh size."""
        return self.rows.world

    @property
    def group(self) -> Any:
        """The mesh's process group."""
        return self.rows.group

    @property
    def elements(self) -> tuple[int, int]:
        """Flat elements ``[start, stop)`` of the parameter covered by this rank's blocks."""
        return self.blocks.start * self.period, self.blocks.stop * self.period


def state_shard(shard: RowShard, period: int) -> RowShard | BlockShard:
    """How a sharded parameter's block state is split: by rows (``shard`` itself) when ``period`` divides its row
    length, by blocks (a :class:`BlockShard`) when its blocks straddle rows (:func:`gefen.math.period.spans_rows`)."""
    if not spans_rows(shard.shape, period):
        return shard
    n_blocks = 1
    for d in shard.shape:
        n_blocks *= d
    n_blocks //= period
    start, stop = chunk_rows(n_blocks, shard.world, shard.rank)
    blocks = RowShard(shard.mesh, shard.group, shard.rank, shard.world, (n_blocks, period), start, stop)
    return BlockShard(shard, blocks, period)


def mesh_key(mesh: Any) -> tuple[Any, ...]:
    """A content key of a ``DeviceMesh`` (device type, shape and ranks): equal meshes compare equal even when
    they are distinct objects."""
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()))


def row_shard(param: Tensor, where: str) -> RowShard | None:
    """The :class:`RowShard` of a DTensor parameter, ``None`` for a plain tensor.

    Raises:
        ConfigError: a DTensor layout Gefen does not step: a mesh that is not 1-D, a placement other than one
            ``Shard(0)``, a 0-dim parameter, or a local shard that does not hold the ``torch.chunk`` rows.
    """
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ConfigError(
            f"{where} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; Gefen steps FSDP2's layout "
            "only: one Shard(0) placement on a 1-D mesh (fully_shard without tensor parallelism or HSDP)."
        )
    if param.dim() == 0:
        raise ConfigError(f"{where} is a 0-dim DTensor; a Shard(0) parameter has at least one dimension.")
    rank, world = mesh.get_local_rank(), mesh.size()
    shape = tuple(param.shape)
    start, stop = chunk_rows(shape[0], world, rank)
    local_shape = tuple(param.to_local().shape)
    if local_shape != (stop - start, *shape[1:]):
        raise ConfigError(
            f"{where}: this rank's shard has shape {local_shape}, but Shard(0) over {world} ranks gives rows "
            f"[{start}, {stop}) of {shape}; Gefen needs torch.chunk row splits (FSDP2's default)."
        )
    return RowShard(mesh, mesh.get_group(), rank, world, shape, start, stop)


def local(tensor: Tensor) -> Tensor:
    """The local part of a DTensor (a view sharing its storage), or ``tensor`` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def sharded_shape(key: str, shape: tuple[int, ...], period: int, rows: int, spanning: bool = False) -> tuple[int, ...]:
    """Global shape of sharded state ``key`` for a single-process shape ``shape`` (``(B, P)``, ``(B,)`` or
    ``(R,)``) of a parameter with ``rows`` rows: ``(R, k, P)``, ``(R, k)`` or ``(R,)``; with ``spanning`` (blocks
    straddle rows, sharded by blocks: see the module docstring) the single-process shape itself."""
    if key in (NORMUON_V, SECOND_MOMENT_ROW):
        return (rows,)
    if spanning:
        return tuple(shape)
    blocks_per_row = shape[0] // rows
    return (rows, blocks_per_row, period) if key == FIRST_MOMENT_CODES else (rows, blocks_per_row)


def as_sharded(local_tensor: Tensor, shard: RowShard, global_shape: tuple[int, ...]) -> Tensor:
    """Wrap this rank's rows ``local_tensor`` (shape ``(stop − start,) + global_shape[1:]``) as a ``Shard(0)``
    DTensor of ``global_shape`` on the parameter's mesh (no communication)."""
    from torch.distributed.tensor import DTensor, Shard

    stride = []
    acc = 1
    for d in reversed(global_shape):
        stride.append(acc)
        acc *= d
    return DTensor.from_local(
        local_tensor,
        shard.mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(global_shape),
        stride=tuple(reversed(stride)),
    )


def _padded(local_rows: Tensor, shard: RowShard) -> Tensor:
    """This rank's rows zero-padded to the ``ceil(R / world)`` rows every rank sends (collectives need equal
    sizes; trailing shards may be shorter or empty)."""
    padded = local_rows.new_zeros((-(-shard.rows // shard.world), *local_rows.shape[1:]))
    padded[: local_rows.shape[0]] = local_rows
    return padded


def _unpadded(parts: list[Tensor], shard: RowShard) -> Tensor:
    """The full tensor from every rank's padded rows (inverse of :func:`_padded` over the ranks)."""
    return torch.cat([part[: stop - start] for part, (start, stop) in zip(parts, map(shard.chunk, range(shard.world)))])


def gather_rows(local_rows: Tensor, shard: RowShard) -> Tensor:
    """All-gather the rows of every rank into the full ``(R,) + local_rows.shape[1:]`` tensor (collective: every
    rank of the mesh must call it, in the same order). It travels on :func:`collective_device` and comes back on
    ``local_rows``' device."""
    import torch.distributed as dist

    padded = _padded(local_rows, shard).to(collective_device(shard))
    parts = [torch.empty_like(padded) for _ in range(shard.world)]
    dist.all_gather(parts, padded, group=shard.group)
    return _unpadded(parts, shard).to(local_rows.device)


def gather_rows_to(local_rows: Tensor, shard: RowShard, owner: int) -> Tensor | None:
    """Gather every rank's rows on mesh rank ``owner`` only (collective, on :func:`collective_device`). Returns
    the full tensor on the owner (on ``local_rows``' device), ``None`` elsewhere."""
    import torch.distributed as dist

    padded = _padded(local_rows, shard).to(collective_device(shard))
    dst = dist.get_global_rank(shard.group, owner)
    if shard.rank != owner:
        dist.gather(padded, None, dst=dst, group=shard.group)
        return None
    parts = [torch.empty_like(padded) for _ in range(shard.world)]
    dist.gather(padded, parts, dst=dst, group=shard.group)
    return _unpadded(parts, shard).to(local_rows.device)


def scatter_rows_from(full: Tensor | None, like: Tensor, shard: RowShard, owner: int) -> Tensor:
    """Scatter the rows of ``full`` (given on mesh rank ``owner``) so each rank receives its own rows
    (collective, on :func:`collective_device`). ``like`` gives the dtype, device and trailing shape. Returns this
    rank's rows."""
    import torch.distributed as dist

    device = collective_device(shard)
    out = _padded(like[:0], shard).to(device)
    src = dist.get_global_rank(shard.group, owner)
    parts = None
    if shard.rank == owner:
        assert full is not None
        parts = [_padded(full[start:stop], shard).to(device) for start, stop in map(shard.chunk, range(shard.world))]
    dist.scatter(out, parts, src=src, group=shard.group)
    return out[: shard.stop - shard.start].to(like.device)


def _gathered(local_rows: Tensor, shard: RowShard) -> Tensor:
    """:func:`gather_rows` of ``local_rows`` in its own dtype, through float32 for 16-bit floats (exact both ways;
    not every backend all-gathers them)."""
    if local_rows.dtype in (torch.float16, torch.bfloat16):
        return gather_rows(local_rows.float(), shard).to(local_rows.dtype)
    return gather_rows(local_rows, shard)


def gather_blocks(local_blocks: Tensor, shard: BlockShard) -> Tensor:
    """All-gather the elements of every rank's blocks: the full flat tensor of ``B·P`` elements (collective).

    Args:
        local_blocks: this rank's blocks' elements, any shape with ``(stop − start)·P`` elements.
        shard: the parameter's :class:`BlockShard`.
    """
    return _gathered(local_blocks.reshape(-1, shard.period), shard.blocks).reshape(-1)


def gather_rows_many(pieces: Sequence[tuple[Tensor, RowShard]]) -> list[Tensor]:
    """:func:`gather_rows` of several row-sharded tensors of one mesh in one all-gather per wire dtype (16-bit floats
    travel as float32, exactly), instead of one per tensor (collective; every rank passes the same list).

    Args:
        pieces: ``(local_rows, shard)`` pairs, ``local_rows`` of shape ``(stop − start,) + trailing``; every
            ``shard`` on the same mesh. They travel on :func:`collective_device`.

    Returns:
        The full tensors ``(R,) + trailing``, in the pieces' order, dtypes and devices.
    """
    import torch.distributed as dist

    out: list[Tensor | None] = [None] * len(pieces)
    wires: dict[torch.dtype, list[int]] = {}
    for i, (rows, _) in enumerate(pieces):
        wire = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
        wires.setdefault(wire, []).append(i)
    for wire, indices in wires.items():  # insertion order: the same on every rank
        shard = pieces[indices[0]][1]
        padded = [_padded(pieces[i][0], pieces[i][1]) for i in indices]
        flat = torch.cat([part.reshape(-1).to(wire) for part in padded]).to(collective_device(shard))
        parts = [torch.empty_like(flat) for _ in range(shard.world)]
        dist.all_gather(parts, flat, group=shard.group)
        offset = 0
        for i, part in zip(indices, padded):
            rows, piece_shard = pieces[i]
            size = part.numel()
            chunks = [gathered[offset : offset + size].view(part.shape) for gathered in parts]
            out[i] = _unpadded(chunks, piece_shard).to(rows.device, rows.dtype)
            offset += size
    return [tensor for tensor in out if tensor is not None]


def gather_block_jobs_(jobs: Sequence[Any]) -> None:
    """Give every job of a parameter sharded by blocks (``job.shard`` a :class:`BlockShard`) the tensors its backend
    steps: the elements of this rank's blocks of the parameter (``job.target``, a fresh tensor the update writes) and
    of its gradient (``job.grad``), both 1-D, from one all-gather of every such parameter's and gradient's rows
    (:func:`gather_rows_many`). Send the targets back with :func:`write_block_jobs_` once they are updated.

    Args:
        jobs: :class:`gefen.kernels.backends.StepJob` s, in the same order on every rank (collective); the others
            are left as they are.
    """
    blocked = [job for job in jobs if isinstance(job.shard, BlockShard)]
    if not blocked:
        return
    pieces = [(job.grad, job.shard.rows) for job in blocked]
    pieces += [(local(job.param).detach(), job.shard.rows) for job in blocked]
    full = gather_rows_many(pieces)
    for k, job in enumerate(blocked):
        start, stop = job.shard.elements
        job.grad = full[k].reshape(-1)[start:stop]
        job.target = full[len(blocked) + k].reshape(-1)[start:stop]


def write_block_jobs_(jobs: Sequence[Any]) -> None:
    """Gather every rank's updated block elements of the jobs sharded by blocks (their ``target`` of
    :func:`gather_block_jobs_`) in one all-gather and write this rank's rows of each parameter from them
    (collective; the same jobs in the same order on every rank)."""
    blocked = [job for job in jobs if isinstance(job.shard, BlockShard)]
    if not blocked:
        return
    full = gather_rows_many([(job.target.view(-1, job.shard.period), job.shard.blocks) for job in blocked])
    for job, updated in zip(blocked, full):
        rows = job.shard.rows
        here = local(job.param).detach()
        here.copy_(updated.reshape(-1)[rows.start * rows.row_length : rows.stop * rows.row_length].view(here.shape))


def collective_device(shard: RowShard) -> torch.device:
    """Where a collective's tensors live on the mesh of ``shard``: the current CUDA device for a CUDA mesh
    (NCCL), else the CPU (gloo).

    Every collective of the optimizers goes through it, whatever device the local shards are on: under FSDP2's
    ``CPUOffloadPolicy`` a CUDA mesh holds CPU shards (stepped on the CPU), and its process group may have no CPU
    backend (``init_process_group("nccl")``), so their pieces travel on the GPU and come back. On a CPU mesh, and
    for shards already on the mesh's device, the moves are no-ops."""
    if shard.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's state with this rank's rows of every sharded tensor, in the single-process shapes
    (``(B_local, P)``, ``(B_local,)``, ``(R_local,)``) and sharing their storage; plain states are returned as
    they are."""
    codes = state.get(FIRST_MOMENT_CODES)
    if codes is None or not is_dtensor(codes):
        return state
    view = dict(state)
    period = codes.shape[-1]
    for key in SHARDED_KEYS:
        if key in view:
            rows = view[key].to_local()
            view[key] = rows.view(-1, period) if key == FIRST_MOMENT_CODES else rows.reshape(-1)
    return view


def init_sharded_state(target: Tensor, shard: RowShard, period: int, kind: Any, zero_code: int) -> dict[str, Any]:
    """Fresh state of a sharded parameter: :func:`gefen.state.init_state` of this rank's rows ``target``, its
    row-sharded tensors wrapped as ``Shard(0)`` DTensors of their global shapes (see the table above).

    Args:
        target: this rank's rows of the parameter, ``(R_local,) + shape[1:]``.
        shard: the parameter's :class:`RowShard`.
        period: ``P`` dividing ``numel`` (blocks straddling rows are sharded by blocks: see the module docstring).
        kind: second-moment kind (``"block"``, ``"factored"``, ``"momentum"`` or ``"momentum_normuon"``).
        zero_code: index of the codebook's exact zero.
    """
    from gefen.state import init_state, normuon_state, state_spec

    split = state_shard(shard, period)
    rows_here = shard.stop - shard.start
    if isinstance(split, BlockShard):  # blocks straddle rows: the block tensors are sharded by blocks
        blocks_here = split.blocks.stop - split.blocks.start
        # this rank's blocks as a parameter of its own (a 1-D stand-in: the block and momentum kinds need no shape)
        stand_in = target.new_empty(blocks_here * period)
        own_kind: SecondMomentKind = "momentum" if kind == "momentum_normuon" else kind
        state: dict[str, Any] = init_state(stand_in, period, own_kind, zero_code)
        spec = state_spec(shard.shape, period, kind)
        for key in SHARDED_KEYS:
            if key in state:
                state[key] = as_sharded(state[key], split.blocks, spec[key].shape)
        if kind == "momentum_normuon":  # NorMuon's row statistics stay with the rows
            normuon = normuon_state(rows_here, target.device, None)
            state[NORMUON_V] = as_sharded(normuon[NORMUON_V], shard, (shard.rows,))
            state[NORMUON_STEP] = normuon[NORMUON_STEP]
        return state
    state = init_state(target, period, kind, zero_code)
    blocks_per_row = shard.row_length // period
    for key in SHARDED_KEYS:
        if key in state:
            full = sharded_shape(key, (shard.rows * blocks_per_row, period), period, shard.rows)
            state[key] = as_sharded(state[key].reshape((rows_here, *full[1:])), shard, full)
    return state


def all_reduce_(tensor: Tensor, group: Any, op: str = "sum") -> Tensor:
    """In-place all-reduce (``"sum"`` or ``"max"``) over ``group``; returns ``tensor``."""
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def digest64(items: Sequence[object]) -> tuple[int, int]:
    """A stable 62-bit digest of ``repr(items)`` as two non-negative 31-bit ints (fit any integer collective)."""
    h = int.from_bytes(hashlib.sha256(repr(list(items)).encode()).digest()[:8], "big")
    return (h >> 33) & 0x7FFFFFFF, (h >> 2) & 0x7FFFFFFF
