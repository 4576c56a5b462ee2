"""The Muon ablation's pieces (``benchmarks/muon_ablation.py``) and the routing of torch's Newton–Schulz through
gefen's on CPUs without bf16 matrix instructions (``gefen.cli._optimizers.torch_muon_gemms_in_fp32``)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

import gefen
from gefen.cli import _optimizers
from gefen.cli.demo import _Job, _train_one
from gefen.math import newton_schulz as ns_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ablation = _load("muon_ablation")


def _matrices(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=gen) * 0.05) for shape in ((24, 40), (40, 24), (16, 16))]


def _run(optimizer_cls: type, params: list[nn.Parameter], steps: int, **kwargs: object) -> list[torch.Tensor]:
    optimizer = optimizer_cls(params, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("native", [True, False])
def test_torch_muon_newton_schulz_routed_only_without_bf16_gemms(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    original = torch_muon._zeropower_via_newtonschulz
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", original)  # restored after the test
    monkeypatch.setattr(ns_module, "bf16_gemm_is_native", lambda device: native)
    assert _optimizers.torch_muon_gemms_in_fp32() is (not native)
    routed = torch_muon._zeropower_via_newtonschulz
    assert (routed is original) is native
    u = torch.randn(20, 36, generator=torch.Generator().manual_seed(3))
    coefficients = ns_module.STANDARD_COEFFICIENTS
    expected = ns_module.newton_schulz(u, (coefficients,) * 5, 1e-7)
    assert torch.equal(routed(u, coefficients, 5, 1e-7), expected)  # torch's iteration has gefen's grouping
    if not native:  # a second call wraps torch's own function, not the wrapper
        _optimizers.torch_muon_gemms_in_fp32()
        assert torch_muon._zeropower_via_newtonschulz.__wrapped__ is original


def test_reference_muon_is_torch_muon_with_the_standard_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ablation's fp32-momentum Muon with 5 standard iterations takes torch.optim.Muon's steps exactly (with
    torch's Newton–Schulz routed as the ablation routes it where bf16 GEMMs are not native), so the walk's first
    change (tuned3) changes nothing else."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", torch_muon._zeropower_via_newtonschulz)
    _optimizers.torch_muon_gemms_in_fp32()
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    torch_result = _run(torch.optim.Muon, _matrices(), 4, **kwargs)
    ours = _run(ablation.ReferenceMuon, _matrices(), 4, ns_schedule=None, **kwargs)
    for a, b in zip(torch_result, ours, strict=True):
        assert torch.equal(a, b)
    tuned = _run(ablation.ReferenceMuon, _matrices(), 4, ns_schedule="tuned3", **kwargs)
    assert not torch.equal(tuned[0], ours[0])


def test_reference_muon_differs_from_gefen_muon_by_the_momentum_quantization_only() -> None:
    """``+normuon`` -> ``+8bit`` changes only the momentum's storage: with momentum 0 (``m = G``, no Nesterov) the
    reference orthogonalises ``G`` and GefenMuon its 8-bit code ``c[idx]·a``, so the two moves differ by the
    quantization error carried through Newton–Schulz: about one per cent."""
    kwargs = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False}
    start = [p.detach().clone() for p in _matrices()]
    ours = _run(ablation.ReferenceMuon, _matrices(), 1, ns_schedule="tuned3", normuon=True, **kwargs)
    theirs = _run(
        gefen.GefenMuon, _matrices(), 1, ns_schedule="tuned3", normuon=True, adjust_lr_fn="match_rms_adamw", **kwargs
    )
    for w0, a, b in zip(start, ours, theirs, strict=True):
        move = (a - w0).norm()
        relative = ((a - b).norm() / move).item()
        assert 1e-4 < relative < 0.03, relative  # measured 0.8-1.0 %


def test_best_lrs_prefers_the_most_seeds_and_skips_diverged_runs() -> None:
    runs = [
        {"config": "a", "lr": 1e-3, "seed": 0, "eval_loss": 2.0},
        {"config": "a", "lr": 1e-3, "seed": 1, "eval_loss": 2.2},
        {"config": "a", "lr": 2e-3, "seed": 0, "eval_loss": 1.9},  # one seed only: cannot win
        {"config": "a", "lr": 3e-3, "seed": 0, "eval_loss": float("nan")},
        {"config": "a", "lr": 3e-3, "seed": 1, "eval_loss": 1.0},
        {"config": "b", "lr": 1e-3, "seed": 0, "eval_loss": 3.0},
        {"config": "b", "lr": 2e-3, "seed": 0, "eval_loss": 2.5},
    ]
    best = ablation.best_lrs(runs)
    assert best["a"]["lr"] == 1e-3 and best["a"]["mean_eval_loss"] == pytest.approx(2.1)
    assert best["a"]["eval_loss"] == {"0": 2.0, "1": 2.2} and best["a"]["grid"] == [1e-3, 2e-3, 3e-3]
    assert best["b"]["lr"] == 2e-3 and best["b"]["seeds"] == [0]


@pytest.mark.parametrize(
    ("config", "muon_type", "backup_type"),
    [
        ("torch", torch.optim.Muon, torch.optim.AdamW),
        ("+tuned3", ablation.ReferenceMuon, torch.optim.AdamW),
        ("+8bit", gefen.GefenMuon, torch.optim.AdamW),
        ("+gefen-backup", gefen.GefenMuon, gefen.Gefen),
    ],
)
def test_build_walks_one_change_at_a_time(config: str, muon_type: type, backup_type: type) -> None:
    from gefen.cli._model import build_model

    model = build_model("tiny", 16, 0)
    optimizer = ablation.build(config, model, 3e-3)
    halves = optimizer.children if hasattr(optimizer, "children") else (optimizer.muon, optimizer.backup)
    assert [type(h) for h in halves] == [muon_type, backup_type]
    muon_params = {id(p) for g in halves[0].param_groups for p in g["params"]}
    assert all(p.ndim == 2 for g in halves[0].param_groups for p in g["params"])
    assert len(muon_params) == len(gefen.split_params_for_muon(model)[0])
    with pytest.raises(ValueError, match="unknown configuration"):
        ablation.build("+nothing", model, 3e-3)


def test_demo_job_trains_with_an_ablation_factory() -> None:
    import functools

    data = bytes(range(256)) * 64
    job = _Job(
        name="+gefen-backup",
        lr=3e-3,
        model_size="tiny",
        seq_len=16,
        batch_size=2,
        steps=3,
        seed=0,
        threads=1,
        eval_every=3,
        train_bytes=data,
        eval_bytes=data[: 16 * 80],
        factory=functools.partial(ablation.build, "+gefen-backup"),
    )
    result = _train_one(job)
    assert math.isfinite(result["eval_loss"]) and len(result["train_curve"]) == 3
    assert 0.9 < result["state_bytes_per_param"] < 2.0  # Gefen-family state, not AdamW's 8


def test_newton_schulz_benchmark_counts_gemm_work_on_the_wide_orientation() -> None:
    bench = _load("newton_schulz")
    # per iteration: X·Xᵀ and M·X are 2·m²·n each, A·A is 2·m³, with m = min(R, C)
    assert bench.gemm_flop((688, 256), 3) == bench.gemm_flop((256, 688), 3) == 3 * (4 * 256**2 * 688 + 2 * 256**3)
    assert len(bench.SETS["minilm"]()) == 37 and len(bench.SETS["demo"]()) == 28
