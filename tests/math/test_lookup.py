"""The O(1) nearest-code search equals the reference rule of algorithm.md §4.8 bit for bit."""

from __future__ import annotations

import pytest
import torch

from gefen.math.codebook import accumulate_histogram_, fit_codebook, nearest_code
from gefen.math.lookup import build_nearest_table, nearest_code_fast
from tests.reference.gefen_ref import nearest_code_ref


def _fitted_codebook(seed: int, period: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.distributions.StudentT(3.0).sample((4096, period)) * torch.rand(4096, 1, generator=gen)
    counts = torch.zeros(4096, dtype=torch.int64)
    accumulate_histogram_(counts, g, period)
    return fit_codebook(counts)


def _hard_inputs(codebook: torch.Tensor) -> torch.Tensor:
    """Every code, every midpoint of neighbours, and their fp32 neighbours on both sides, inside [-1, 1]."""
    mids = (codebook[1:] + codebook[:-1]) / 2
    base = torch.cat([codebook, mids])
    up, down = torch.nextafter(base, torch.tensor(2.0)), torch.nextafter(base, torch.tensor(-2.0))
    up2, down2 = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
    return torch.cat([base, up, down, up2, down2]).clamp(-1.0, 1.0)


def _neighbours(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` and the next ``n - 1`` fp32 values above it."""
    out = [x]
    for _ in range(n - 1):
        out.append(torch.nextafter(out[-1], torch.tensor(2.0)))
    return torch.stack(out)


CODEBOOKS = {
    "fitted-t3": lambda: _fitted_codebook(0),
    "fitted-period-8": lambda: _fitted_codebook(1, period=8),
    "padded": lambda: fit_codebook(torch.bincount(torch.tensor([100, 2048, 3000, 3001]), minlength=4096)),
    "uniform-with-zero": lambda: torch.cat([torch.linspace(-1, 1, 255), torch.zeros(1)]).sort().values,
    "repeats-and-subnormals": lambda: (  # repeated interior codes; neighbours a few fp32 steps apart
        torch.cat(
            [
                torch.tensor([-1.0, -0.5, -0.5, -0.5, 0.0, 0.0, 1e-40, 2e-40, 1e-38, 1.0, 1.0]),
                _neighbours(torch.tensor(0.3), 3),
                torch.linspace(-0.9, 0.9, 242),
            ]
        )
        .sort()
        .values
    ),
    "dense-near-zero": lambda: (
        torch.cat([torch.tensor([-1.0, 1.0, 0.0]), torch.linspace(-3e-4, 3e-4, 120), torch.linspace(-0.9, 0.9, 133)])
        .sort()
        .values
    ),
}


def _thresholds_by_torch_bisection(codebook: torch.Tensor) -> torch.Tensor:
    """t_k = max{u : nearest_code(u) <= k} by bisection over ordered fp32 bit patterns, with torch's nearest_code."""

    def key(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int32).to(torch.int64)
        return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))

    def value(k: torch.Tensor) -> torch.Tensor:
        bits = torch.where(k >= 0, k, (-k) | 0x80000000)
        return bits.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)

    n = codebook.numel()
    lo, hi = key(torch.tensor([-1.0])).expand(n - 1).clone(), key(torch.tensor([1.0])).expand(n - 1).clone()
    ks = torch.arange(n - 1)
    for _ in range(33):
        mid = (lo + hi + 1) // 2
        ok = nearest_code(value(mid), codebook) <= ks
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    return value(lo)


@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_thresholds_are_the_largest_inputs_of_each_code_by_the_reference_rule(name):
    codebook = CODEBOOKS[name]()
    table = build_nearest_table(codebook)
    thresholds = table.thresholds[: codebook.numel() - 1]
    assert torch.equal(thresholds, _thresholds_by_torch_bisection(codebook))
    ks = torch.arange(codebook.numel() - 1)
    assert (nearest_code(thresholds, codebook) <= ks).all()
    inside = thresholds < 1.0  # one fp32 step above t_k maps past k
    above = torch.nextafter(thresholds[inside], torch.tensor(2.0))
    assert (nearest_code(above, codebook) > ks[inside]).all()


@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_fast_search_equals_reference_rule_on_hard_inputs(name):
    codebook = CODEBOOKS[name]()
    table = build_nearest_table(codebook)
    u = _hard_inputs(codebook)
    assert torch.equal(nearest_code_fast(u, table).long(), nearest_code(u, codebook))


@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_fast_search_equals_reference_rule_on_random_inputs(name):
    codebook = CODEBOOKS[name]()
    table = build_nearest_table(codebook)
    gen = torch.Generator().manual_seed(0)
    u = torch.cat([torch.rand(200_000, generator=gen) * 2 - 1, torch.randn(50_000, generator=gen) * 1e-3])
    u = u.clamp(-1, 1)
    assert torch.equal(nearest_code_fast(u, table).long(), nearest_code(u, codebook))


def test_fast_search_agrees_with_argmin_definition():
    codebook = _fitted_codebook(3)
    table = build_nearest_table(codebook)
    values = _hard_inputs(codebook)[::7]
    cb = codebook.tolist()
    got = nearest_code_fast(values, table).tolist()
    # the loop reference works in float64, so compare only where the fp32 distances are not tied
    for u, k in zip(values.tolist(), got):
        ref = nearest_code_ref(u, cb)
        assert abs(u - cb[k]) <= abs(u - cb[ref]) + 1e-7


def test_zero_maps_to_the_exact_zero_code_and_ends_to_the_ends():
    codebook = _fitted_codebook(4)
    table = build_nearest_table(codebook)
    idx = nearest_code_fast(torch.tensor([0.0, -0.0, -1.0, 1.0]), table).tolist()
    assert codebook[idx[0]] == 0.0 and codebook[idx[1]] == 0.0
    assert idx[2] == 0 and codebook[idx[3]] == 1.0


def test_fitted_codebooks_need_few_compares():
    assert build_nearest_table(_fitted_codebook(0)).steps <= 4
    assert build_nearest_table(CODEBOOKS["padded"]()).steps <= 2  # trailing +1 copies cost nothing
