"""Codebook math against algorithm.md §4 (histogram, exact DP, padding, nearest code) and §13.2/§13.3/§13.10.

Expected values come from the loop references in tests/reference/codebook_ref.py, from §4.5's worked vectors,
or from arithmetic done by hand in the test; never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gefen.math.codebook as cb
from gefen.math.codebook import (
    CODEBOOK_SIZE,
    HISTOGRAM_BINS,
    accumulate_histogram_,
    bin_centers,
    decode,
    encode,
    fit_codebook,
    nearest_code,
    optimal_partition_centers,
    validate_codebook,
    zero_code_index,
)
from tests.reference.codebook_ref import (
    brute_force_partition,
    reference_dp_centers,
    reference_histogram,
    reference_nearest_code,
    vectorised_reference_dp_centers,
)

# §4.4 / §4.5; the real code's points are float32 (bin centres), and §4.5's vectors depend on that rounding
SPEC_POINTS = np.array([-0.9, -0.5, -0.1, 0.0, 0.2, 0.6, 0.95], dtype=np.float32).astype(np.float64).tolist()
SPEC_WEIGHTS = [1, 3, 5, 10, 4, 2, 1]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _centres(k: np.ndarray | list) -> np.ndarray:
    """Bin centres -1 + (k + 0.5) / 2048 in float64 (exact), for bins ``k``."""
    return -1.0 + (np.asarray(k, dtype=np.float64) + 0.5) / 2048.0


def _gradient_histogram(seed: int, n_blocks: int = 4000, period: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n_blocks, period, generator=gen) * torch.rand(n_blocks, 1, generator=gen).exp()
    g = g * torch.randn(n_blocks, period, generator=gen).abs() ** 2  # heavy tails
    return accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), g, period)


def _reference_fit(active: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """§4.3 reference centres of the active bins, cast to float32 as ``fit_codebook`` does."""
    centres = vectorised_reference_dp_centers(_centres(active), weights.astype(np.float64), k)
    return np.array(centres, dtype=np.float32)


@pytest.fixture(scope="module")
def full_codebook() -> torch.Tensor:
    return fit_codebook(_gradient_histogram(0, n_blocks=40, period=16))  # about 400 active bins


# ----------------------------------------------------------------------------------------------- histogram


def test_histogram_end_bins_and_zero_bin():
    g = torch.tensor([[-3.0, 0.0, 3.0, 1.5], [0.5, -0.25, 1.0, -1.0]])
    counts = accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), g, 4)
    expected = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    # u = -1, 0, 1, 0.5 | 0.5, -0.25, 1, -1  ->  bins floor((u + 1) * 2048)
    for b in (0, 2048, 4095, 3072, 3072, 1536, 4095, 0):
        expected[b] += 1
    assert torch.equal(counts, expected)


def test_histogram_all_zero_blocks_count_in_bin_2048():
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    counts[7] = 5
    out = accumulate_histogram_(counts, torch.zeros(8, 16, dtype=torch.bfloat16), 16)
    assert out is counts
    assert int(counts[2048]) == 128 and int(counts[7]) == 5 and int(counts.sum()) == 133


@FAST
@given(
    blocks=st.integers(1, 12),
    period=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
    zero_block=st.booleans(),
)
def test_histogram_matches_loop_reference(blocks, period, dtype, seed, zero_block):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(blocks, period, generator=gen) * 10 ** torch.randint(-3, 3, (blocks, 1), generator=gen)
    if zero_block:
        g[0] = 0
    g = g.to(dtype)
    counts = accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), g.reshape(-1), period)
    assert counts.tolist() == reference_histogram(g, period)


def test_histogram_chunked_equals_unchunked_and_reference(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(50, 24, generator=gen).to(torch.bfloat16)
    whole = accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), g, 24)
    for chunk in (1, 24, 100, 7 * 24):
        monkeypatch.setattr(cb, "_CHUNK_ELEMENTS", chunk)
        chunked = accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), g, 24)
        assert torch.equal(chunked, whole)
    assert whole.tolist() == reference_histogram(g, 24)


@pytest.mark.parametrize(
    ("counts", "g", "period"),
    [
        (torch.zeros(HISTOGRAM_BINS, dtype=torch.int32), torch.ones(4), 2),
        (torch.zeros(100, dtype=torch.int64), torch.ones(4), 2),
        (torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), torch.ones(4, dtype=torch.int64), 2),
        (torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), torch.ones(6), 4),
        (torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), torch.ones(6), 0),
        (torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), torch.tensor([1.0, 2.0, 3.0, float("nan")]), 2),
    ],
)
def test_histogram_rejects_bad_input_and_leaves_counts_untouched(monkeypatch, counts, g, period):
    monkeypatch.setattr(cb, "_CHUNK_ELEMENTS", 2)  # the NaN sits in the second chunk
    before = counts.clone()
    with pytest.raises(ValueError):
        accumulate_histogram_(counts, g, period)
    assert torch.equal(counts, before)


def test_bin_centers_are_the_midpoints():
    z = bin_centers()
    assert z.dtype == torch.float32 and z.shape == (HISTOGRAM_BINS,)
    assert np.array_equal(z.numpy().astype(np.float64), _centres(np.arange(HISTOGRAM_BINS)))
    edges = np.linspace(-1.0, 1.0, HISTOGRAM_BINS + 1)
    assert np.array_equal(z.numpy(), ((edges[:-1] + edges[1:]) / 2).astype(np.float32))


# --------------------------------------------------------------------------------------------------- DP


@pytest.mark.parametrize(
    ("k", "force", "expected"),
    [
        (4, True, [-1.0, -0.5, 0.0157894734, 1.0]),
        (3, True, [-1.0, -0.0545454547, 1.0]),
        (4, False, [-0.6, -0.0333333351, 0.2, 0.716666698]),
    ],
)
def test_dp_worked_examples_of_section_4_5(k, force, expected):
    want = np.array(expected, dtype=np.float32)
    got = optimal_partition_centers(np.array(SPEC_POINTS), np.array(SPEC_WEIGHTS, dtype=float), k, force)
    assert got.dtype == np.float64
    assert np.array_equal(got.astype(np.float32), want)
    ref = reference_dp_centers(SPEC_POINTS, SPEC_WEIGHTS, k, force)
    assert np.array_equal(np.array(ref, dtype=np.float32), want)


@st.composite
def _dp_inputs(draw, max_points: int = 24, max_k: int = 7):
    size = draw(st.integers(1, max_points))
    kind = draw(st.sampled_from(["grid", "repeats", "uniform", "continuous"]))
    if kind == "grid":  # distinct dyadic points, small integer weights: exact sums, many exact ties
        cells = draw(st.lists(st.integers(-64, 64), min_size=size, max_size=size, unique=True))
        points = np.sort(np.array(cells, dtype=float)) / 64
        weights = np.array(draw(st.lists(st.integers(1, 3), min_size=size, max_size=size)), dtype=float)
    elif kind == "repeats":  # repeated point values
        cells = draw(st.lists(st.integers(-6, 6), min_size=size, max_size=size))
        points = np.sort(np.array(cells, dtype=float)) / 7
        weights = np.array(draw(st.lists(st.integers(1, 4), min_size=size, max_size=size)), dtype=float)
    elif kind == "uniform":  # equally spaced, equal weights: symmetric optima tie exactly
        points = (np.arange(size) - size / 2) / 32
        weights = np.ones(size)
    else:
        floats = st.floats(-1, 1, allow_nan=False, allow_subnormal=False)
        points = np.sort(np.array(draw(st.lists(floats, min_size=size, max_size=size))))
        weights = np.array(draw(st.lists(st.floats(0.01, 100), min_size=size, max_size=size)))
    force = draw(st.booleans()) and size >= 2
    k = draw(st.integers(2 if force else 1, min(size, max_k)))
    return points, weights, k, force


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dp_inputs())
def test_dp_equals_loop_reference(case):
    points, weights, k, force = case
    got = optimal_partition_centers(points, weights, k, force)
    assert np.array_equal(got, np.array(reference_dp_centers(points, weights, k, force)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dp_inputs(max_points=9, max_k=4))
def test_dp_equals_brute_force_over_all_segmentations(case):
    points, weights, k, force = case
    want, gap = brute_force_partition(points, weights, k, force)
    if gap > 1e-9:  # a unique optimum, not a float near-tie that the DP's rounding may break either way
        got = optimal_partition_centers(points, weights, k, force)
        assert np.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_reference_on_medium_histograms(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(150, 400))
    bins = np.sort(rng.choice(HISTOGRAM_BINS, size, replace=False))
    if seed % 2:  # integer counts with many equal values
        weights = rng.integers(1, 4, size).astype(float)
    else:
        weights = np.ceil(rng.exponential(30, size) ** 2)
    k = int(rng.integers(20, 120))
    for force in (True, False):
        want = vectorised_reference_dp_centers(_centres(bins), weights, k, force)
        assert np.array_equal(optimal_partition_centers(_centres(bins), weights, k, force), np.array(want))


@pytest.mark.parametrize(("size", "k"), [(64, 9), (300, 37), (1000, 255)])
def test_dp_equals_reference_with_exact_ties(size, k):
    points, weights = _centres(np.arange(size) * 3 + 100), np.ones(size)  # equally spaced, equal weights
    want = vectorised_reference_dp_centers(points, weights, k)
    assert np.array_equal(optimal_partition_centers(points, weights, k), np.array(want))


@pytest.mark.slow
def test_dp_equals_reference_at_full_size():
    counts = _gradient_histogram(1, n_blocks=20000).numpy()
    counts[counts == 0] = 1  # every bin active: A = 4096
    points, weights = _centres(np.arange(HISTOGRAM_BINS)), counts.astype(np.float64)
    want = vectorised_reference_dp_centers(points, weights, 256)
    assert np.array_equal(optimal_partition_centers(points, weights, 256), np.array(want))


@pytest.mark.parametrize(
    ("points", "weights", "k", "force"),
    [
        ([0.0, 1.0], [1.0, 1.0], 0, False),
        ([0.0, 1.0], [1.0, 1.0], 3, False),
        ([0.0, 1.0], [1.0, 1.0], 1, True),
        ([1.0, 0.0], [1.0, 1.0], 2, True),
        ([0.0, 1.0], [1.0, 0.0], 2, True),
        ([0.0, np.nan], [1.0, 1.0], 2, True),
        ([0.0, 1.0], [1.0], 1, False),
        ([], [], 1, False),
        ([0.0, 1.0], [1.0, 1.0], 1.0, False),
    ],
)
def test_dp_rejects_bad_input(points, weights, k, force):
    with pytest.raises(ValueError):
        optimal_partition_centers(np.array(points), np.array(weights), k, force)


# ---------------------------------------------------------------------------------------------- fit


def _assert_codebook_shape(c: torch.Tensor) -> None:
    assert c.dtype == torch.float32 and c.shape == (CODEBOOK_SIZE,)
    assert bool((c[1:] >= c[:-1]).all()) and float(c[0]) == -1.0 and float(c[-1]) == 1.0
    assert int((c == 0).sum()) == 1
    first_one = int(torch.nonzero(c == 1)[0])
    assert bool((c[1 : first_one + 1] > c[:first_one]).all())  # only trailing +1 codes repeat
    assert validate_codebook(c) is None


def test_fit_codebook_full_histogram_is_dp_plus_zero(full_codebook):
    counts = _gradient_histogram(0, n_blocks=40, period=16)
    active = np.flatnonzero(counts.numpy())
    assert active.size >= 255
    _assert_codebook_shape(full_codebook)
    assert int((full_codebook == 1).sum()) == 1
    dp = _reference_fit(active, counts.numpy()[active], 255)
    assert np.array_equal(full_codebook.numpy(), np.sort(np.append(dp, np.float32(0))))


def test_fit_codebook_padding_keeps_every_active_centre():
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    bins = [3, 1000, 2047, 2048, 2100, 4000, 4095]
    counts[bins] = torch.tensor([1, 3, 5, 10, 4, 2, 1])
    c = fit_codebook(counts)
    _assert_codebook_shape(c)
    head = np.sort(np.concatenate([_centres(bins), [-1.0, 0.0, 1.0]])).astype(np.float32)
    assert np.array_equal(c.numpy()[: head.size], head)
    assert bool((c[head.size :] == 1).all())


def test_fit_codebook_all_zero_gradients():
    counts = accumulate_histogram_(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64), torch.zeros(64, 32), 32)
    c = fit_codebook(counts)
    assert c[:4].tolist() == [-1.0, 0.0, 2.0**-12, 1.0] and bool((c[3:] == 1).all())


@pytest.mark.parametrize("active", [253, 254, 255, 300])
def test_fit_codebook_around_the_padding_threshold(active):
    rng = np.random.default_rng(active)
    bins = np.sort(rng.choice(HISTOGRAM_BINS, active, replace=False))
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    counts[torch.from_numpy(bins)] = torch.from_numpy(rng.integers(1, 50, active))
    c = fit_codebook(counts)
    _assert_codebook_shape(c)
    if active <= 253:  # every active centre kept, plus -1, 0, +1: exactly 256 codes
        want = np.sort(np.concatenate([_centres(bins), [-1.0, 0.0, 1.0]])).astype(np.float32)
        assert np.array_equal(c.numpy(), want)
    else:  # DP with min(255, A) clusters, then 0.0, then +1 copies
        k = min(255, active)
        dp = _reference_fit(bins, counts.numpy()[bins], k)
        want = np.sort(np.concatenate([dp, [0.0], np.ones(CODEBOOK_SIZE - k - 1)]).astype(np.float32))
        assert np.array_equal(c.numpy(), want)


def test_fit_codebook_symmetric_histogram_has_one_zero():
    half = np.random.default_rng(5).integers(1, 20, HISTOGRAM_BINS // 2)
    counts = torch.from_numpy(np.concatenate([half[::-1], half]).astype(np.int64))
    _assert_codebook_shape(fit_codebook(counts))


@pytest.mark.parametrize(
    "counts",
    [
        torch.zeros(HISTOGRAM_BINS, dtype=torch.int64),
        torch.ones(HISTOGRAM_BINS, dtype=torch.int32),
        torch.ones(100, dtype=torch.int64),
        -torch.ones(HISTOGRAM_BINS, dtype=torch.int64),
    ],
)
def test_fit_codebook_rejects_bad_histograms(counts):
    with pytest.raises(ValueError):
        fit_codebook(counts)


# -------------------------------------------------------------------------------------- nearest code


def _probe_values(codebook: torch.Tensor) -> torch.Tensor:
    c = codebook.double()
    mids = ((c[1:] + c[:-1]) / 2).float()
    base = torch.cat([codebook, mids, torch.tensor([-1.5, 1.5, -3.0, 3.0, 0.0, -0.0])])
    up = torch.nextafter(base, torch.full_like(base, 10.0))
    down = torch.nextafter(base, torch.full_like(base, -10.0))
    rand = torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 2.2 - 1.1
    return torch.cat([base, up, down, rand])


def test_nearest_code_matches_brute_force_on_fitted_codebook(full_codebook):
    u = _probe_values(full_codebook)
    assert torch.equal(nearest_code(u, full_codebook), reference_nearest_code(u, full_codebook))


@pytest.mark.parametrize("seed", range(3))
def test_nearest_code_matches_brute_force_on_random_codebooks(seed):
    gen = torch.Generator().manual_seed(seed)
    inner = torch.sort(torch.rand(CODEBOOK_SIZE - 3, generator=gen) * 2 - 1).values
    codebook = torch.sort(torch.cat([inner, torch.tensor([-1.0, 0.0, 1.0])])).values
    u = _probe_values(codebook)
    u = u[: u.numel() // 2 * 2].reshape(2, -1)
    got = nearest_code(u, codebook)
    assert got.shape == u.shape and got.dtype == torch.int64
    assert torch.equal(got, reference_nearest_code(u, codebook))


def test_nearest_code_midpoint_goes_to_lower_index_and_clamps():
    codebook = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    u = torch.tensor([0.25, 0.75, -0.5, -5.0, 5.0, 0.5, 0.2500001, -1.0, 1.0])
    assert nearest_code(u, codebook).tolist() == [1, 2, 0, 0, 3, 2, 2, 0, 3]


def test_nearest_code_repeated_codes_give_the_first_one():
    codebook = torch.tensor([-1.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    u = torch.tensor([1.0, 0.9, 0.8, 0.75])
    assert nearest_code(u, codebook).tolist() == [3, 3, 3, 2]


def test_zero_code_index(full_codebook):
    i = zero_code_index(full_codebook)
    assert float(full_codebook[i]) == 0.0
    assert int(reference_nearest_code(torch.zeros(1), full_codebook)[0]) == i
    with pytest.raises(ValueError):
        zero_code_index(torch.tensor([-1.0, -0.25, 0.25, 1.0]))


# ------------------------------------------------------------------------------------- encode / decode


def _max_half_gap(codebook: torch.Tensor) -> float:
    return float((codebook[1:] - codebook[:-1]).max()) / 2


@FAST
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 50),
    seed=st.integers(0, 2**31 - 1),
    power=st.integers(-20, 20),
)
def test_encode_decode_error_bound_and_power_of_two_scaling(full_codebook, rows, cols, seed, power):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=gen) * 10 ** torch.randint(-2, 3, (rows, 1), generator=gen).float()
    codes, scale = encode(m, full_codebook)
    assert codes.dtype == torch.uint8 and codes.shape == m.shape and scale.dtype == torch.float32
    assert torch.equal(scale, m.abs().amax(dim=1))
    u = (m / scale[:, None]).reshape(-1)
    assert torch.equal(codes.reshape(-1).long(), reference_nearest_code(u, full_codebook))
    out = decode(codes, scale, full_codebook)
    bound = (_max_half_gap(full_codebook) + 1e-6) * scale[:, None]
    assert bool(((out - m).abs() <= bound).all())
    scaled_codes, scaled_scale = encode(m * 2.0**power, full_codebook)
    assert torch.equal(scaled_codes, codes) and torch.equal(scaled_scale, scale * 2.0**power)


def test_decode_is_code_times_scale(full_codebook):
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=gen)
    scale = torch.rand(5, generator=gen) * 3
    want = full_codebook.numpy()[codes.numpy().astype(np.int64)] * scale.numpy()[:, None]
    assert np.array_equal(decode(codes, scale, full_codebook).numpy(), want)


def test_encode_zero_rows_and_exact_zero_elements_decode_to_zero(full_codebook):
    m = torch.tensor([[0.0, 0.0, -0.0], [0.0, 2.0, -1.0], [-0.0, 1e-30, 3.0]])
    codes, scale = encode(m, full_codebook)
    out = decode(codes, scale, full_codebook)
    assert scale.tolist() == [0.0, 2.0, 3.0]
    assert torch.equal(out[0], torch.zeros(3)) and float(out[1, 0]) == 0.0 and float(out[2, 0]) == 0.0
    assert int(codes[1, 0]) == zero_code_index(full_codebook)
    assert float(out[1, 1]) == 2.0 and float(out[2, 2]) == 3.0  # u = 1 decodes to the block magnitude


def test_encode_decode_chunked_equal_unchunked(full_codebook, monkeypatch):
    m = torch.randn(37, 11, generator=torch.Generator().manual_seed(2))
    m[3] = 0
    codes, scale = encode(m, full_codebook)
    out = decode(codes, scale, full_codebook)
    for chunk in (1, 30, 200):
        monkeypatch.setattr(cb, "_CHUNK_ELEMENTS", chunk)
        chunked = encode(m, full_codebook)
        assert torch.equal(chunked[0], codes) and torch.equal(chunked[1], scale)
        assert torch.equal(decode(codes, scale, full_codebook), out)


def test_encode_decode_reject_bad_input(full_codebook):
    with pytest.raises(ValueError):
        encode(torch.zeros(4), full_codebook)
    with pytest.raises(ValueError):
        encode(torch.zeros(2, 2, dtype=torch.float64), full_codebook)
    with pytest.raises(ValueError):
        decode(torch.zeros(2, 2, dtype=torch.int64), torch.ones(2), full_codebook)
    with pytest.raises(ValueError):
        decode(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(3), full_codebook)


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda c: c.tolist(), "torch.Tensor"),
        (lambda c: c.double(), "float32"),
        (lambda c: c[:-1], "shape"),
        (lambda c: c.index_fill(0, torch.tensor([5]), float("nan")), "NaN"),
        (lambda c: c.flip(0), "sorted"),
        (lambda c: c * 0.5, "-1"),
        (lambda c: torch.where(c == 0, torch.tensor(1e-3), c).sort().values, "0.0"),
    ],
)
def test_validate_codebook_reasons(full_codebook, mutate, fragment):
    assert validate_codebook(full_codebook) is None
    reason = validate_codebook(mutate(full_codebook))
    assert isinstance(reason, str) and fragment in reason
