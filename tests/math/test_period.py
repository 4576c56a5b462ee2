"""Period search against algorithm.md §3.7 (worked examples of the real code), §3.4 and planted periods, on the
torch reference and on the native library's scores (``backend="native"``, where the library loaded)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gefen.kernels import native
from gefen.kernels.first_step import find_period, first_period
from gefen.math.period import (
    SHORT_ROW,
    divisors,
    fallback_period,
    is_short_rowed,
    largest_divisor_at_most,
    layout_period,
    search_period,
    spans_rows,
)
from tests.reference.period_ref import reference_search_period

#: find_period's backends to run: the torch reference, and the native scores where the library loaded.
BACKENDS = ["torch"] + (["native"] if native.native_status().available else [])


def _spec_input(rows: int, cols: int, by: str) -> torch.Tensor:
    """The deterministic test gradient of algorithm.md §3.7 (no RNG)."""
    i = torch.arange(rows * cols, dtype=torch.int64)
    r, c = i // cols, i % cols
    s = 1 + (13 * (r if by == "rows" else c)) % 17
    sign = torch.where((7 * i) % 3 == 0, -1.0, 1.0)
    g = s.double() * (1 + ((37 * i) % 11).double() / 10) * sign
    return g.float().reshape(rows, cols)


def test_divisors_small_values():
    assert divisors(12) == [1, 2, 3, 4, 6]
    assert divisors(13) == [1]
    assert divisors(1) == []
    assert divisors(16) == [1, 2, 4, 8]
    assert divisors(2**20) == [2**k for k in range(20)]


def test_divisors_match_brute_force():
    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n) if n % d == 0]


def test_largest_divisor_at_most_values():
    assert largest_divisor_at_most(12, 100) == 12
    assert largest_divisor_at_most(12, 5) == 4
    assert largest_divisor_at_most(13, 5) == 1
    assert largest_divisor_at_most(16384, 2048) == 2048
    assert largest_divisor_at_most(2**20, 2048) == 2048


@pytest.mark.parametrize(
    ("rows", "cols", "by", "score_only", "final"),
    [
        (768, 96, "rows", 96, 96),
        (768, 96, "cols", 18, 18),
        (8, 3072, "rows", 1536, 1536),
        (4, 4096, "rows", 1, 4096),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_find_period_matches_spec_table(rows, cols, by, score_only, final, backend):
    g = _spec_input(rows, cols, by)
    assert search_period(g.square()) == score_only
    assert find_period(g, backend=backend) == final


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_constant_gradient_falls_back_to_2048(fill, backend):
    g = torch.full((64, 64), fill)
    assert search_period(g.square()) == 1
    assert find_period(g, backend=backend) == 2048
    assert first_period(g, backend=backend) == (None if fill == 0.0 else 2048)  # all zero: no information yet


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dimensional_spec_examples(backend):
    g = _spec_input(1, 1000, "rows").reshape(1000)
    assert find_period(g, backend=backend) == 125
    assert find_period(torch.arange(1.0, 8.0), backend=backend) == 1
    assert find_period(torch.tensor([3.0]), backend=backend) == 1
    assert first_period(torch.tensor([0.0]), backend=backend) is None


def test_fallback_examples_of_spec():
    assert fallback_period(4 * 4096, (4, 4096)) == 4096
    assert fallback_period(2048, (2048,)) == 2048
    assert fallback_period(12, (3, 4)) == 12
    assert fallback_period(6400, (100, 64)) == 1600
    assert fallback_period(7, (7,)) == 1
    assert fallback_period(2053, (2053,)) == 2053  # prime above 2048: one block (§13.1), not per element
    assert fallback_period(3 * 100003, (100003, 3)) == 3 * 100003
    assert fallback_period(1009, (1009,)) == 1009  # prime below 2048: one block


@pytest.mark.parametrize("backend", BACKENDS)
def test_find_period_refuses_non_finite_and_empty(backend):
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            find_period(torch.tensor([1.0, bad, 2.0, 3.0]), backend=backend)
        with pytest.raises(ValueError, match="finite"):
            first_period(torch.full((300_001,), 1e-3).index_fill_(0, torch.tensor([299_999]), bad), backend=backend)
    with pytest.raises(ValueError, match="non-empty"):
        find_period(torch.zeros(0), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        find_period(torch.ones(16), backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("period", [16, 32, 48, 96, 128])
def test_planted_period_is_recovered(period, backend):
    gen = torch.Generator().manual_seed(period)
    blocks = 64
    scales = torch.exp(torch.randn(blocks, 1, generator=gen) * 2)
    g = torch.randn(blocks, period, generator=gen) * scales
    assert find_period(g.reshape(-1), backend=backend) == period
    assert find_period(g.t(), backend=backend) == find_period(g.t().contiguous(), backend="torch")  # strided


def test_cap_splits_large_periods():
    # 8 x 3072 rows: the score picks 3072, the 1024 cap splits it to 1536 (spec table).
    assert search_period(_spec_input(8, 3072, "rows").square()) == 1536


@settings(max_examples=40, deadline=None)
@given(
    n_blocks=st.integers(4, 40),
    period=st.sampled_from([1, 2, 3, 6, 10, 12, 20, 24, 36, 60]),
    seed=st.integers(0, 10_000),
)
def test_search_matches_direct_reference(n_blocks, period, seed):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(n_blocks, 1, generator=gen))
    g = (torch.randn(n_blocks, period, generator=gen) * scales).reshape(-1)
    x = g.square()
    expected = reference_search_period(x.double().tolist())
    assert search_period(x) == expected
    final = expected if expected != 1 else fallback_period(g.numel(), tuple(g.shape))
    for backend in BACKENDS:
        assert find_period(g, backend=backend) == final


def test_result_always_divides_numel():
    gen = torch.Generator().manual_seed(0)
    for n in [8, 9, 30, 97, 360, 1001, 4096, 5040]:
        p = find_period(torch.randn(n, generator=gen))
        assert n % p == 0
        assert p > 1  # every n >= 8 here has a divisor in [8, 2048] or is <= 2048 itself


# ---------------------------------------------------------------------------------------------- the layout rule


@pytest.mark.parametrize(
    "shape, short",
    [
        ((4096,), True),  # 1-D: rows of one element
        ((4096, 1), True),  # a column (per-row scale, one-output linear layer)
        ((4096, 8), True),  # rows of 8 elements: the search never selects a period <= 8
        ((64, 3, 1, 1), True),  # 1x1 conv over 3 channels: rows of 3
        ((4096, 1, 1), True),
        ((4096, 9), False),
        ((1, 4096), False),  # one long row
        ((3, 5000), False),
        ((64, 1, 3, 3), False),  # depthwise 3x3: rows of 9
        ((1,), False),  # one element: nothing to share
        ((), False),
        ((1, 1), False),
        ((0, 4), False),
    ],
)
def test_short_rowed_shapes_are_those_with_rows_of_at_most_eight(shape, short):
    assert is_short_rowed(shape) is short


@pytest.mark.parametrize(
    "period, shape, expected",
    [
        (2048, (4096, 1), 2048),  # short rows: the flattened period is kept (one-element rows would give 1)
        (2048, (4096,), 2048),
        (1024, (4096, 2), 1024),
        (16, (4096, 3), 16),  # a searched period that does not tile rows of 3, kept: blocks span rows
        (1, (2, 3), 1),  # 6 elements: per-element (under 8, algorithm.md §3.4)
        (40, (24, 40), 40),  # ordinary rows: a period dividing the row is kept
        (80, (24, 40), 40),  # one spanning two rows becomes the row
        (32, (24, 40), 20),  # one not tiling the row becomes its largest divisor below it
        (16, (1024, 34), 34),  # ... unless that divisor is <= 8 (here 2): then the whole row
        (12, (16, 13), 13),  # a prime row length: the whole row, never one-element blocks
        (9, (64, 1, 3, 3), 9),
        (576, (64, 1, 3, 3), 9),
        (5, (5,), 5),
    ],
)
def test_layout_period_examples(period, shape, expected):
    assert layout_period(period, shape) == expected


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4).map(tuple), data=st.data())
def test_layout_period_never_gives_blocks_of_eight_or_fewer_elements(shape, data):
    """For every shape and every period the search can return (a divisor of numel: 1 or the fallback only below 8
    elements), the kept period divides numel, and blocks hold more than 8 elements unless the whole tensor has at
    most 8 (or the searched period was that small: the flattened tensor keeps it)."""
    numel = 1
    for d in shape:
        numel *= d
    candidates = [d for d in divisors(numel) + [numel] if d > SHORT_ROW or d == numel or numel < 8]
    period = data.draw(st.sampled_from(candidates))
    kept = layout_period(period, shape)
    assert numel % kept == 0
    assert kept > SHORT_ROW or kept == period
    if not is_short_rowed(shape) and numel > 1:
        assert not spans_rows(shape, kept)  # ordinary shapes keep blocks inside rows
