"""The Triton kernels of the multi-tensor Gefen step (the ``@triton.jit`` functions only).

Planning, validation and launching live in :mod:`gefen.kernels.triton_plan`; this module holds the device code and
the column layouts of the tables it reads, which the plan fills. One step is three phases, each one launch whatever
the number of parameters (the update phase is one launch per *period class*):

1. :func:`stats_kernel`: one program per statistics item. A factored item (``stat_rows`` rows of one factored
   parameter) writes float64 sums of the fp32 squares: one per (row, column tile) into ``row_part`` and one per
   (item, column) into ``col_part``, each slot written by exactly one program (no float atomics, fixed order). With
   ``CHECK`` every item also decides whether its gradient values are usable (``|g| <= bound`` in fp32, NaN failing,
   :func:`gefen.amp.usable_bound`), writes that to ``chunk_ok`` and, when not, raises the integer ``bad`` to this
   run's tag ``seq + 1`` (an integer ``atomic_max``: deterministic).
2. :func:`finalize_kernel`: one program per job. Per-step constants from the group row and the job's step counter
   (float64, rounded to fp32 once, as ``gefen.kernels.scalars.derive`` on the host), the job's usable flag
   (all its items), the global decision ``applied = (bad != seq + 1)``, the factored second moments (column sums
   over the item slots in order, the row sums over the column tiles in order) and their step-size roots, and the
   counter increment. State is written only when applied.
3. :func:`update_kernel`: one program per work item (whole blocks of one job): dequantize → EMA → requantize the
   first moment, block second moment, parameter write (algorithm.md §6.2 steps 1-6, §6.4, §7.1 step 2), every store
   masked by ``applied``. The first update launch of a run advances ``seq`` (no program of any update launch reads
   it), so the next run's tag is new and ``bad`` never needs a reset.

Rounding follows :mod:`gefen.kernels.eager` and the native library: every fused multiply-add is an explicit
``tl.fma``; fp32 division and square root are ``tl.div_rn`` / ``tl.sqrt_rn`` (Triton's ``/`` and ``tl.sqrt`` are
approximate for fp32 on NVIDIA); fp64 ``/`` lowers to ``div.rn.f64`` and fp64 ``tl.sqrt`` to ``sqrt.rn.f64``; the
launches pass ``enable_fp_fusion=False`` so that no ``a * b + c`` is contracted. bf16 values are converted with
integer bit operations (round to nearest even, NaN to 0x7fc0, as torch and the native library), so the result does
not depend on the backend's conversion instructions (the interpreter's fp32 → bf16 cast truncates).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Columns of the int64 per-job metadata table.
META_FIELDS = (
    "kind",  # KIND_BLOCK / KIND_FACTORED / KIND_MOMENTUM
    "period",  # P
    "numel",  # N
    "rows",  # R (factored)
    "cols",  # C (factored)
    "param_dtype",  # DT_* (0 for momentum)
    "grad_dtype",  # DT_*
    "group",  # row of the group table
    "item_first",  # the job's statistics items are [item_first, item_last)
    "item_last",
    "col_part",  # offset (float64 elements) of its (row groups, C) column sums in col_part
    "row_groups",  # number of factored statistics items (row groups)
    "row_part",  # offset (float64 elements) of its (R, col_tiles) row sums in row_part
    "col_tiles",  # number of column tiles of the statistics pass
    "row_root",  # offset (fp32 elements) of its (R,) row roots in row_root
    "col_root",  # offset (fp32 elements) of its (C,) column roots in col_root
)
#: Columns of the int64 address table (``Tensor.data_ptr()``; 0 where absent).
ADDRESS_FIELDS = ("grad", "codes", "scale", "param", "second", "second_col", "out", "counter")
#: Columns of the fp32 per-job constants table the finalize kernel writes and the update kernel reads.
CONSTANT_FIELDS = (
    "w",
    "w_minus_one",
    "lerp_high",
    "beta2",
    "one_minus_beta2",
    "eps",
    "decay",
    "step",
    "inv_root_bc2",
    "inv_bc1",
    "bc2",
    "unused",
)
#: Columns of the group table (float64), as ``gefen.kernels.triton_plan.GROUP_FIELDS``.
GROUP_COLUMNS = ("beta1", "beta2", "eps", "lr", "weight_decay")
#: Columns of the statistics items (int64): job, first row or element, rows or elements, col_part offset.
STAT_ITEM_FIELDS = ("job", "start", "count", "col_part")
#: Columns of the update items (int64): job, first block, number of blocks.
UPDATE_ITEM_FIELDS = ("job", "first_block", "blocks")

KIND_BLOCK = tl.constexpr(0)
KIND_FACTORED = tl.constexpr(1)
KIND_MOMENTUM = tl.constexpr(2)
DT_F32 = tl.constexpr(0)
DT_BF16 = tl.constexpr(1)
DT_F16 = tl.constexpr(2)
#: Smallest normal fp32, the floor of the factored normaliser (algorithm.md §6.4 step 4).
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)

N_META = tl.constexpr(len(META_FIELDS))
N_ADDR = tl.constexpr(len(ADDRESS_FIELDS))
N_CONST = tl.constexpr(len(CONSTANT_FIELDS))
N_GROUP = tl.constexpr(len(GROUP_COLUMNS))
M_KIND = tl.constexpr(META_FIELDS.index("kind"))
M_PERIOD = tl.constexpr(META_FIELDS.index("period"))
M_ROWS = tl.constexpr(META_FIELDS.index("rows"))
M_COLS = tl.constexpr(META_FIELDS.index("cols"))
M_PDT = tl.constexpr(META_FIELDS.index("param_dtype"))
M_GDT = tl.constexpr(META_FIELDS.index("grad_dtype"))
M_GROUP = tl.constexpr(META_FIELDS.index("group"))
M_ITEM0 = tl.constexpr(META_FIELDS.index("item_first"))
M_ITEM1 = tl.constexpr(META_FIELDS.index("item_last"))
M_COLPART = tl.constexpr(META_FIELDS.index("col_part"))
M_NRG = tl.constexpr(META_FIELDS.index("row_groups"))
M_ROWPART = tl.constexpr(META_FIELDS.index("row_part"))
M_NCT = tl.constexpr(META_FIELDS.index("col_tiles"))
M_ROWROOT = tl.constexpr(META_FIELDS.index("row_root"))
M_COLROOT = tl.constexpr(META_FIELDS.index("col_root"))
A_GRAD = tl.constexpr(ADDRESS_FIELDS.index("grad"))
A_CODES = tl.constexpr(ADDRESS_FIELDS.index("codes"))
A_SCALE = tl.constexpr(ADDRESS_FIELDS.index("scale"))
A_PARAM = tl.constexpr(ADDRESS_FIELDS.index("param"))
A_V = tl.constexpr(ADDRESS_FIELDS.index("second"))
A_VCOL = tl.constexpr(ADDRESS_FIELDS.index("second_col"))
A_OUT = tl.constexpr(ADDRESS_FIELDS.index("out"))
A_COUNTER = tl.constexpr(ADDRESS_FIELDS.index("counter"))
K_W = tl.constexpr(CONSTANT_FIELDS.index("w"))
K_WM1 = tl.constexpr(CONSTANT_FIELDS.index("w_minus_one"))
K_LERP_HIGH = tl.constexpr(CONSTANT_FIELDS.index("lerp_high"))
K_BETA2 = tl.constexpr(CONSTANT_FIELDS.index("beta2"))
K_OMB2 = tl.constexpr(CONSTANT_FIELDS.index("one_minus_beta2"))
K_EPS = tl.constexpr(CONSTANT_FIELDS.index("eps"))
K_DECAY = tl.constexpr(CONSTANT_FIELDS.index("decay"))
K_STEP = tl.constexpr(CONSTANT_FIELDS.index("step"))
K_INV_ROOT_BC2 = tl.constexpr(CONSTANT_FIELDS.index("inv_root_bc2"))
K_INV_BC1 = tl.constexpr(CONSTANT_FIELDS.index("inv_bc1"))
K_BC2 = tl.constexpr(CONSTANT_FIELDS.index("bc2"))
N_STAT_ITEM = tl.constexpr(len(STAT_ITEM_FIELDS))
N_UPDATE_ITEM = tl.constexpr(len(UPDATE_ITEM_FIELDS))


# ---------------------------------------------------------------------------------------------- loads and stores
@triton.jit
def _load_f32(addr, offs, mask, dt):
    """Elements ``offs`` of the fp32/bf16/fp16 tensor at address ``addr`` (int64), up-cast exactly to fp32 (0 where
    masked)."""
    if dt == DT_F32:
        x = tl.load(addr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    elif dt == DT_BF16:
        bits = tl.load(addr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(addr.to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even; NaN -> 0x7fc0 (torch's and the C library's rule)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def _write_param(addr, offs, mask, dt, direction, step, decay):
    """``p <- fma(d, step, p·decay)`` in fp32, rounded once to the parameter's dtype (algorithm.md §6.2 steps 3, 6)."""
    if dt == DT_F32:
        ptr = addr.to(tl.pointer_type(tl.float32)) + offs
        p = tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, tl.fma(direction, step, p * decay), mask=mask)
    elif dt == DT_BF16:
        ptr16 = addr.to(tl.pointer_type(tl.uint16)) + offs
        p = (tl.load(ptr16, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        tl.store(ptr16, _bf16_bits(tl.fma(direction, step, p * decay)), mask=mask)
    else:
        ptrh = addr.to(tl.pointer_type(tl.float16)) + offs
        p = tl.load(ptrh, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrh, tl.fma(direction, step, p * decay).to(tl.float16), mask=mask)


# ---------------------------------------------------------------------------------------------- exact beta**t
@triton.jit
def _split(a):
    """Veltkamp split of a float64 into two 26-bit halves (exact without any fused multiply-add)."""
    c = a * 134217729.0
    hi = c - (c - a)
    return hi, a - hi


@triton.jit
def _dd_mul(ah, al, bh, bl):
    """Double-double product ``(ah + al)·(bh + bl)`` (Dekker's exact two-product, then a fast two-sum)."""
    p = ah * bh
    ahh, ahl = _split(ah)
    bhh, bhl = _split(bh)
    e = ((ahh * bhh - p) + ahh * bhl + ahl * bhh) + ahl * bhl
    e = e + (ah * bl + al * bh)
    hi = p + e
    return hi, e - (hi - p)


@triton.jit
def _pow_step(rh, rl, bh, bl, bit):
    """One bit of binary exponentiation: multiply the result by the base when ``bit``, square the base."""
    nh, nl = _dd_mul(rh, rl, bh, bl)
    rh = tl.where(bit, nh, rh)
    rl = tl.where(bit, nl, rl)
    bh, bl = _dd_mul(bh, bl, bh, bl)
    return rh, rl, bh, bl


@triton.jit
def pow_int(beta, t):
    """``beta ** t`` in float64 for a scalar ``t >= 1`` (int64), by binary exponentiation in double-double.

    Each double-double product has a relative error below about 2**-100 and squaring doubles the error of the base,
    so the result is the float64 rounding of the exact power up to a relative 2**-100·t. Measured in the interpreter
    (which computes what the GPU does: no fma, Dekker's product is exact in IEEE float64 with contraction off, which
    the launches set) against Python's ``beta ** t`` (libm ``pow``) for every t = 1..10**6 and betas 0.5, 0.8, 0.9,
    0.95, 0.99, 0.995, 0.999, 0.9999, 0.99999: at most 2 float64 ulps apart (0 to 8413 of the 10**6 values differ
    per beta; in every sampled disagreement this result was the closer to the exact power), and the fp32-rounded
    ``1 - beta**t`` identical for every t and beta. ``test_device_power_matches_python`` re-checks a sample.
    """
    rh = tl.full((), 1.0, tl.float64)
    rl = tl.full((), 0.0, tl.float64)
    bh = beta.to(tl.float64)
    bl = tl.full((), 0.0, tl.float64)
    n = t
    while n > 0:
        rh, rl, bh, bl = _pow_step(rh, rl, bh, bl, (n & 1) != 0)
        n = n >> 1
    return rh + rl


@triton.jit
def pow_kernel(beta_ptr, t_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[i] = beta ** t[i]`` (float64, int64 ``t`` in [1, 2**62)) with the finalize kernel's arithmetic, for the
    error measurement: the same :func:`_pow_step` over all 63 bits (a step with a clear bit changes nothing)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(t_ptr + offs, mask=mask, other=1)
    rh = tl.full((BLOCK,), 1.0, tl.float64)
    rl = tl.zeros((BLOCK,), tl.float64)
    bh = tl.zeros((BLOCK,), tl.float64) + tl.load(beta_ptr)
    bl = tl.zeros((BLOCK,), tl.float64)
    for i in range(63):
        rh, rl, bh, bl = _pow_step(rh, rl, bh, bl, ((t >> i) & 1) != 0)
    tl.store(out_ptr + offs, rh + rl, mask=mask)


# ---------------------------------------------------------------------------------------------- phase 1: statistics
@triton.jit
def stats_kernel(
    items, meta, addrs, bounds, chunk_ok, row_part, col_part, seq, bad,
    CHECK: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """One statistics item: a factored row group's float64 sums of squares, and (``CHECK``) the usability check.

    ``row_part[row_part_off + r·col_tiles + k]`` = Σ over column tile ``k`` of row ``r`` of fp32(g²) (float64);
    ``col_part[item's offset + c]`` = Σ over the item's rows of fp32(g²) in column ``c`` (float64). Each slot has one
    writer and one summation order (tiles of ``RB`` rows in order, a tree inside a tile).
    """
    pid = tl.program_id(0)
    job = tl.load(items + pid * N_STAT_ITEM + 0)
    start = tl.load(items + pid * N_STAT_ITEM + 1)
    end = start + tl.load(items + pid * N_STAT_ITEM + 2)
    kind = tl.load(meta + job * N_META + M_KIND)
    gdt = tl.load(meta + job * N_META + M_GDT)
    gaddr = tl.load(addrs + job * N_ADDR + A_GRAD)
    bound = tl.load(bounds + job)
    ok = tl.full((), 1, tl.int32)
    if kind == KIND_FACTORED:
        cols_n = tl.load(meta + job * N_META + M_COLS)
        n_tiles = tl.load(meta + job * N_META + M_NCT)
        row_off = tl.load(meta + job * N_META + M_ROWPART)
        col_off = tl.load(items + pid * N_STAT_ITEM + 3)
        for c0 in range(0, cols_n, CB):
            cols = c0 + tl.arange(0, CB)
            cmask = cols < cols_n
            col_acc = tl.zeros((CB,), tl.float64)
            for r0 in range(start, end, RB):
                rows = r0 + tl.arange(0, RB)
                rmask = rows < end
                mask = rmask[:, None] & cmask[None, :]
                g = _load_f32(gaddr, rows[:, None] * cols_n + cols[None, :], mask, gdt)
                sq = (g * g).to(tl.float64)
                col_acc += tl.sum(sq, axis=0)
                tl.store(row_part + row_off + rows * n_tiles + c0 // CB, tl.sum(sq, axis=1), mask=rmask)
                if CHECK:
                    good = tl.where(mask, (tl.abs(g) <= bound).to(tl.int32), 1)
                    ok = tl.minimum(ok, tl.min(tl.min(good, axis=1), axis=0))
            tl.store(col_part + col_off + cols, col_acc, mask=cmask)
    elif CHECK:
        for s in range(start, end, TILE):
            offs = s + tl.arange(0, TILE)
            mask = offs < end
            g = _load_f32(gaddr, offs, mask, gdt)
            good = tl.where(mask, (tl.abs(g) <= bound).to(tl.int32), 1)
            ok = tl.minimum(ok, tl.min(good, axis=0))
    if CHECK:
        tl.store(chunk_ok + pid, ok)
        tag = tl.load(seq) + 1
        tl.atomic_max(bad, tag, mask=ok == 0)


# ---------------------------------------------------------------------------------------------- phase 2: finalize
@triton.jit
def finalize_kernel(
    meta, addrs, groups, consts, chunk_ok, flags, applied, row_part, col_part, row_root, col_root, seq, bad,
    CHECK: tl.constexpr, TB: tl.constexpr,
):  # fmt: skip
    """Per job: constants, usable flag, the global apply decision, factored moments and roots, the counter."""
    job = tl.program_id(0)
    kind = tl.load(meta + job * N_META + M_KIND)
    group = tl.load(meta + job * N_META + M_GROUP)
    beta1 = tl.load(groups + group * N_GROUP + 0)
    beta2 = tl.load(groups + group * N_GROUP + 1)
    eps = tl.load(groups + group * N_GROUP + 2)
    lr = tl.load(groups + group * N_GROUP + 3)
    weight_decay = tl.load(groups + group * N_GROUP + 4)
    counter_addr = tl.load(addrs + job * N_ADDR + A_COUNTER)
    counter = counter_addr.to(tl.pointer_type(tl.int64))
    t = tl.full((), 1, tl.int64)
    if counter_addr != 0:
        t = tl.load(counter) + 1
    # per-step constants: float64 as gefen.kernels.scalars.derive, each rounded to fp32 once
    bc1 = 1.0 - pow_int(beta1, t)
    bc2 = 1.0 - pow_int(beta2, t)
    w = (1.0 - beta1).to(tl.float32)
    row = consts + job * N_CONST
    tl.store(row + K_W, w)
    tl.store(row + K_WM1, w - 1.0)
    tl.store(row + K_LERP_HIGH, (tl.abs(w) >= 0.5).to(tl.float32))
    tl.store(row + K_BETA2, beta2.to(tl.float32))
    tl.store(row + K_OMB2, (1.0 - beta2).to(tl.float32))
    tl.store(row + K_EPS, eps.to(tl.float32))
    tl.store(row + K_DECAY, (1.0 - lr * weight_decay).to(tl.float32))
    if kind == KIND_FACTORED:
        tl.store(row + K_STEP, (-lr * (1.0 / bc1)).to(tl.float32))
    else:
        tl.store(row + K_STEP, (-lr).to(tl.float32))
    one = tl.full((), 1.0, tl.float32)
    tl.store(row + K_INV_ROOT_BC2, tl.div_rn(one, tl.sqrt(bc2).to(tl.float32)))
    tl.store(row + K_INV_BC1, (1.0 / bc1).to(tl.float32))
    tl.store(row + K_BC2, bc2.to(tl.float32))
    # usable flag of this job, the run's decision (every stats program has finished: previous launch)
    ok = tl.full((), 1, tl.int32)
    apply = tl.full((), 1, tl.int32)
    if CHECK:
        first = tl.load(meta + job * N_META + M_ITEM0)
        last = tl.load(meta + job * N_META + M_ITEM1)
        for s in range(first, last, TB):
            offs = s + tl.arange(0, TB)
            ok = tl.minimum(ok, tl.min(tl.load(chunk_ok + offs, mask=offs < last, other=1), axis=0))
        apply = (tl.load(bad) != tl.load(seq) + 1).to(tl.int32)
    tl.store(flags + job, ok)
    if job == 0:
        tl.store(applied, apply)
    if kind == KIND_FACTORED:
        _factored_moments(meta, addrs, job, row, row_part, col_part, row_root, col_root, apply != 0, TB)
    if counter_addr != 0:
        tl.store(counter, t, mask=apply != 0)


@triton.jit
def _factored_moments(meta, addrs, job, const_row, row_part, col_part, row_root, col_root, apply, TB: tl.constexpr):
    """v_col, v_row EMAs of the mean squares and the roots ``col = sqrt(v_col)``,
    ``row = sqrt(v_row / (max(mean(v_row), tiny)·bc2))`` (algorithm.md §6.4 steps 1-5; rounding as the native
    library: means rounded once from float64 sums, ``v = fma(mean, 1 − β2, v·β2)``)."""
    rows_n = tl.load(meta + job * N_META + M_ROWS)
    cols_n = tl.load(meta + job * N_META + M_COLS)
    n_groups = tl.load(meta + job * N_META + M_NRG)
    n_tiles = tl.load(meta + job * N_META + M_NCT)
    col_off = tl.load(meta + job * N_META + M_COLPART)
    row_off = tl.load(meta + job * N_META + M_ROWPART)
    row_root_off = tl.load(meta + job * N_META + M_ROWROOT)
    col_root_off = tl.load(meta + job * N_META + M_COLROOT)
    v_row = tl.load(addrs + job * N_ADDR + A_V).to(tl.pointer_type(tl.float32))
    v_col = tl.load(addrs + job * N_ADDR + A_VCOL).to(tl.pointer_type(tl.float32))
    beta2 = tl.load(const_row + K_BETA2)
    omb2 = tl.load(const_row + K_OMB2)
    bc2 = tl.load(const_row + K_BC2)
    rows_f = rows_n.to(tl.float64)
    cols_f = cols_n.to(tl.float64)
    for c0 in range(0, cols_n, TB):
        cols = c0 + tl.arange(0, TB)
        cmask = cols < cols_n
        acc = tl.zeros((TB,), tl.float64)
        for s in range(0, n_groups):  # the item slots in order
            acc += tl.load(col_part + col_off + s * cols_n + cols, mask=cmask, other=0.0)
        mean = (acc / rows_f).to(tl.float32)
        v = tl.fma(mean, omb2, tl.load(v_col + cols, mask=cmask, other=0.0) * beta2)
        tl.store(v_col + cols, v, mask=cmask & apply)
        tl.store(col_root + col_root_off + cols, tl.sqrt_rn(v), mask=cmask)
    total = tl.zeros((TB,), tl.float64)
    for r0 in range(0, rows_n, TB):  # pass 1: the float64 total of the updated row moments
        rows = r0 + tl.arange(0, TB)
        rmask = rows < rows_n
        v = _row_moment(row_part, row_off, n_tiles, v_row, rows, rmask, cols_f, beta2, omb2, TB)
        total += tl.where(rmask, v.to(tl.float64), 0.0)
    mean = (tl.sum(total, axis=0) / rows_f).to(tl.float32)
    normaliser = tl.where(mean < FLOAT32_TINY, FLOAT32_TINY, mean) * bc2  # a NaN mean stays NaN (torch's clamp_min)
    for r0 in range(0, rows_n, TB):  # pass 2: the same moments again (no read-back of a write), stored, and roots
        rows = r0 + tl.arange(0, TB)
        rmask = rows < rows_n
        v = _row_moment(row_part, row_off, n_tiles, v_row, rows, rmask, cols_f, beta2, omb2, TB)
        tl.store(v_row + rows, v, mask=rmask & apply)
        tl.store(row_root + row_root_off + rows, tl.sqrt_rn(tl.div_rn(v, normaliser)), mask=rmask)


@triton.jit
def _row_moment(row_part, row_off, n_tiles, v_row, rows, rmask, cols_f, beta2, omb2, TB: tl.constexpr):
    """The updated row moments of ``rows``: the column-tile sums in order, the mean rounded once, the EMA."""
    acc = tl.zeros((TB,), tl.float64)
    for k in range(0, n_tiles):
        acc += tl.load(row_part + row_off + rows * n_tiles + k, mask=rmask, other=0.0)
    mean = (acc / cols_f).to(tl.float32)
    return tl.fma(mean, omb2, tl.load(v_row + rows, mask=rmask, other=0.0) * beta2)


# ---------------------------------------------------------------------------------------------- phase 3: update
@triton.jit
def _ema(g, code, a_old, codebook, w, w_minus_one, lerp_high):
    """``m = lerp(c[idx]·a, g, w)`` with torch's two formulas (algorithm.md §6.2 step 5)."""
    m_old = tl.load(codebook + code) * a_old
    d = g - m_old
    return tl.where(lerp_high, tl.fma(w_minus_one, d, g), tl.fma(w, d, m_old))


@triton.jit
def _nearest(u, lut, thresholds, STEPS: tl.constexpr):
    """The exact nearest-code index of fp32 ``u`` (algorithm.md §4.8-4.9, :mod:`gefen.math.lookup`): the bucket
    ``trunc((u + 1)·2048)`` clamped to [0, 4095] (NaN -> 0), its table entry, then ``STEPS`` threshold compares."""
    t = (u + 1.0) * 2048.0
    bucket = tl.where(t >= 1.0, tl.where(t < 4095.0, t, 4095.0), 0.0).to(tl.int32)
    idx = tl.load(lut + bucket)
    for _ in tl.static_range(STEPS):
        idx += (tl.load(thresholds + idx) < u).to(tl.int32)
    return idx


@triton.jit
def _block_step_size(sum_sq, period_f, v_addr, blocks, bmask, beta2, omb2, inv_root_bc2, eps, inv_bc1, apply):
    """Block second moment ``v = fma(mean(g²), 1 − β2, v·β2)`` (mean rounded once from the float64 sum), stored,
    and the step size ``s = (1 / (sqrt(v)·(1/sqrt(bc2)) + ε))·(1/bc1)`` (algorithm.md §6.2 steps 1, 4)."""
    v_ptr = v_addr.to(tl.pointer_type(tl.float32)) + blocks
    mean = (sum_sq / period_f).to(tl.float32)
    v = tl.fma(mean, omb2, tl.load(v_ptr, mask=bmask, other=0.0) * beta2)
    tl.store(v_ptr, v, mask=bmask & apply)
    one = tl.full(v.shape, 1.0, tl.float32)
    return tl.div_rn(one, tl.sqrt_rn(v) * inv_root_bc2 + eps) * inv_bc1


@triton.jit
def _finish(
    e, mask, m, denom, amag, s, kind, pdt, param_addr, out_addr, codes_addr, cols_n, row_root, row_root_off,
    col_root, col_root_off, codebook, lut, thresholds, eps, step, decay, apply, STEPS: tl.constexpr,
):  # fmt: skip
    """Requantize ``m`` (normalised by ``denom``), write the codes and ``m̂`` or the parameter update."""
    idx = _nearest(tl.div_rn(m, denom), lut, thresholds, STEPS)
    m_hat = tl.load(codebook + idx) * amag
    wmask = mask & apply
    tl.store(codes_addr.to(tl.pointer_type(tl.uint8)) + e, idx.to(tl.uint8), mask=wmask)
    if kind == KIND_MOMENTUM:
        tl.store(out_addr.to(tl.pointer_type(tl.float32)) + e, m_hat, mask=wmask)
    else:
        if kind == KIND_BLOCK:
            direction = m_hat * s
        else:
            r = e // cols_n
            root = tl.load(row_root + row_root_off + r, mask=mask, other=1.0) * tl.load(
                col_root + col_root_off + (e - r * cols_n), mask=mask, other=1.0
            )
            direction = tl.div_rn(m_hat, root + eps)
        _write_param(param_addr, e, wmask, pdt, direction, step, decay)


@triton.jit
def update_kernel(
    items, meta, addrs, consts, codebook, lut, thresholds, row_root, col_root, applied, seq,
    ADVANCE: tl.constexpr, PB: tl.constexpr, BB: tl.constexpr, LOOP: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """One work item: blocks ``[first, first + blocks)`` of one job (algorithm.md §6.2, §6.4, §7.1 step 2).

    ``LOOP=False`` (``P <= PB``): tiles of ``BB`` whole blocks × ``PB`` lanes (lanes ``>= P`` masked). ``LOOP=True``
    (``P > PB``): one block at a time in tiles of ``PB``: a first pass for ``max|m|`` and the sum of squares, a second
    that recomputes ``m`` (the same operations, so the same values) and writes.
    """
    pid = tl.program_id(0)
    if ADVANCE:
        if pid == 0:
            tl.store(seq, tl.load(seq) + 1)  # no program of an update launch reads seq
    job = tl.load(items + pid * N_UPDATE_ITEM + 0)
    first = tl.load(items + pid * N_UPDATE_ITEM + 1)
    last = first + tl.load(items + pid * N_UPDATE_ITEM + 2)
    apply = tl.load(applied) != 0
    kind = tl.load(meta + job * N_META + M_KIND)
    period = tl.load(meta + job * N_META + M_PERIOD)
    cols_n = tl.load(meta + job * N_META + M_COLS)
    pdt = tl.load(meta + job * N_META + M_PDT)
    gdt = tl.load(meta + job * N_META + M_GDT)
    row_root_off = tl.load(meta + job * N_META + M_ROWROOT)
    col_root_off = tl.load(meta + job * N_META + M_COLROOT)
    grad_addr = tl.load(addrs + job * N_ADDR + A_GRAD)
    codes_addr = tl.load(addrs + job * N_ADDR + A_CODES)
    scale = tl.load(addrs + job * N_ADDR + A_SCALE).to(tl.pointer_type(tl.float32))
    param_addr = tl.load(addrs + job * N_ADDR + A_PARAM)
    v_addr = tl.load(addrs + job * N_ADDR + A_V)
    out_addr = tl.load(addrs + job * N_ADDR + A_OUT)
    row = consts + job * N_CONST
    w = tl.load(row + K_W)
    w_minus_one = tl.load(row + K_WM1)
    lerp_high = tl.load(row + K_LERP_HIGH) != 0.0
    beta2 = tl.load(row + K_BETA2)
    omb2 = tl.load(row + K_OMB2)
    eps = tl.load(row + K_EPS)
    decay = tl.load(row + K_DECAY)
    step = tl.load(row + K_STEP)
    inv_root_bc2 = tl.load(row + K_INV_ROOT_BC2)
    inv_bc1 = tl.load(row + K_INV_BC1)
    codes_ptr = codes_addr.to(tl.pointer_type(tl.uint8))
    period_f = period.to(tl.float64)
    if not LOOP:
        lanes = tl.arange(0, PB)
        lmask = lanes < period
        for b0 in range(first, last, BB):
            blocks = b0 + tl.arange(0, BB)
            bmask = blocks < last
            mask = bmask[:, None] & lmask[None, :]
            e = blocks[:, None] * period + lanes[None, :]
            g = _load_f32(grad_addr, e, mask, gdt)
            code = tl.load(codes_ptr + e, mask=mask, other=0).to(tl.int32)
            a_old = tl.load(scale + blocks, mask=bmask, other=0.0)
            m = tl.where(mask, _ema(g, code, a_old[:, None], codebook, w, w_minus_one, lerp_high), 0.0)
            has_nan = tl.max((m != m).to(tl.int32), axis=1)
            amag = tl.where(has_nan > 0, float("nan"), tl.max(tl.abs(m), axis=1))
            denom = tl.where(amag > 0.0, amag, 1.0)
            s = tl.zeros((BB,), tl.float32)
            if kind == KIND_BLOCK:
                sum_sq = tl.sum((g * g).to(tl.float64), axis=1)
                s = _block_step_size(sum_sq, period_f, v_addr, blocks, bmask, beta2, omb2, inv_root_bc2, eps,
                                     inv_bc1, apply)  # fmt: skip
            _finish(e, mask, m, denom[:, None], amag[:, None], s[:, None], kind, pdt, param_addr, out_addr,
                    codes_addr, cols_n, row_root, row_root_off, col_root, col_root_off, codebook, lut, thresholds,
                    eps, step, decay, apply, STEPS)  # fmt: skip
            tl.store(scale + blocks, amag, mask=bmask & apply)
    else:
        lanes = tl.arange(0, PB)
        for b in range(first, last):
            a_old = tl.load(scale + b)
            base = b * period
            most = tl.zeros((PB,), tl.float32)
            nans = tl.zeros((PB,), tl.int32)
            sum_sq = tl.zeros((PB,), tl.float64)
            for j0 in range(0, period, PB):  # pass 1: max|m| (NaN tracked apart), sum of squares
                mask = j0 + lanes < period
                e = base + j0 + lanes
                g = _load_f32(grad_addr, e, mask, gdt)
                code = tl.load(codes_ptr + e, mask=mask, other=0).to(tl.int32)
                m = tl.where(mask, _ema(g, code, a_old, codebook, w, w_minus_one, lerp_high), 0.0)
                nans = tl.maximum(nans, (m != m).to(tl.int32))
                most = tl.where(tl.abs(m) > most, tl.abs(m), most)
                sum_sq += (g * g).to(tl.float64)
            amag = tl.where(tl.max(nans, axis=0) > 0, float("nan"), tl.max(most, axis=0))
            denom = tl.where(amag > 0.0, amag, 1.0)
            s = tl.zeros((1,), tl.float32)
            if kind == KIND_BLOCK:
                one = tl.arange(0, 1)
                s = _block_step_size(tl.sum(sum_sq, axis=0) + tl.zeros((1,), tl.float64), period_f, v_addr,
                                     b + one, one == 0, beta2, omb2, inv_root_bc2, eps, inv_bc1, apply)  # fmt: skip
            for j0 in range(0, period, PB):  # pass 2: the same m, requantized and written
                mask = j0 + lanes < period
                e = base + j0 + lanes
                g = _load_f32(grad_addr, e, mask, gdt)
                code = tl.load(codes_ptr + e, mask=mask, other=0).to(tl.int32)
                m = tl.where(mask, _ema(g, code, a_old, codebook, w, w_minus_one, lerp_high), 0.0)
                _finish(e, mask, m, denom, amag, s, kind, pdt, param_addr, out_addr, codes_addr, cols_n, row_root,
                        row_root_off, col_root, col_root_off, codebook, lut, thresholds, eps, step, decay, apply,
                        STEPS)  # fmt: skip
            tl.store(scale + b, amag, mask=apply)
