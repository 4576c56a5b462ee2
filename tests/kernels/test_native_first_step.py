"""The first step's native pieces against their references: the exact k-means of the codebook fit (identical
centres, near-ties included), the codebook histogram (identical counts, non-finite input refused untouched), the
in-place period score (identical to the plain ``diff()`` chain of algorithm.md §3.2), and the native period scores
(within 1e-11 of the torch reference, identical on every CPU path and thread count)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gefen.kernels import first_step, native
from gefen.kernels.first_step import find_period, optimal_partition_centers
from gefen.math import codebook
from gefen.math.codebook import HISTOGRAM_BINS, bin_centers
from gefen.math.period import divisors, period_scores

AVAILABLE = native.native_status().available
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"native library: {native.native_status().reason}")


@st.composite
def partitions(draw):
    """Sorted points (bin centres or arbitrary), positive weights (flat, skewed, tied) and a cluster count."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    size = draw(st.sampled_from([2, 3, 17, 255, 256, 300, 1000, 4096]))
    if draw(st.booleans()):
        z = bin_centers().numpy()[np.sort(rng.choice(HISTOGRAM_BINS, size, replace=False))].astype(np.float64)
    else:
        z = np.sort(rng.uniform(-1.0, 1.0, size))
    style = draw(st.sampled_from(["flat", "skewed", "equal"]))
    if style == "flat":
        n = rng.integers(1, 1000, size).astype(np.float64)
    elif style == "skewed":
        n = np.round(np.exp(rng.normal(0.0, 4.0, size))) + 1.0
    else:  # equal weights on a symmetric grid: many exact ties between partitions
        n, z = np.ones(size), np.linspace(-1.0, 1.0, size)
    k = draw(st.integers(2, min(size, 256)))
    return z, n, k, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(partitions())
def test_native_kmeans_equals_the_numpy_reference(case) -> None:
    z, n, k, force = case
    expected = optimal_partition_centers(z, n, k, force, backend="numpy")
    try:
        for level in _native_levels():  # the scalar rows, and AVX-512's 8 candidates per register
            native.force_level(level)
            got = optimal_partition_centers(z, n, k, force, backend="native")
            assert got.dtype == np.float64 and got.shape == (k,)
            np.testing.assert_array_equal(got, expected, err_msg=level)
    finally:
        native.force_level(None)


def test_native_kmeans_full_histogram_and_bad_backend() -> None:
    rng = np.random.default_rng(5)
    counts = np.round(1e5 * np.exp(-0.5 * (bin_centers().numpy() / 0.3) ** 2)) + rng.integers(0, 3, HISTOGRAM_BINS)
    active = counts > 0
    z, n = bin_centers().numpy()[active].astype(np.float64), counts[active].astype(np.float64)
    expected = optimal_partition_centers(z, n, 255, True, backend="numpy")
    np.testing.assert_array_equal(optimal_partition_centers(z, n, 255, True, backend="native"), expected)
    assert expected[0] == -1.0 and expected[-1] == 1.0
    with pytest.raises(ValueError, match="backend"):
        optimal_partition_centers(z, n, 255, True, backend="gpu")


LOOPS_IN_A_CHILD = """
import numpy as np, torch
from gefen.kernels.first_step import optimal_partition_centers
from gefen.math.codebook import HISTOGRAM_BINS, bin_centers
torch.set_num_threads(2)
rng = np.random.default_rng(7)
counts = np.round(1e5 * np.exp(-0.5 * (bin_centers().numpy() / 0.2) ** 2)) + rng.integers(1, 4, HISTOGRAM_BINS)
z, n = bin_centers().numpy().astype(np.float64), counts.astype(np.float64)
for k in (255, 40):
    expected = optimal_partition_centers(z, n, k, True, backend="numpy")
    assert np.array_equal(optimal_partition_centers(z, n, k, True, backend="native"), expected), k
from gefen.kernels import first_step, native
from gefen.math.period import divisors
g = torch.randn(198_048, generator=torch.Generator().manual_seed(3)) * torch.arange(1, 4).repeat_interleave(66_016)
candidates = [p for p in divisors(g.numel()) if g.numel() // p >= 2]
two = native.period_scores(g, candidates)[0]
torch.set_num_threads(1)
assert native.period_scores(g, candidates)[0] == two
import gefen
def stepped(threads):  # factored weights (two regions of two loops each; one thread each) and a norm weight
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((384, 256), (256, 256), (256,))]
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=gen)
        opt.step()
    state = [t.clone() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    return [p.detach().clone() for p in params] + state
two, one = stepped(2), stepped(1)
assert len(two) == len(one) > 3
assert all(torch.equal(a, b) for a, b in zip(two, one)), "native step differs between two threads and one"
print("SAME")
"""


@pytest.mark.parametrize("env", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_WAIT_POLICY": "passive"}], ids=str)
def test_native_loops_in_one_parallel_region_whatever_the_team(env) -> None:
    """The fit's layers share one parallel region of two threads (both solve each layer's middle row, then one
    half each, then a barrier), and so do the period scores' three loops and each of the native step's two pairs of
    loops: a runtime that gives a team of one thread (OMP_THREAD_LIMIT=1, while torch asks for two) runs them on that
    thread instead of waiting at a barrier forever, and one whose idle workers sleep gives the same centres (4096
    active bins: the two-thread layers), the same scores and the same parameters and state after three steps as one
    thread."""
    result = subprocess.run(
        [sys.executable, "-c", LOOPS_IN_A_CHILD], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "SAME", result.stderr[-2000:]


def _torch_histogram(g: torch.Tensor, period: int) -> torch.Tensor:
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    codebook.accumulate_histogram_(counts, g, period)  # the math module's: the torch reference
    return counts


@pytest.mark.parametrize(
    "shape,period", [((1,), 1), ((7,), 7), ((64, 64), 1), ((1000, 7), 7), ((513, 129), 129), ((300, 4096), 4096)]
)
def test_native_histogram_equals_the_torch_reference(shape, period) -> None:
    """Every CPU path (the AVX-512 one divides by Markstein's correction within [2^-64, 2^64] and truly outside it:
    block scales from 2^-140, subnormal maxima, to 2^90 take both) gives the torch reference's counts."""
    gen = torch.Generator().manual_seed(period)
    g = torch.randn(shape, generator=gen) * torch.exp(3 * torch.randn(shape, generator=gen))
    blocks = g.view(-1, period)
    scales = torch.tensor([2.0**-140, 2.0**-70, 2.0**-64, 2.0**64, 2.0**70, 2.0**90])
    blocks[2 : 2 + len(scales)] *= scales[: max(0, blocks.shape[0] - 2), None]
    g.view(-1)[: period * 2] = 0.0  # all-zero blocks divide by 1
    g.view(-1)[-1] = -g.abs().max()  # a block maximum that is negative
    assert bool(torch.isfinite(g).all())
    expected = _torch_histogram(g, period)
    for level in _native_levels():
        native.force_level(level)
        try:
            counts = torch.full((HISTOGRAM_BINS,), 3, dtype=torch.int64)
            first_step.accumulate_histogram_(counts, g, period, backend="native")
        finally:
            native.force_level(None)
        torch.testing.assert_close(counts - 3, expected, rtol=0, atol=0, msg=level)
    assert int(expected.sum()) == g.numel()


@pytest.mark.parametrize("period", [64, 1])  # 1: the one-element blocks' own loop
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_native_histogram_refuses_non_finite_values_untouched(bad, period) -> None:
    g = torch.randn(200_000)
    g[123_456] = bad
    counts = torch.arange(HISTOGRAM_BINS, dtype=torch.int64)
    with pytest.raises(ValueError, match="NaN or Inf"):
        first_step.accumulate_histogram_(counts, g, period, backend="native")
    assert torch.equal(counts, torch.arange(HISTOGRAM_BINS, dtype=torch.int64))
    assert native.histogram_(counts, g, period) is False


@pytest.mark.parametrize("period", [64, 1])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_native_histogram_bound_refuses_exactly_the_values_beyond_it(sign, period) -> None:
    """``bound`` follows the preflight's rule (:func:`gefen.amp.unusable_names`): ``|g| <= bound`` in fp32 passes,
    the next fp32 above it is refused with the counts untouched, and a refused call adds nothing."""
    import gefen.amp

    g = torch.randn(200_000)
    bound = native.as_float32(gefen.amp.usable_bound(g.numel()))
    g[77_777] = sign * bound
    g[5] = 0.0
    g[6] = -0.0
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    assert native.histogram_(counts, g, period, gefen.amp.usable_bound(g.numel()))
    assert gefen.amp.unusable_names([("g", g)]) == []
    assert torch.equal(counts, _torch_histogram(g, period))
    if period == 1:  # every value is its own block's maximum: the end bins, and the zeros in bin 2048
        assert counts[0] == int((g < 0).sum()) and counts[4095] == int((g > 0).sum()) and counts[2048] == 2
    g[77_777] = sign * torch.nextafter(torch.tensor(bound), torch.tensor(float("inf"))).item()
    assert gefen.amp.unusable_names([("g", g)]) == ["g"]
    before = counts.clone()
    assert native.histogram_(counts, g, period, gefen.amp.usable_bound(g.numel())) is False
    assert torch.equal(counts, before)
    assert native.histogram_(counts, g, period)  # no bound: finite values are counted
    with pytest.raises(RuntimeError, match="bound"):
        native.histogram_(counts, g, period, float("nan"))


def _plain_scores(x: torch.Tensor, candidates: list[int]) -> list[float]:
    """algorithm.md §3.2 step 3 written as the plain chain of fresh tensors."""
    logs = torch.log(x.reshape(-1).to(torch.float64) + 1e-12)
    logs = logs - logs.mean()
    prefix = torch.zeros(x.numel() + 1, dtype=torch.float64)
    torch.cumsum(logs, dim=0, out=prefix[1:])
    scores = []
    for p in candidates:
        edges = prefix[::p]
        scores.append(((edges[1:] - edges[:-1]) / p).diff().abs().mean())
    return torch.stack(scores).tolist()


@pytest.mark.parametrize("shape", [(2, 3), (64, 7), (512, 512), (1408, 512), (3, 5, 7, 11)])
@pytest.mark.parametrize("pattern", ["noise", "periodic", "sparse"])
def test_period_scores_in_place_equal_the_plain_chain(shape, pattern) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen)
    if pattern == "periodic":
        x = x * (torch.arange(x.numel()) % 64 + 1).float().view(shape)
    elif pattern == "sparse":
        x = torch.ones(shape)
        x.view(-1)[::3] = 0.0
    x = x.square()
    n = x.numel()
    candidates = [p for p in divisors(n) if n // p >= 2]
    assert period_scores(x, candidates) == _plain_scores(x, candidates)
    assert period_scores(x, []) == []


def _native_levels() -> list[str]:
    order = ["scalar", "avx2", "avx512", "avx512vbmi"]
    return order[: order.index(native.native_status().level) + 1]


def _gradient(n: int, pattern: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    if pattern == "rows":  # a scale per run of 96 elements: a structural period
        g = g * torch.exp(2 * torch.randn(n // 96 + 1, generator=gen)).repeat_interleave(96)[:n]
    elif pattern == "sparse":
        g[::3] = 0.0
    elif pattern == "tiny":  # squares that underflow fp32: ln(0 + 1e-12) for many elements
        g = g * 1e-30
    elif pattern == "huge":
        g = g * 1e18
    return g


@settings(max_examples=30, deadline=None)
@given(
    n=st.sampled_from([2, 7, 8, 9, 12, 96 * 7, 4096, 65_536, 65_537, 65_536 * 3 + 5, 65_536 * 2 + 40, 96 * 1500]),
    pattern=st.sampled_from(["noise", "rows", "sparse", "tiny", "huge"]),
    seed=st.integers(0, 1000),
)
def test_native_period_scores_match_the_torch_reference(n, pattern, seed) -> None:
    """Every candidate's score within 1e-11 (relative, or absolute near 0) of the reference's; the lanes of 8,
    groups of 4 and chunks of 65536 all get partial tails here."""
    g = _gradient(n, pattern, seed)
    candidates = [p for p in divisors(n) if n // p >= 2]
    # all divisors: one log per element; multiples of 8 only: one value per 8 elements (two logs of products)
    for cands in (candidates, [p for p in candidates if p % 8 == 0]):
        expected = period_scores(g.square(), cands)
        got, nonzero = native.period_scores(g, cands)
        assert nonzero is True and got is not None and len(got) == len(cands)
        np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-11)
    assert find_period(g, backend="native") == find_period(g, backend="torch")


def test_native_period_scores_are_identical_on_every_path_and_thread_count() -> None:
    g = _gradient(65_536 * 3 + 96 * 5, "rows", 3)
    n = g.numel()
    candidates = [p for p in divisors(n) if n // p >= 2]
    eights = [p for p in candidates if p % 8 == 0]
    results = []
    threads = torch.get_num_threads()
    try:
        for level in _native_levels():
            native.force_level(level)
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                results.append((native.period_scores(g, candidates)[0], native.period_scores(g, eights)[0]))
    finally:
        native.force_level(None)
        torch.set_num_threads(threads)
    assert all(r == results[0] for r in results), "scores differ between CPU paths or thread counts"


def test_native_period_scores_checks() -> None:
    g = torch.randn(70_000)
    assert native.period_scores(g, []) == ([], True)
    assert native.period_scores(torch.zeros(70_000), [7]) == ([0.0], False)  # all zero: the flag, equal scores
    for level in ("scalar", None):  # one per-element prefix (candidates 1 and 7), -0.0 everywhere: still zero
        native.force_level(level)
        try:
            assert native.period_scores(torch.full((70_000,), -0.0), [1, 7]) == ([0.0, 0.0], False)
        finally:
            native.force_level(None)
    big = g.clone()
    big[69_999] = 2e19  # finite, but its square overflows fp32: the reference decides (None)
    assert native.period_scores(big, [7, 10]) == (None, True)
    assert find_period(big, backend="native") == find_period(big, backend="torch")
    for bad in (float("nan"), -float("inf")):
        worse = g.clone()
        worse[12_345] = bad
        with pytest.raises(ValueError, match="finite"):
            native.period_scores(worse, [7])
    with pytest.raises(RuntimeError, match="refused"):
        native.period_scores(g, [3])  # 3 does not divide 70000
    with pytest.raises(RuntimeError, match="fp32"):
        native.period_scores(g.double(), [7])
    with pytest.raises(RuntimeError, match="workspace"):
        native.period_scores(g, [7], torch.empty(70_000, dtype=torch.float64))  # N + 1 needed
    workspace = torch.full((70_001,), float("nan"), dtype=torch.float64)
    assert native.period_scores(g, [7, 10], workspace) == native.period_scores(g, [7, 10])


def _needed_candidates(n: int) -> list[int]:
    from gefen.math.period import _candidates, _needed

    cands = _candidates(n)
    return [cands[k] for k in _needed(cands)]


# Mixed classes: multiples of 8 (groups of 8) plus others with a gcd >= 2 (groups of that gcd: 11, 12, 10, 13 and
# 14, 97 (runs of 12 + 1), 131 (a prime times 8), 3, ...), and chunk tails of both.
GROUPED_SIZES = [720_896, 3 * 2**16, 5 * 2**15, 11 * 2**13, 91 * 2**10, 8 * 131 * 16, 97 * 4096, 11 * 88 * 3, 3**7 * 8]


@pytest.mark.parametrize("n", GROUPED_SIZES)
@pytest.mark.parametrize("pattern", ["noise", "blocks11", "sparse", "huge"])
def test_native_grouped_period_scores_match_the_torch_reference(n, pattern) -> None:
    """Candidates mixing multiples of 8 with multiples of another gcd: every score within 1e-11 of the reference,
    and the same chosen period; the blocks11 gradients have a true period of 11 k (so the choice is checked)."""
    gen = torch.Generator().manual_seed(n % 1000)
    g = torch.randn(n, generator=gen)
    if pattern == "blocks11":
        block = next((11 * k for k in (4, 2, 1, 8) if n % (11 * k) == 0 and n // (11 * k) >= 8), None)
        block = block or next(p for p in _needed_candidates(n) if p % 8 and p > 8)
        g = g * torch.exp(2 * torch.randn(n // block, generator=gen)).repeat_interleave(block)
    elif pattern == "sparse":
        g[::3] = 0.0
    elif pattern == "huge":
        g = g * 1e18
    needed = _needed_candidates(n)
    others = [p for p in needed if p % 8]
    assert needed and others  # the grouped path with two classes at least
    for cands in (needed, others, [p for p in divisors(n) if n // p >= 2 and p % 8 and p % 2 == 0]):
        if not cands:
            continue
        expected = period_scores(g.square(), cands)
        got, nonzero = native.period_scores(g, cands)
        assert nonzero is True and got is not None
        np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-11)
    chosen = find_period(g, backend="native")
    assert chosen == find_period(g, backend="torch")
    if pattern == "blocks11":
        assert chosen % 11 == 0 or n % 11 != 0


def test_native_grouped_period_scores_are_identical_on_every_path_and_thread_count() -> None:
    results = []
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n in (720_896, 91 * 2**10, 97 * 4096):
        g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n // 11 + 1, generator=gen)).repeat_interleave(11)[:n]
        needed = _needed_candidates(n)
        cases.append((g, needed, [p for p in needed if p % 8]))
    try:
        for level in _native_levels():
            native.force_level(level)
            for t in (1, 2):
                torch.set_num_threads(t)
                results.append([(native.period_scores(g, a)[0], native.period_scores(g, b)[0]) for g, a, b in cases])
    finally:
        native.force_level(None)
        torch.set_num_threads(threads)
    assert all(r == results[0] for r in results), "scores differ between CPU paths or thread counts"


@pytest.mark.parametrize("group", [3, 5, 6, 7, 10, 11, 12])
@pytest.mark.parametrize("pattern", ["rows", "sparse", "tiny"])
def test_native_one_run_groups_are_identical_on_every_path(group, pattern) -> None:
    """Classes of groups of 8 and of one run of G (the AVX-512 path's masked lanes for every G up to 12): the same
    scores on every CPU level and thread count as the scalar path, within 1e-11 of the reference; 16 * G * 1237
    elements leave partial pieces, groups of 4 and logs of 8 at the chunk tails."""
    n = 16 * group * 1237
    g = _gradient(n, pattern, group)
    cands = [8, 16, group, 2 * group] + ([4 * group] if (4 * group) % 8 else [])
    expected = period_scores(g.square(), cands)
    results = []
    threads = torch.get_num_threads()
    try:
        for level in _native_levels():
            native.force_level(level)
            for t in (1, 2):
                torch.set_num_threads(t)
                results.append(native.period_scores(g, cands))
    finally:
        native.force_level(None)
        torch.set_num_threads(threads)
    assert all(r == results[0] for r in results), "scores differ between CPU paths or thread counts"
    got, nonzero = results[0]
    assert nonzero is True and got is not None
    np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("level", ["scalar", None])
def test_native_grouped_period_scores_checks(level) -> None:
    n = 720_896
    needed = _needed_candidates(n)
    native.force_level(level)
    try:
        g = torch.randn(n, generator=torch.Generator().manual_seed(3))
        assert native.period_scores(torch.zeros(n), needed) == ([0.0] * len(needed), False)
        assert native.period_scores(torch.full((n,), -0.0), needed) == ([0.0] * len(needed), False)  # sign bits only
        assert native.period_scores(torch.full((n,), -3.0), needed) == ([0.0] * len(needed), True)
        for at in (0, 65_472 + 3, n - 1):  # first element, past a paired chunk's edge (88 x 744), the last element
            big = g.clone()
            big[at] = 2e19
            assert native.period_scores(big, needed) == (None, True)
            for bad in (float("nan"), float("inf")):
                worse = g.clone()
                worse[at] = bad
                with pytest.raises(ValueError, match="finite"):
                    native.period_scores(worse, needed)
        tiny = torch.zeros(n)
        tiny[n // 3] = 1e-30  # its square underflows fp32: every x equal, but not every g zero
        assert native.period_scores(tiny, needed) == ([0.0] * len(needed), True)
    finally:
        native.force_level(None)
