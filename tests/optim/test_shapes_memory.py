"""Every shape keeps the memory promise (issue 36): about one byte of state per element plus O(blocks), whatever the
shape, on every backend.

The bound asserted, from the state layout (README "State and memory"; gefen.state): a parameter of ``N`` elements in
``B`` blocks of ``P`` holds 1 byte of codes per element, 4 bytes of magnitude per block, 4 bytes of second moment per
block (block kind) or per row and column (factored kind), NorMuon's 4 per row, and 8 bytes per int64 counter, so

    state_bytes <= 1.1 N + 8 B + 4 (R + C) [factored] + 4 R [NorMuon] + 8 * counters

and the layout rule (gefen.math.period.layout_period) makes ``B`` small: blocks hold more than 8 elements whenever
the tensor does, so ``8 B / N < 1`` and a tensor of 64 elements or more stays under 2.25 bytes/element (case 010's
bar, against AdamW's 8). Degenerate shapes (a dimension of 1, thin or short tensors, N-D with unit dimensions) are
the point: before the rule a (4096, 1) column held 9 bytes/element in both moment kinds.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gefen
from gefen.kernels.native import native_status
from gefen.math.period import SHORT_ROW, is_short_rowed
from gefen.state import NORMUON_STEP, NORMUON_V, PERIOD, STEP, has_row_statistics, is_factorable

#: The backends every shape runs on here (the compiled and Triton backends: the fixed cases below).
BACKENDS = ["eager"] + (["native"] if native_status().available else [])

#: Dimensions drawn for shapes: mostly degenerate sizes (1, 2, 3, 8, 9), some ordinary ones.
_DIM = st.one_of(st.sampled_from([1, 1, 2, 3, 8, 9]), st.integers(1, 12), st.integers(13, 300))


@st.composite
def _shapes(draw: st.DrawFn, min_dims: int = 1, max_dims: int = 4) -> tuple[int, ...]:
    """A shape of 1 to 20,000 elements."""
    shape = tuple(draw(st.lists(_DIM, min_size=min_dims, max_size=max_dims)))
    numel = 1
    for d in shape:
        numel *= d
    if numel > 20_000:
        shape = tuple(min(d, 4) for d in shape)
    return shape


def _gradient(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Row-scaled Gaussian gradient (rows of very different scales, as real layers have)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp(2 * torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=gen))
    return torch.randn(shape, generator=gen) * rows


def _stepped(kind: str, shapes: list[tuple[int, ...]], seed: int, **options: object) -> list[tuple[dict, dict]]:
    """One parameter per shape in one optimizer (one codebook fit, the slow part) after its first step, which fixes
    every period and allocates all the state; returns each parameter's state and its state_report row."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    make = gefen.Gefen if kind == "Gefen" else gefen.GefenMuon
    opt = make([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3, **options)
    for i, p in enumerate(params):
        p.grad = _gradient(tuple(p.shape), seed + i)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a codebook from few values warns
        opt.step()
    return [(opt.state[p], row) for p, row in zip(params, opt.state_report())]


def _bound(shape: tuple[int, ...], state: dict, row: dict) -> int:
    """The promise, in bytes: 1.1 N + 8 B + 4 (R + C) when factored + 4 R for NorMuon + 8 per counter."""
    numel, period = row["numel"], row["period"]
    blocks = numel // period
    extra = 4 * (shape[0] + shape[1]) if row["second_moment"] == "factored" else 0
    extra += 4 * shape[0] if NORMUON_V in state else 0
    counters = sum(8 for key in state if key in (STEP, PERIOD, NORMUON_STEP))
    return int(1.1 * numel) + 8 * blocks + extra + counters


def _check(shape: tuple[int, ...], state: dict, row: dict) -> None:
    numel, period = row["numel"], row["period"]
    assert numel % period == 0
    assert row["state_bytes"] <= _bound(shape, state, row), row
    if numel > SHORT_ROW:  # blocks of more than 8 elements (or one block for the whole tensor)
        assert period > SHORT_ROW, row
    if numel >= 64:
        assert row["state_bytes"] / numel <= 2.25, row
    if is_short_rowed(shape):
        assert row["layout"] == "blocks (flattened: degenerate shape)" and row["second_moment"] != "factored"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(_shapes(), min_size=1, max_size=5),
    factored=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 1000),
)
def test_gefen_state_bytes_bound_for_every_shape(shapes, factored, backend, seed):
    for shape, (state, row) in zip(shapes, _stepped("Gefen", shapes, seed, factored_v_2d=factored, backend=backend)):
        _check(shape, state, row)
        assert row["second_moment"] == ("factored" if factored and is_factorable(shape) else "block")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(_shapes(min_dims=2, max_dims=2), min_size=1, max_size=5),
    normuon=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 1000),
)
def test_gefen_muon_state_bytes_bound_for_every_matrix_shape(shapes, normuon, backend, seed):
    for shape, (state, row) in zip(shapes, _stepped("GefenMuon", shapes, seed, normuon=normuon, backend=backend)):
        _check(shape, state, row)
        # NorMuon's (R,) row statistic only where rows hold 8 elements or more (4/C bytes per element: 4 for a column)
        assert row["second_moment"] == "momentum" and (NORMUON_V in state) is (normuon and has_row_statistics(shape))


# ------------------------------------------------------------------------------------------- case 010 and friends


@pytest.mark.parametrize("factored", [True, False])
def test_column_parameter_state_is_one_byte_per_element_case_010(factored):
    """Case 010: a (4096, 1) column. A constant gradient has no block structure (every §3.2 score is 0), so the
    period is the §3.4 fallback, the largest divisor of 4096 that is <= 2048: 2048, two blocks. State: 4096 bytes of
    codes, 2 magnitudes and 2 second moments (4 bytes each), two int64 counters = 4128 bytes (1.008 B/element; it
    was 9 B/element: one-element blocks)."""
    p = torch.nn.Parameter(torch.zeros(4096, 1))
    opt = gefen.Gefen([p], lr=1e-3, factored_v_2d=factored)
    p.grad = torch.full((4096, 1), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert opt.state_bytes() - 1024 == 4096 + 2 * 4 + 2 * 4 + 2 * 8
    (row,) = opt.state_report()
    assert row["period"] == 2048 and row["second_moment"] == "block"
    assert row["layout"] == "blocks (flattened: degenerate shape)"


def test_column_parameter_with_a_random_gradient_stays_near_one_byte_case_010():
    """The case as filed: randn gradients, both moment kinds, at most 2.25 B/element (AdamW: 8)."""
    for kwargs in ({}, {"factored_v_2d": False}):
        p = torch.nn.Parameter(torch.randn(4096, 1))
        opt = gefen.Gefen([p], lr=1e-3, **kwargs)
        p.grad = torch.randn_like(p)
        opt.step()
        assert (opt.state_bytes() - 1024) / p.numel() <= 2.25


def test_muon_column_matrix_state_is_one_byte_per_element():
    """GefenMuon holds codes and magnitudes only: (4096, 1) with a constant gradient, period 2048 as above:
    4096 + 2 * 4 + two counters = 4120 bytes."""
    p = torch.nn.Parameter(torch.zeros(4096, 1))
    opt = gefen.GefenMuon([p], lr=1e-3)
    p.grad = torch.full((4096, 1), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert opt.state_bytes() - 1024 == 4096 + 2 * 4 + 2 * 8


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((4096, 1), "blocks (flattened: degenerate shape)"),
        ((4096,), "blocks (flattened: degenerate shape)"),
        ((64, 3, 1, 1), "blocks (flattened: degenerate shape)"),
        ((48, 64), "factored"),
        ((1, 4096), "blocks"),
        ((4, 3, 16), "blocks"),
    ],
)
def test_state_report_names_each_layout(shape, layout):
    ((_, row),) = _stepped("Gefen", [shape], 0)
    assert row["layout"] == layout


# --------------------------------------------------------------------------------------- compiled and Triton


DEGENERATE = [(4096, 1), (512, 2), (3, 5000), (1, 4096), (300,), (64, 3, 1, 1), (7,)]


@pytest.mark.slow
@pytest.mark.parametrize("factored", [True, False])
def test_compiled_backend_keeps_the_bound_and_matches_eager_on_degenerate_shapes(factored):
    """The compiled kernels take the flattened period as any other: same state bytes and the same parameters as
    the eager reference."""
    pytest.importorskip("torch._inductor")
    results = {}
    for backend in ("eager", "compiled"):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in DEGENERATE]
        opt = gefen.Gefen(params, lr=1e-2, factored_v_2d=factored, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = _gradient(tuple(p.shape), 10 * step + i)
                opt.step()
        for p, row in zip(params, opt.state_report()):
            _check(tuple(p.shape), opt.state[p], row)
        results[backend] = ([p.detach().clone() for p in params], opt.state_bytes())
    assert results["eager"][1] == results["compiled"][1]
    for a, b in zip(results["eager"][0], results["compiled"][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
