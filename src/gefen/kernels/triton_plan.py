"""A multi-tensor Gefen step in Triton: validated, reusable launch plans over many parameters.

:func:`build_plan` checks a list of :class:`TritonJob` (one parameter's step, or GefenMuon's momentum, each) and
builds the device tables once: the tensors' addresses, per-job metadata, the statistics items and the update work
items (whole blocks of one job each), grouped by period class. :meth:`TritonPlan.run` then launches a fixed number of
kernels per step however many jobs there are (a statistics pass, a finalize pass, one update launch per period class:
see :mod:`gefen.kernels._triton_kernels`), takes every decision on the device (no host read) and returns the per-job
usable flags as a device tensor.

Semantics: those of :func:`gefen.kernels.eager.reference_step` and the native library
(:mod:`gefen.kernels.native`): codes and magnitudes bit-identical; second moments from float64 sums of the fp32
squares, each mean rounded once (the block mean may differ from the reference's fp32 sum by a few ulps, the factored
moments equal the native library's up to float64 ties); the block step size multiplies ``sqrt(v)`` by the fp32
reciprocal of ``sqrt(bc2)`` as the native library and torch on CUDA do (torch 2.13's CPU eager reference divides, one
rounding apart); parameters written once, ``fma(d, step, p·decay)``, round to nearest even. The per-step
constants are computed on the device in float64 from the group table and the job's step counter, as
``gefen.kernels.scalars.derive`` does on the host, and rounded to fp32 once; ``beta ** t`` is an exact-product
binary exponentiation (:func:`gefen.kernels._triton_kernels.pow_int`, within 2 float64 ulps of Python's, measured).

This module owns the plan; choosing the backend, the optimizer state and the param groups are the caller's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from gefen.amp import usable_bound
from gefen.kernels import _triton_kernels as kernels

__all__ = ["GROUP_FIELDS", "TritonJob", "TritonPlan", "build_plan"]

#: Columns of the (G, 5) float64 group table passed to :meth:`TritonPlan.run`.
GROUP_FIELDS = kernels.GROUP_COLUMNS
_KINDS = {"block": 0, "factored": 1, "momentum": 2}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Elements of one update tile (``BB`` blocks × ``PB`` lanes); periods above it loop over a block in such tiles.
_TILE = 2048
#: Statistics tiles: ``_STAT_RB`` rows × ``_STAT_CB`` columns (factored), ``_TILE`` elements (the check).
_STAT_RB, _STAT_CB = 8, 256
#: Elements of one usability-check item of a block or momentum job.
_CHECK_ELEMENTS = 1 << 16
#: Entries per tile of the finalize kernel.
_FINALIZE_TILE = 1024


@dataclass
class TritonJob:
    """One parameter's step (``"block"``, ``"factored"``) or GefenMuon's momentum (``"momentum"``).

    Attributes:
        kind: ``"block"`` (algorithm.md §6.2), ``"factored"`` (§6.4) or ``"momentum"`` (§7.1 step 2).
        grad: (N,) contiguous gradient, fp32/bf16/fp16 (any shape with N elements is read flat).
        codes: uint8, N elements, contiguous ((B, P) or (N,)); updated.
        scale: (B,) fp32 block magnitudes, ``B = N // period``; updated.
        period: ``P >= 1``, dividing ``N``.
        group: the row of the group table holding this job's hyperparameters.
        param: (N,) contiguous parameter, fp32/bf16/fp16 (block and factored); updated.
        second: ``(v,)`` (B,) fp32 (block) or ``(v_row (R,), v_col (C,))`` fp32 (factored); updated.
        shape: ``(R, C)`` of a factored parameter, ``R·C = N``.
        out: (N,) fp32 receiving ``m̂`` (momentum only).
        counter: int64 one-element step counter on the device, the count *before* this step (``t = counter + 1``);
            incremented by the step iff it is applied. Required for block and factored jobs.
    """

    kind: str
    grad: Tensor
    codes: Tensor
    scale: Tensor
    period: int
    group: int
    param: Tensor | None = None
    second: tuple[Tensor, ...] = ()
    shape: tuple[int, int] = (0, 0)
    out: Tensor | None = None
    counter: Tensor | None = None

    def tensors(self) -> list[Tensor | None]:
        """Every tensor of the job in a fixed order (None where absent), for :meth:`TritonPlan.matches`."""
        return [self.grad, self.codes, self.scale, self.param, *self.second, self.out, self.counter]


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_job(index: int, job: TritonJob, device: torch.device) -> None:
    """Raise ValueError (naming ``jobs[index]``) for anything that would make a kernel read or write out of bounds."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"build_plan: jobs[{index}] ({job.kind!r}): {what}")

    def plain(t: object, name: str, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
        need(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}")
        assert isinstance(t, Tensor)
        need(t.device == device, f"{name} is on {t.device}, the codebook on {device}; move it to {device}")
        need(t.is_contiguous(), f"{name} must be contiguous; pass {name}.contiguous() and copy back")
        need(t.dtype in dtypes, f"{name} dtype {t.dtype} must be one of {[str(d) for d in dtypes]}")
        need(t.numel() == numel, f"{name} has {t.numel()} elements, expected {numel}")

    need(job.kind in _KINDS, f"kind must be one of {sorted(_KINDS)}")
    need(isinstance(job.grad, Tensor), "grad must be a tensor")
    numel = job.grad.numel()
    period = job.period
    need(isinstance(period, int) and period >= 1 and numel > 0 and numel % period == 0,
         f"period={period} must be an int >= 1 dividing numel={numel} > 0")  # fmt: skip
    need(isinstance(job.group, int) and job.group >= 0, f"group={job.group} must be an int >= 0")
    plain(job.grad, "grad", tuple(_DTYPES), numel)
    plain(job.codes, "codes", (torch.uint8,), numel)
    plain(job.scale, "scale", (torch.float32,), numel // period)
    if job.counter is not None or job.kind != "momentum":
        need(job.counter is not None, "counter is required (the step count before this step, int64)")
        plain(job.counter, "counter", (torch.int64,), 1)
    if job.kind == "momentum":
        need(job.param is None and not job.second, "a momentum job has no param and no second moment")
        plain(job.out, "out", (torch.float32,), numel)
        return
    need(job.out is None, "out is only for momentum jobs")
    plain(job.param, "param", tuple(_DTYPES), numel)
    if job.kind == "block":
        need(len(job.second) == 1, f"second must be (v,), got {len(job.second)} tensors")
        plain(job.second[0], "second[0] (v)", (torch.float32,), numel // period)
        return
    rows, cols = job.shape
    need(rows > 0 and cols > 0 and rows * cols == numel, f"shape={job.shape} must be (R, C) with R·C = {numel}")
    need(len(job.second) == 2, f"second must be (v_row, v_col), got {len(job.second)} tensors")
    plain(job.second[0], "second[0] (v_row)", (torch.float32,), rows)
    plain(job.second[1], "second[1] (v_col)", (torch.float32,), cols)


def _check_disjoint(jobs: list[TritonJob]) -> None:
    """Raise ValueError when two written tensors (of one job or two) share memory: their updates would race."""
    spans = []
    for i, job in enumerate(jobs):
        named = [("codes", job.codes), ("scale", job.scale), ("param", job.param), ("out", job.out)]
        named += [(f"second[{k}]", t) for k, t in enumerate(job.second)] + [("counter", job.counter)]
        for name, t in named:
            if t is not None:
                start = t.data_ptr()
                spans.append((start, start + t.numel() * t.element_size(), i, name))
    spans.sort()
    for (_, end, i, name), (start, _, j, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(
                f"build_plan: jobs[{i}].{name} and jobs[{j}].{other} overlap in memory; every written tensor "
                "(codes, scale, param, second, out, counter) must be its own storage"
            )


def _check_tables(codebook: Tensor, lut: Tensor, thresholds: Tensor, steps: int) -> None:
    """Raise ValueError for nearest-code tables of the wrong size, dtype or device, or a lut that indexes outside."""
    if not isinstance(steps, int) or not 0 <= steps <= 255:
        raise ValueError(f"build_plan: steps={steps} must be an int in [0, 255] (NearestCodeTable.steps)")
    for name, t, dtype, numel in (
        ("codebook", codebook, torch.float32, 256),
        ("lut", lut, torch.int32, 4097),
        ("thresholds", thresholds, torch.float32, 255 + steps),
    ):
        if not isinstance(t, Tensor) or t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"build_plan: {name} must be a contiguous {dtype} tensor of {numel} elements")
        if t.device != codebook.device:
            raise ValueError(f"build_plan: {name} is on {t.device}, the codebook on {codebook.device}")
    host = lut.cpu()  # once per plan: the kernels trust the table (as the native library checks it)
    if bool((host < 0).any() | (host > 255).any() | (host[1:] < host[:-1]).any()):
        raise ValueError("build_plan: lut must be non-decreasing with values in [0, 255] (build_nearest_table)")


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class _Launch:
    """One update launch: a period class and its slice of the work table."""

    start: int
    count: int
    lanes: int  # PB
    blocks: int  # BB
    loop: bool


class TritonPlan:
    """The device tables of one list of jobs, reusable while :meth:`matches` holds (built by :func:`build_plan`).

    Attributes:
        n_jobs: number of jobs.
        applied: 0-dim int32 on the device after a :meth:`run`: 1 if that step was applied (None before any run).
        launches: update launches per run (one per period class); a run launches ``launches + 2`` kernels with
            ``check=True`` (statistics, finalize, updates), and ``launches + 1`` with ``check=False`` when no job is
            factored (no statistics pass is needed then).
        scratch_bytes: bytes of the plan's device scratch (statistics sums, roots, flags, constants, tables).
    """

    def __init__(
        self,
        jobs: list[TritonJob],
        tables: tuple[Tensor, Tensor, Tensor],
        steps: int,
        device_tables: dict[str, Tensor],
        stat_items: tuple[int, int],
        launches: list[_Launch],
        max_group: int,
    ) -> None:
        self._jobs = list(jobs)
        self._signature = _signature(jobs)
        self._tables = tables
        self._steps = steps
        self._t = device_tables
        self._factored_items, self._stat_items = stat_items
        self._launches = launches
        self._max_group = max_group
        self.n_jobs = len(jobs)
        self.applied: Tensor | None = None
        self.launches = len(launches)
        self.scratch_bytes = sum(t.numel() * t.element_size() for t in device_tables.values())

    def matches(self, jobs: list[TritonJob]) -> bool:
        """Whether ``jobs`` are the same tensors (address, numel, dtype), kinds, periods, groups and shapes, in the
        same order: then this plan can run them (the tables hold addresses)."""
        return len(jobs) == len(self._jobs) and _signature(jobs) == self._signature

    def run(self, groups: Tensor, *, check: bool) -> Tensor:
        """One step of every job, launched on the jobs' device; no host read, no synchronisation.

        Args:
            groups: (G, 5) float64 on the device, columns :data:`GROUP_FIELDS`; ``G`` > every job's ``group``.
            check: apply the step only if every job's gradient is usable (finite, ``|g| <= usable_bound(N)`` in
                fp32); otherwise nothing at all is written (state, parameters, ``out``, counters). The decision is
                taken on the device. ``False``: always applied.

        Returns:
            (n_jobs,) int32 on the device, a new tensor per run: 1 where the job's gradient is usable (all 1 when
            ``check=False``). :attr:`applied` holds this run's decision.

        Raises:
            ValueError: ``groups`` has the wrong dtype, shape, layout or device (checked from its metadata only).
        """
        t = self._t
        device = t["meta"].device
        if (
            not isinstance(groups, Tensor)
            or groups.dtype != torch.float64
            or groups.dim() != 2
            or groups.shape[1] != len(GROUP_FIELDS)
            or groups.shape[0] <= self._max_group
            or groups.device != device
            or not groups.is_contiguous()
        ):
            raise ValueError(
                f"TritonPlan.run: groups must be a contiguous (G, {len(GROUP_FIELDS)}) float64 tensor on {device} "
                f"with G > {self._max_group} (columns {GROUP_FIELDS}), got "
                f"{getattr(groups, 'dtype', type(groups))} {tuple(getattr(groups, 'shape', ()))}"
            )
        flags = torch.empty(self.n_jobs, dtype=torch.int32, device=device)
        applied = torch.empty((), dtype=torch.int32, device=device)
        for kernel, grid, args, options in self._launches_of(groups, check, flags, applied):
            kernel[grid](*args, **options)
        self.applied = applied
        return flags

    def compile(self) -> None:
        """Compile every kernel of :meth:`run`, with and without the check, for this plan's arguments, without
        launching anything: a kernel that cannot be built for this device fails here, before the optimizer writes
        anything (Triton's JIT would otherwise compile at the first launch, half-way through a step). Compiled
        kernels are cached by Triton (in memory and on disk), so later plans of the same shapes compile nothing. Under
        the interpreter it is a no-op.

        Raises:
            Exception: whatever Triton's compiler raised.
        """
        device = self._t["meta"].device
        groups = torch.zeros(self._max_group + 1, len(GROUP_FIELDS), dtype=torch.float64, device=device)
        flags = torch.empty(self.n_jobs, dtype=torch.int32, device=device)
        applied = torch.empty((), dtype=torch.int32, device=device)
        for check in (False, True):
            for kernel, grid, args, options in self._launches_of(groups, check, flags, applied):
                kernel.warmup(*args, grid=grid, **options)

    def _launches_of(
        self, groups: Tensor, check: bool, flags: Tensor, applied: Tensor
    ) -> list[tuple[object, tuple[int], tuple[object, ...], dict[str, object]]]:
        """The kernel launches of one run: ``(kernel, grid, positional arguments, keyword arguments)``."""
        t = self._t
        codebook, lut, thresholds = self._tables
        fp = {"enable_fp_fusion": False}
        launches: list[tuple[object, tuple[int], tuple[object, ...], dict[str, object]]] = []
        stat_count = self._stat_items if check else self._factored_items
        if stat_count:
            launches.append((
                kernels.stats_kernel, (stat_count,),
                (t["stat_items"], t["meta"], t["addrs"], t["bounds"], t["chunk_ok"], t["row_part"], t["col_part"],
                 t["seq"], t["bad"]),
                {"CHECK": check, "RB": _STAT_RB, "CB": _STAT_CB, "TILE": _TILE, **fp},
            ))  # fmt: skip
        launches.append((
            kernels.finalize_kernel, (self.n_jobs,),
            (t["meta"], t["addrs"], groups, t["consts"], t["chunk_ok"], flags, applied, t["row_part"], t["col_part"],
             t["row_root"], t["col_root"], t["seq"], t["bad"]),
            {"CHECK": check, "TB": _FINALIZE_TILE, **fp},
        ))  # fmt: skip
        width = len(kernels.UPDATE_ITEM_FIELDS)
        for k, launch in enumerate(self._launches):
            launches.append((
                kernels.update_kernel, (launch.count,),
                (t["update_items"][launch.start * width :], t["meta"], t["addrs"], t["consts"], codebook, lut,
                 thresholds, t["row_root"], t["col_root"], applied, t["seq"]),
                {"ADVANCE": k == 0, "PB": launch.lanes, "BB": launch.blocks, "LOOP": launch.loop, "STEPS": self._steps,
                 **fp},
            ))  # fmt: skip
        return launches


def _signature(jobs: list[TritonJob]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for job in jobs:
        out.append((job.kind, job.period, job.group, tuple(job.shape), len(job.second)))
        out.extend((t.data_ptr(), t.numel(), t.dtype) if t is not None else (None,) for t in job.tensors())
    return out


def build_plan(
    jobs: list[TritonJob],
    codebook: Tensor,
    lut: Tensor,
    thresholds: Tensor,
    steps: int,
    *,
    item_elements: int = 1 << 15,
    stat_rows: int = 256,
) -> TritonPlan:
    """Validate ``jobs`` and build the device tables of their step once.

    Args:
        jobs: the jobs of one step, at least one, all on the codebook's device (see :class:`TritonJob`).
        codebook: (256,) fp32; lut: (4097,) int32; thresholds: (255 + steps,) fp32; steps: the compares after the
            look-up (a :class:`gefen.math.lookup.NearestCodeTable`), all contiguous on the device.
        item_elements: about how many elements one update program handles (whole blocks, at least one tile).
        stat_rows: rows of a factored matrix per statistics item: the column sums take ``8·C·ceil(R / stat_rows)``
            bytes of scratch per factored job (the row sums ``8·R·ceil(C / 256)``).

    Returns:
        A :class:`TritonPlan`; nothing has been written to any job's tensor.

    Raises:
        ValueError: a job (named by its index) or a table of the wrong size, dtype, device or layout, a period that
            does not divide N, a missing counter, written tensors that overlap; nothing was allocated or changed.

    Source: algorithm.md §4.8-4.9 (nearest code), §6.2, §6.4, §7.1 step 2; rounding as gefen.kernels.eager.
    """
    if not isinstance(jobs, list) or not jobs:
        raise ValueError("build_plan: jobs must be a non-empty list of TritonJob")
    if not isinstance(codebook, Tensor):
        raise ValueError("build_plan: codebook must be a tensor")
    if item_elements < 1 or stat_rows < 1:
        raise ValueError(f"build_plan: {item_elements=} and {stat_rows=} must be >= 1")
    device = codebook.device
    for i, job in enumerate(jobs):
        if not isinstance(job, TritonJob):
            raise ValueError(f"build_plan: jobs[{i}] is a {type(job).__name__}, not a TritonJob")
        _check_job(i, job, device)
    _check_disjoint(jobs)
    _check_tables(codebook, lut, thresholds, steps)

    meta, addrs, bounds = [], [], []
    stat_items: list[list[int]] = []
    offsets = {"col_part": 0, "row_part": 0, "row_root": 0, "col_root": 0}
    # factored statistics items first, so that check=False launches just those
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].kind != "factored")
    item_range: dict[int, tuple[int, int]] = {}
    layout: dict[int, dict[str, int]] = {}
    for i in order:
        job = jobs[i]
        first = len(stat_items)
        n = job.grad.numel()
        fields = {"row_groups": 0, "col_tiles": 0, "col_part": 0, "row_part": 0, "row_root": 0, "col_root": 0}
        if job.kind == "factored":
            rows, cols = job.shape
            groups_n = -(-rows // stat_rows)
            tiles = -(-cols // _STAT_CB)
            fields.update(row_groups=groups_n, col_tiles=tiles, **{k: offsets[k] for k in offsets})
            for g in range(groups_n):
                r0 = g * stat_rows
                stat_items.append([i, r0, min(stat_rows, rows - r0), offsets["col_part"] + g * cols])
            offsets["col_part"] += groups_n * cols
            offsets["row_part"] += rows * tiles
            offsets["row_root"] += rows
            offsets["col_root"] += cols
        else:
            for s in range(0, n, _CHECK_ELEMENTS):
                stat_items.append([i, s, min(_CHECK_ELEMENTS, n - s), 0])
        item_range[i] = (first, len(stat_items))
        layout[i] = fields
    factored_items = sum(1 for item in stat_items if jobs[item[0]].kind == "factored")

    classes: dict[tuple[int, bool], list[list[int]]] = {}
    for i, job in enumerate(jobs):
        n, period = job.grad.numel(), job.period
        rows, cols = job.shape if job.kind == "factored" else (0, 0)
        first, last = item_range[i]
        record = {
            "kind": _KINDS[job.kind], "period": period, "numel": n, "rows": rows, "cols": cols,
            "param_dtype": _DTYPES[job.param.dtype] if job.param is not None else 0,
            "grad_dtype": _DTYPES[job.grad.dtype], "group": job.group, "item_first": first, "item_last": last,
            **layout[i],
        }  # fmt: skip
        meta.append([record[name] for name in kernels.META_FIELDS])
        second = list(job.second) + [None] * (2 - len(job.second))
        addrs.append(
            [t.data_ptr() if t is not None else 0
             for t in (job.grad, job.codes, job.scale, job.param, *second, job.out, job.counter)]
        )  # fmt: skip
        bounds.append(_float32(usable_bound(n)))
        loop = period > _TILE
        lanes = _TILE if loop else _next_pow2(period)
        per_tile = 1 if loop else _TILE // lanes
        per_item = max(per_tile, (item_elements // period) // per_tile * per_tile)
        blocks = n // period
        work = classes.setdefault((lanes, loop), [])
        work.extend([i, b, min(per_item, blocks - b)] for b in range(0, blocks, per_item))

    launches, update_items = [], []
    for (lanes, loop), work in sorted(classes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        launches.append(_Launch(len(update_items), len(work), lanes, 1 if loop else _TILE // lanes, loop))
        update_items.extend(work)

    def table(values: list[list[int]] | list[float], dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).reshape(-1).to(device)

    def scratch(numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(max(numel, 1), dtype=dtype, device=device)

    device_tables = {
        "meta": table(meta, torch.int64),
        "addrs": table(addrs, torch.int64),
        "bounds": table(bounds, torch.float32),
        "stat_items": table(stat_items, torch.int64),
        "update_items": table(update_items, torch.int64),
        "chunk_ok": scratch(len(stat_items), torch.int32),
        "row_part": scratch(offsets["row_part"], torch.float64),
        "col_part": scratch(offsets["col_part"], torch.float64),
        "row_root": scratch(offsets["row_root"], torch.float32),
        "col_root": scratch(offsets["col_root"], torch.float32),
        "consts": scratch(len(jobs) * len(kernels.CONSTANT_FIELDS), torch.float32),
        "seq": scratch(1, torch.int64),
        "bad": scratch(1, torch.int64),
    }
    max_group = max(job.group for job in jobs)
    return TritonPlan(
        jobs, (codebook, lut, thresholds), steps, device_tables, (factored_items, len(stat_items)), launches, max_group
    )
