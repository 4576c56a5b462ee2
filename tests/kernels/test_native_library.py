"""The native library itself: a property test against the reference over shapes, periods, dtypes and CPU paths,
its argument checks, a run under AddressSanitizer, and the package's behaviour without the library."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gefen
from gefen.kernels import native
from gefen.kernels.eager import reference_step
from gefen.kernels.first_step import accumulate_histogram_, fit_codebook
from gefen.kernels.scalars import StepScalars
from gefen.math.codebook import HISTOGRAM_BINS
from gefen.math.lookup import build_nearest_table

ROOT = Path(__file__).resolve().parents[2]
#: The C source, shipped in the package too (so the installed wheel's tests can build the sanitizer library).
SOURCE = Path(native.__file__).with_name("_native") / "gefen_kernels.c"
AVAILABLE = native.native_status().available
needs_library = pytest.mark.skipif(not AVAILABLE, reason=f"native library: {native.native_status().reason}")
LEVELS = ["scalar", "avx2", "avx512", "avx512vbmi"]
LEVELS = LEVELS[: LEVELS.index(native.native_status().level) + 1] if AVAILABLE else ["scalar"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _table(seed: int, spread: float):
    """A codebook learned from gradients of a given spread (fewer active bins for a narrow one)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    row_scale = torch.exp(spread * torch.randn(64, 1, generator=gen)).repeat(1, 512).view(-1)
    g = torch.randn(64 * 512, generator=gen) * row_scale
    accumulate_histogram_(counts, g, 512)
    return build_nearest_table(fit_codebook(counts))


TABLES = [_table(0, 1.0), _table(1, 3.0), _table(2, 0.0)]


def _tables(table):
    return (table.codebook, table.lut, table.thresholds)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["block", "factored", "momentum"]))
    if kind == "factored":
        rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 90))
        numel, shape = rows * cols, (rows, cols)
    else:
        numel, shape = draw(st.integers(1, 3000)), (0, 0)
    divisors = [d for d in range(1, numel + 1) if numel % d == 0]
    period = draw(st.sampled_from(divisors))
    return {
        "kind": kind,
        "numel": numel,
        "shape": shape,
        "period": period,
        "pdt": draw(st.sampled_from(DTYPES)),
        "gdt": draw(st.sampled_from(DTYPES)),
        "table": draw(st.integers(0, len(TABLES) - 1)),
        "level": draw(st.sampled_from(LEVELS)),
        "beta1": draw(st.sampled_from([0.9, 0.5, 0.3, 0.95])),
        "step": draw(st.integers(1, 50)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "zero_blocks": draw(st.booleans()),
    }


def _inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    n, period = case["numel"], case["period"]
    blocks = n // period
    table = TABLES[case["table"]]
    grad = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).to(case["gdt"])
    codes = torch.randint(0, 256, (blocks, period), generator=gen, dtype=torch.uint8)
    scale = torch.rand(blocks, generator=gen) * 0.01
    if case["zero_blocks"]:  # blocks whose magnitude is 0 (never had a gradient) and zero gradients
        scale[::3] = 0.0
        grad.view(blocks, period)[::2] = 0.0
    param = torch.randn(n, generator=gen).to(case["pdt"])
    if case["kind"] == "block":
        second = (torch.rand(blocks, generator=gen) * 1e-6,)
    elif case["kind"] == "factored":
        rows, cols = case["shape"]
        second = (torch.rand(rows, generator=gen) * 1e-6, torch.rand(cols, generator=gen) * 1e-6)
    else:
        second = ()
    return table, grad, codes, scale, param, second


@needs_library
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_native_step_matches_the_reference(case) -> None:
    _check_against_reference(case)


def _long_block_cases() -> list[dict]:
    """Blocks of 256 elements and more, which the draws above rarely reach: the VBMI pass 2 interleaves four
    64-element groups there (then single groups, then a 16-lane tail): periods 256 (one iteration), 320 (one
    more group), 1000 (groups and a tail), 1408 (benchmarks/step.py's MLP rows: five iterations and two
    groups), each table (their bucket counts and compare steps differ), factored rows of those lengths, and rows of
    4100 (the statistics pass takes four rows at a time from 4096 columns on, then the fifth row alone; 4100 % 16
    leaves a tail). The AVX2 pass 2 runs two 8-element groups at a time, then one, then a scalar tail."""
    out = []
    for level in LEVELS:
        for i, (kind, numel, shape, period) in enumerate(
            [
                ("block", 512, (0, 0), 256),
                ("block", 640, (0, 0), 320),
                ("momentum", 2000, (0, 0), 1000),
                ("block", 2816, (0, 0), 1408),
                ("factored", 2 * 1408, (2, 1408), 1408),
                ("factored", 3 * 320, (3, 320), 320),
                ("factored", 4 * 500, (4, 500), 1000),
                ("factored", 5 * 4100, (5, 4100), 4100),
            ]
        ):
            for table in range(len(TABLES)):
                out.append(
                    {"kind": kind, "numel": numel, "shape": shape, "period": period, "pdt": DTYPES[i % 3],
                     "gdt": DTYPES[(i + table) % 3], "table": table, "level": level, "beta1": 0.9, "step": 3,
                     "seed": 100 * i + table, "zero_blocks": table == 1}
                )  # fmt: skip
    return out


@needs_library
@pytest.mark.parametrize(
    "case", _long_block_cases(), ids=lambda c: f"{c['level']}-{c['kind']}-{c['period']}-t{c['table']}"
)
def test_native_step_matches_the_reference_on_long_blocks(case) -> None:
    _check_against_reference(case)


def _check_against_reference(case: dict) -> None:
    """One native step against the eager reference: codes and magnitudes identical, second moments to summation
    order, parameters within 2e-6 of the update plus one ulp (what those second-moment ulps do to one update: see
    test_backends.py)."""
    table, grad, codes, scale, param, second = _inputs(case)
    kind = case["kind"]
    out_ref = torch.empty(case["numel"]) if kind == "momentum" else None
    out_nat = torch.empty(case["numel"]) if kind == "momentum" else None
    ref = [codes.clone(), scale.clone(), param.clone(), [s.clone() for s in second]]
    nat = [codes.clone(), scale.clone(), param.clone(), [s.clone() for s in second]]
    common = {
        "period": case["period"],
        "beta1": case["beta1"],
        "shape": case["shape"],
        "beta2": 0.999,
        "eps": 1e-8,
        "lr": 1e-2,
        "weight_decay": 0.1,
        "step": case["step"],
    }
    reference_step(
        kind,
        grad=grad,
        codes=ref[0],
        scale=ref[1],
        table=table,
        param=None if kind == "momentum" else ref[2],
        second=tuple(ref[3]),
        out=out_ref,
        **common,
    )
    native.force_level(case["level"])
    try:
        native.native_step(
            kind,
            grad=grad,
            codes=nat[0],
            scale=nat[1],
            tables=_tables(table),
            steps=table.steps,
            param=None if kind == "momentum" else nat[2],
            second=tuple(nat[3]),
            out=out_nat,
            **common,
        )
    finally:
        native.force_level(None)
    assert torch.equal(ref[0], nat[0]), "codes"
    assert torch.equal(ref[1], nat[1]), "magnitudes"
    if kind == "momentum":
        assert torch.equal(out_ref, out_nat)
        return
    for a, b in zip(ref[3], nat[3]):  # second moments: summation order only (see test_backends.py)
        assert torch.allclose(a, b, rtol=2e-6, atol=0.0), (a - b).abs().max()
    update = (ref[2].float() - param.float()).abs().max()
    ulp = torch.nextafter(ref[2].abs(), torch.tensor(float("inf"), dtype=ref[2].dtype)).float() - ref[2].float().abs()
    bound = 2e-6 * update + ulp.max()
    assert (ref[2].float() - nat[2].float()).abs().max() <= bound


@needs_library
def test_native_step_refuses_arguments_that_do_not_fit() -> None:
    table = TABLES[0]
    grad, codes, scale = torch.randn(64), torch.zeros(8, 8, dtype=torch.uint8), torch.zeros(8)
    param, v = torch.randn(64), torch.zeros(8)
    good = {
        "grad": grad,
        "codes": codes,
        "scale": scale,
        "tables": _tables(table),
        "steps": table.steps,
        "period": 8,
        "beta1": 0.9,
        "param": param,
        "second": (v,),
    }
    bad = [
        ({"period": 7}, "period 7 must divide"),
        ({"scale": torch.zeros(7)}, "scale has 7 elements"),
        ({"codes": torch.zeros(8, 8, dtype=torch.int32)}, "codes must be torch.uint8"),
        ({"codes": torch.zeros(8, 8, dtype=torch.uint8).t()}, "contiguous"),
        ({"param": torch.randn(63)}, "param has 63 elements"),
        ({"param": torch.randn(64, dtype=torch.float64)}, "param must be a float32"),
        ({"second": (torch.zeros(9),)}, "v has 9 elements"),
        ({"tables": (table.codebook[:255], table.lut, table.thresholds)}, "codebook has 255"),
        ({"steps": table.steps + 1}, "thresholds has"),
        ({"grad": torch.randn(64, dtype=torch.float64)}, "grad dtype"),
    ]
    before = [t.clone() for t in (codes, scale, param, v)]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            native.native_step("block", **{**good, **change})
    with pytest.raises(ValueError, match="factored needs"):
        native.native_step("factored", **{**good, "second": (torch.zeros(8), torch.zeros(8)), "shape": (8, 9)})
    with pytest.raises(ValueError, match="out is required"):
        native.native_step("momentum", **good)
    for a, b in zip(before, (codes, scale, param, v)):
        assert torch.equal(a, b)


@st.composite
def unusable_cases(draw):
    """Several records (kinds, dtypes, shapes with SIMD tails) whose gradients may hold a NaN, an Inf, a value at
    the usable bound, just above it, or below sqrt(FLT_MAX) but above the bound (the factored row-sum screen must
    still catch it), at any position."""
    records = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["block", "factored", "momentum"]))
        rows, cols = draw(st.integers(1, 24)), draw(st.integers(1, 70))
        injections = draw(
            st.lists(
                st.tuples(
                    st.integers(0, rows * cols - 1),
                    st.sampled_from(["nan", "inf", "-inf", "at", "above", "huge", "ok"]),
                ),
                max_size=2,
            )
        )
        records.append(
            {"kind": kind, "shape": (rows, cols), "gdt": draw(st.sampled_from(DTYPES)), "injections": injections}
        )
    return {"records": records, "level": draw(st.sampled_from(LEVELS)), "seed": draw(st.integers(0, 2**31 - 1))}


def _injected(value: str, numel: int, dtype: torch.dtype) -> float:
    bound = native.as_float32(gefen.amp.usable_bound(numel))
    above = torch.nextafter(torch.tensor(bound), torch.tensor(float("inf"))).item()
    return {
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": -float("inf"),
        "at": -bound,
        "above": above,
        "huge": 1e19,
        "ok": 0.5,
    }[value]


@needs_library
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(unusable_cases())
def test_native_usability_check_flags_exactly_what_the_preflight_flags_and_changes_nothing(case) -> None:
    """``grad_bound``: the records the library refuses are exactly those whose gradient ``gefen.amp.unusable_names``
    (the eager check of ``nonfinite="skip"``) names, on every CPU path; a refused call changes nothing at all."""
    gen = torch.Generator().manual_seed(case["seed"])
    table = TABLES[0]
    records, tensors, named = [], [], []
    for i, spec in enumerate(case["records"]):
        rows, cols = spec["shape"]
        n = rows * cols
        grad = (torch.randn(n, generator=gen) * 1e-3).to(spec["gdt"])
        for position, value in spec["injections"]:
            grad[position] = _injected(value, n, spec["gdt"])
        kind = spec["kind"]
        st_ = {
            "grad": grad,
            "codes": torch.randint(0, 256, (n // cols, cols), generator=gen, dtype=torch.uint8),
            "scale": torch.rand(n // cols, generator=gen),
            "param": torch.randn(n, generator=gen),
        }
        second = {
            "block": (torch.rand(n // cols, generator=gen),),
            "factored": (torch.rand(rows, generator=gen), torch.rand(cols, generator=gen)),
            "momentum": (),
        }[kind]
        out = torch.zeros(n) if kind == "momentum" else None
        counter = torch.tensor(7, dtype=torch.int64)  # the library advances it only when the call is applied
        tensors.append([t for t in (*st_.values(), *second, out, counter) if t is not None])
        records.append(
            native.record(
                kind,
                grad=grad,
                codes=st_["codes"],
                scale=st_["scale"],
                tables=_tables(table),
                steps=table.steps,
                period=cols,
                shape=(rows, cols),
                scalars=StepScalars(beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-2, weight_decay=0.1),
                step=3,
                param=None if kind == "momentum" else st_["param"],
                second=second,
                out=out,
                grad_bound=native.as_float32(gefen.amp.usable_bound(n)),
                counter=counter,
            )
        )
        named.append((str(i), grad))
    expected = [int(name) for name in gefen.amp.unusable_names(named)]
    before = [[t.clone() for t in ts] for ts in tensors]
    native.force_level(case["level"])
    try:
        refused = native.run_records(records)
    finally:
        native.force_level(None)
    assert refused == expected

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bit for bit (NaN included)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    if refused:
        assert all(same(a, b) for ts, bs in zip(tensors, before) for a, b in zip(ts, bs))
    else:
        assert any(not same(a, b) for ts, bs in zip(tensors, before) for a, b in zip(ts[1:], bs[1:]))
        assert all(int(ts[-1]) == 8 for ts in tensors)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _libasan(compiler: str) -> str | None:
    out = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


ASAN_SCRIPT = textwrap.dedent(
    """
    import torch
    from gefen.kernels import native
    from gefen.kernels.scalars import StepScalars
    from gefen.kernels.first_step import accumulate_histogram_, fit_codebook
    from gefen.math.codebook import HISTOGRAM_BINS
    from gefen.math.lookup import build_nearest_table

    status = native.native_status()
    assert status.available, status
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    accumulate_histogram_(counts, torch.randn(4096), 64)
    table = build_nearest_table(fit_codebook(counts))
    tables = (table.codebook.clone(), table.lut.clone(), table.thresholds.clone())
    levels = ["scalar", "avx2", "avx512", "avx512vbmi"]
    levels = levels[: levels.index(status.level) + 1]
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for level in levels:
        native.force_level(level)
        for n, shape in [(1, (1, 1)), (7, (1, 7)), (17, (17, 1)), (63, (7, 9)), (64, (8, 8)), (65, (5, 13)),
                         (130, (2, 65)), (1000, (8, 125)), (4097, (17, 241)), (70000, (70, 1000))]:
            for period in sorted({d for d in (1, 3, 7, 16, 17, 64, 65, 128, 1000, 1030, n) if n % d == 0}):
                for pdt in (torch.float32, torch.bfloat16, torch.float16):
                    for kind in ("block", "factored", "momentum"):
                        b = n // period
                        # fresh, exactly sized allocations: any access past an end hits a redzone
                        grad = torch.randn(n, generator=gen).to(pdt)
                        codes = torch.randint(0, 256, (b, period), generator=gen, dtype=torch.uint8)
                        scale = torch.rand(b, generator=gen)
                        param = torch.randn(n, generator=gen).to(pdt)
                        second = {"block": (torch.rand(b),), "factored": (torch.rand(shape[0]), torch.rand(shape[1])),
                                  "momentum": ()}[kind]
                        out = torch.empty(n) if kind == "momentum" else None
                        native.native_step(kind, grad=grad, codes=codes, scale=scale, tables=tables,
                                           steps=table.steps, period=period, beta1=0.9, shape=shape,
                                           param=None if kind == "momentum" else param, second=second, out=out,
                                           beta2=0.999, eps=1e-8, lr=1e-3, weight_decay=0.1, step=3)
                        cases += 1
    # the usability check (grad_bound): clean and refused calls, every kind, SIMD tails, the factored row re-read
    for level in levels:
        native.force_level(level)
        for rows, cols in ((1, 1), (1, 17), (3, 7), (5, 33), (9, 130)):
            n = rows * cols
            for kind in ("block", "factored", "momentum"):
                for bad in (None, 0, n - 1):
                    grad = torch.randn(n, generator=gen)
                    if bad is not None:
                        grad[bad] = 1e19
                    second = {"block": (torch.rand(rows),), "factored": (torch.rand(rows), torch.rand(cols)),
                              "momentum": ()}[kind]
                    out = torch.empty(n) if kind == "momentum" else None
                    codes, scale, param = torch.zeros((rows, cols), dtype=torch.uint8), torch.rand(rows), torch.randn(n)
                    rec = native.record(kind, grad=grad, codes=codes, scale=scale, tables=tables, steps=table.steps,
                                        period=cols, shape=(rows, cols),
                                        param=None if kind == "momentum" else param, second=second, out=out,
                                        scalars=StepScalars(0.9, 0.999, 1e-8, 1e-3), step=3, grad_bound=1e6)
                    assert native.run_records([rec]) == ([] if bad is None else [0])
                    cases += 1
    # the row-sharded factored form: pieces at the end of an exactly sized reduce buffer, a rank without records,
    # and the failure paths
    for level in levels:
        native.force_level(level)
        for rows, cols, period in ((1, 1, 1), (3, 7, 7), (5, 130, 65), (17, 241, 241)):
            n = rows * cols
            parts = []
            for k in range(2):
                st = dict(grad=torch.randn(n, generator=gen),
                          codes=torch.zeros((n // period, period), dtype=torch.uint8),
                          scale=torch.rand(n // period, generator=gen), param=torch.randn(n, generator=gen),
                          second=(torch.rand(rows, generator=gen), torch.rand(cols, generator=gen)))
                parts.append(native.record("factored", **st, tables=tables, steps=table.steps, period=period,
                                           shape=(rows, cols), scalars=StepScalars(0.9, 0.999, 1e-8, 1e-3), step=3,
                                           global_rows=2 * rows, reduce_offset=k * (cols + 1)))
                parts.append(st)
            buffer = torch.zeros(2 * (cols + 1) + 1, dtype=torch.float64)
            native.run_records(parts[0::2], buffer, lambda b: None)
            native.run_records([], torch.zeros(3, dtype=torch.float64), lambda b: None)
            try:
                native.run_records(parts[0::2], torch.zeros(2 * (cols + 1) + 1, dtype=torch.float64),
                                   lambda b: b.__setitem__(-1, 1.0))
            except RuntimeError:
                cases += 1
    # the first step's routines: the k-means layers and the histogram, on exactly sized arrays
    import numpy as np
    rng = np.random.default_rng(0)
    from gefen.kernels.first_step import optimal_partition_centers
    for level in levels:  # AVX-512 rows of 1..8 candidates in one register, wider ones 8 at a time with a tail
        native.force_level(level)
        for size, k in ((2, 2), (3, 2), (9, 2), (17, 8), (300, 255), (4096, 255), (600, 17), (1000, 3)):
            z, n = np.sort(rng.uniform(-1, 1, size)), rng.integers(1, 50, size).astype(np.float64)
            for force in (True, False):
                optimal_partition_centers(z, n, k, force, backend="native")
                cases += 1
        # prefix sums that overflowed (the Python entry refuses these; the library must still stay in bounds)
        prefix = np.cumsum(np.stack([np.full(600, 1e306), np.linspace(-1e306, 1e306, 600), np.full(600, 1e306)]),
                           axis=1)
        prefix = np.concatenate([np.zeros((3, 1)), prefix], axis=1)
        for k in (2, 17, 255):
            native.kmeans_centres(prefix, k, False, (1e-16, 1e-16))
            cases += 1
    native.force_level(None)
    from gefen.math import codebook as cbm
    sizes = ((1, 1), (7, 7), (70_000, 7), (65_536, 4096), (131_071, 131_071))
    for level, (n, period) in [(level, size) for level in levels for size in sizes]:
        native.force_level(level)
        g, counts, expected = torch.randn(n, generator=gen), torch.zeros(4096, dtype=torch.int64), torch.zeros(
            4096, dtype=torch.int64)
        g[: n // 2] *= 2.0**-100  # blocks beyond Markstein's range too
        assert native.histogram_(counts, g, period)
        cbm.accumulate_histogram_(expected, g, period)  # the torch reference
        assert torch.equal(counts, expected)
        cases += 1
    native.force_level(None)
    # the period search's scores: every CPU path, chunk and lane tails, own and caller's (exactly sized) scratch
    from gefen.math.period import divisors
    for level in levels:
        native.force_level(level)
        for n in (1, 2, 7, 8, 9, 12, 64, 65_536, 65_537, 131_077, 131_112, 196_613):
            g = torch.randn(n, generator=gen)
            cands = [d for d in divisors(n) if n // d >= 2]
            for subset in (cands, [d for d in cands if d % 8 == 0]):  # per element; per group of 8
                native.period_scores(g, subset)
                native.period_scores(g, subset, torch.empty(n + 1, dtype=torch.float64))
            g[n // 2] = float("nan")
            try:
                native.period_scores(g, cands)
            except ValueError:
                cases += 1
        # grouped classes: 8 with 11, 12, 97 (runs of 12 + 1), 3; 11 with 12; 13 with 14; 22, 194, 2 (tails too)
        for n in (88, 264, 5824, 90_112, 196_608, 397_312, 8 * 3**5):
            g = torch.randn(n, generator=gen)
            cands = [d for d in divisors(n) if n // d >= 4 and d >= 8]
            for subset in (cands, [d for d in cands if d % 8], [d for d in cands if d % 8 and d % 2 == 0]):
                if subset:
                    native.period_scores(g, subset)
                    native.period_scores(g, subset, torch.empty(n + 1, dtype=torch.float64))
                    cases += 1
            g[n - 1] = float("inf")
            try:
                native.period_scores(g, cands)
            except ValueError:
                cases += 1
        # groups of 8 with one run of G (every lane mask of the AVX-512 products), pieces and tails
        for group in (3, 5, 6, 7, 10, 12):
            n = 16 * group * 53
            g = torch.randn(n, generator=gen)
            native.period_scores(g, [8, 16, group, 2 * group])
            native.period_scores(g, [8, 16, group, 2 * group], torch.empty(n + 1, dtype=torch.float64))
            cases += 1
    native.force_level(None)
    print("ASAN-OK", cases)
    """
)


@needs_library
@pytest.mark.slow
def test_native_library_under_address_sanitizer(tmp_path: Path) -> None:
    """A test-only AddressSanitizer build of the same source, driven over every CPU path, shape class, period,
    dtype and kind: no read or write outside any tensor (ASan aborts the process on the first one)."""
    compiler = _compiler()
    assert compiler is not None, "a C compiler is needed to build the sanitizer library"
    libasan = _libasan(compiler)
    assert libasan is not None, f"{compiler} has no libasan.so"
    library = tmp_path / native.library_filename()
    # -O0: every access the source makes is there and instrumented (an optimised build only drops some), and the
    # build takes ~23 s instead of ~110 s at -O1 -g on the 2-core machine (the drive itself takes ~12 s)
    subprocess.run(
        [
            compiler,
            "-O0",
            "-g",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
            "-ffp-contract=off",
            "-fPIC",
            "-DHIST_FLUSH_ELEMENTS=1500",
            "-shared",
            "-o",
            str(library),
            str(SOURCE),
            "-lm",
        ],
        check=True,
    )
    env = {
        **os.environ,
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        native.LIBRARY_ENV: str(library),
        "PYTHONPATH": str(ROOT / "src"),
    }
    result = subprocess.run([sys.executable, "-c", ASAN_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert "AddressSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ASAN-OK" in result.stdout
    assert int(result.stdout.split("ASAN-OK")[1].split()[0]) >= 400  # every level x shape x period x dtype x kind


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import warnings, torch, gefen
    from gefen.kernels import native
    print("STATUS", native.native_status().available, native.native_status().reason)
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = gefen.Gefen([p], lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p.grad = torch.randn(16, 16)
            opt.step()
    print("WARNINGS", sum("the native backend is unavailable" in str(w.message) for w in caught))
    try:
        gefen.Gefen([torch.nn.Parameter(torch.randn(4))], backend="native")
    except gefen.ConfigError as exc:
        print("REFUSED", exc)
    """
)


@pytest.mark.parametrize(
    "env",
    [{native.LIBRARY_ENV: "/nonexistent/libgefen_kernels.so"}, {native.DISABLE_ENV: "0"}],
    ids=["library-missing", "disabled"],
)
def test_without_the_library_auto_falls_back_with_one_warning_and_native_refuses(env) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "STATUS False" in result.stdout
    assert "WARNINGS 1" in result.stdout  # one warning over three steps, and the steps ran
    assert "REFUSED" in result.stdout and "backend='native' cannot step it" in result.stdout


def test_backend_option_validation() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(gefen.ConfigError, match="backend='fast'"):
        gefen.Gefen([p], backend="fast")
    with pytest.raises(gefen.ConfigError, match="contradicts backend='native'"):
        gefen.Gefen([p], backend="native", fused=True)
    with pytest.raises(gefen.ConfigError, match=r"\['backend'\]"):
        gefen.Gefen([{"params": [p], "backend": "gpu"}])
    assert gefen.Gefen([p], fused=False).param_groups[0]["backend"] == "eager"
    assert gefen.Gefen([p], fused=True).param_groups[0]["backend"] == "compiled"
    muon = gefen.GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], backend="eager")
    assert muon.param_groups[0]["backend"] == "eager"
