"""``gefen.math.newton_schulz``: the Newton–Schulz orthogonalisation (singular-value bands per schedule, square and
zero inputs, fp32 GEMMs of bf16 operands against bf16 GEMMs, the CPU probes choosing them), schedule resolution,
the Muon lr ratios and NorMuon's row normalisation."""

from __future__ import annotations

import pytest
import torch

from gefen.math import newton_schulz as ns_module
from gefen.math.newton_schulz import adjust_lr_ratio, newton_schulz, normuon_, resolve_schedule


@pytest.mark.parametrize(
    ("schedule", "low", "high"),
    [("standard", 0.66, 1.16), ("tuned3", 0.87, 1.13), ("tuned4", 0.98, 1.02)],
)
@pytest.mark.parametrize("shape", [(512, 128), (128, 512)])
def test_newton_schulz_singular_value_bands(schedule: str, low: float, high: float, shape: tuple[int, int]) -> None:
    """algorithm.md §12.7: Gaussian 512x128 inputs land in [0.68, 1.14] / [0.89, 1.11] / [0.99, 1.01]."""
    u = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(u, resolve_schedule(schedule, 5), 1e-7)
    assert out.dtype == torch.bfloat16 and out.shape == shape
    singular = torch.linalg.svdvals(out.double())  # fp64 SVD reference
    assert low <= singular.min().item() and singular.max().item() <= high
    # the input's singular values spread over a factor of ~3; NS collapses them towards 1
    spread = torch.linalg.svdvals(u.double())
    assert spread.max() / spread.min() > 2.5


def test_newton_schulz_square_input_and_zero_matrix() -> None:
    u = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    singular = torch.linalg.svdvals(newton_schulz(u, resolve_schedule("standard", 5), 1e-7).double())
    assert singular.max().item() <= 1.25  # "<= ~1.2" in algorithm.md §12.7 (measured 1.20)
    assert singular.min().item() < 0.5  # square Gaussian: the smallest singular values stay small
    zero = newton_schulz(torch.zeros(8, 4), resolve_schedule("tuned3", 5), 1e-7)
    assert torch.equal(zero, torch.zeros(8, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("schedule", "steps", "max_changed", "max_relative"),
    [("standard", 1, 1e-3, 1e-4), ("tuned3", 5, 1e-3, 1e-4), ("standard", 5, 1.0, 2e-2)],
)
def test_newton_schulz_fp32_gemms_match_bf16_gemms(
    monkeypatch: pytest.MonkeyPatch, schedule: str, steps: int, max_changed: float, max_relative: float
) -> None:
    """On a CPU without bf16 matrix instructions the products run as fp32 GEMMs of bf16 operands rounded once: the
    bf16 GEMM's values up to fp32 summation order. A converging schedule agrees but for a few elements in 10⁴
    (measured 7e-5 / 3e-4 changed, relative Frobenius 2e-5 / 7e-5); the 5-step standard schedule, whose singular
    values keep oscillating, amplifies those one-ulp differences to a relative 8e-3, as between two GPU models."""
    u = torch.randn(96, 160, generator=torch.Generator().manual_seed(2))
    plan = resolve_schedule(schedule, steps)
    results = []
    for native in (True, False):
        monkeypatch.setattr(ns_module, "bf16_gemm_is_native", lambda device, native=native: native)
        results.append(newton_schulz(u, plan, 1e-7))
    bf16_gemm, fp32_gemm = results
    assert fp32_gemm.dtype == torch.bfloat16 and fp32_gemm.shape == u.shape
    diff = (bf16_gemm.float() - fp32_gemm.float()).abs()
    assert (diff > 0).float().mean().item() <= max_changed
    assert (diff.norm() / bf16_gemm.float().norm()).item() <= max_relative


def test_bf16_gemm_is_native_follows_the_cpu_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ns_module.bf16_gemm_is_native(torch.device("cuda"))  # no CUDA needed to ask
    assert ns_module.bf16_gemm_is_native(torch.device("cpu")) is ns_module.cpu_has_bf16_gemm()
    for avx512_bf16, amx in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert ns_module.cpu_has_bf16_gemm() is (avx512_bf16 or amx)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert ns_module.cpu_has_bf16_gemm() is False  # a torch without the probes
    for value in (True, False):  # the step reads the value probed once at import
        monkeypatch.setattr(ns_module, "_CPU_BF16_GEMM", value)
        assert ns_module.bf16_gemm_is_native(torch.device("cpu")) is value


def test_schedule_resolution_and_validation() -> None:
    assert len(resolve_schedule(None, 7)) == 7 and len(resolve_schedule("tuned4", 5)) == 4
    assert resolve_schedule([(1, 2, 3)], 5) == ((1.0, 2.0, 3.0),)
    for bad in ("tuned9", [(1, 2)], [], [(1, 2, float("nan"))]):
        with pytest.raises(ValueError):
            resolve_schedule(bad, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        resolve_schedule(None, 100)
    with pytest.raises(TypeError):
        resolve_schedule(None, 5.0)  # type: ignore[arg-type]


def test_adjust_lr_ratios() -> None:
    assert adjust_lr_ratio(None, 1024, 256) == 2.0  # sqrt(max(1, R/C))
    assert adjust_lr_ratio("original", 256, 1024) == 1.0
    assert adjust_lr_ratio("match_rms_adamw", 256, 1024) == pytest.approx(0.2 * 32)
    with pytest.raises(ValueError):
        adjust_lr_ratio("adam", 4, 4)


def test_normuon_preserves_the_frobenius_norm_and_equalises_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    o = torch.randn(64, 32, generator=gen) * torch.linspace(0.1, 3.0, 64).unsqueeze(1)
    before = o.norm().item()
    v = torch.zeros(64)
    out = normuon_(o.clone(), v, 1, 0.95, 1e-8)
    assert out.norm().item() == pytest.approx(before, rel=1e-5)
    rows = out.norm(dim=1)
    assert (rows.max() / rows.min()).item() < 1.001  # first step: every row divided by its own RMS
    assert torch.allclose(v, 0.05 * o.norm(dim=1).square() / 32)
