"""Mixed precision: GradScaler's two paths (true fp16 parameters: the optimizer unscales and skips an overflowing
step itself; fp32 masters under fp16 autocast: the ordinary unscale-then-step path) and bf16 autocast."""

from __future__ import annotations

import pytest
import torch

import gefen
from tests.optim.determinism_job import digest


def _fp16_setup(kind: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(48, 32)).half()
    if kind == "gefen":
        return m, gefen.Gefen(m.named_parameters(), lr=1e-2, fused=False)
    if kind == "gefen_muon":
        return m, gefen.GefenMuon(
            [(n, p) for n, p in m.named_parameters() if n.endswith("weight") and n[0] != "0"], lr=1e-2, fused=False
        )
    # eps 1e-3: a pure-fp16 AdamW backup underflows its own eps=1e-8 to 0 and overflows (not ours)
    return m, gefen.GefenMuonHybrid(m, lr=1e-2, eps=1e-3, backup_optimizer=kind.split("_")[1], fused=False)


def _fp16_loss(m, s):
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(s))
    return m(tokens).float().square().mean()


@pytest.mark.parametrize("kind", ["gefen", "gefen_muon", "hybrid_gefen", "hybrid_adamw"])
def test_fp16_gradscaler_step_equals_a_step_on_unscaled_gradients(kind):
    """Native protocol: the optimizer unscales by float32(1/float64(scale)) itself, exactly like the scaler."""
    m, opt = _fp16_setup(kind)
    ref_m, ref = _fp16_setup(kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert not opt._step_supports_amp_scaling  # no gradient yet
    for s in range(3):
        opt.zero_grad()
        scaler.scale(_fp16_loss(m, s)).backward()
        assert opt._step_supports_amp_scaling
        ref.zero_grad()
        (_fp16_loss(ref_m, s) * 2.0**10).backward()
        inv = torch.tensor(2.0**10, dtype=torch.float64).reciprocal().float()
        for p in ref_m.parameters():
            p.grad.mul_(inv)
        scaler.step(opt)
        scaler.update()
        ref.step()
        assert scaler.get_scale() == 2.0**10
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters()))
    assert digest(opt.state_dict()) == digest(ref.state_dict())


@pytest.mark.parametrize("first_step", [True, False])
@pytest.mark.parametrize("kind", ["gefen", "hybrid_gefen", "hybrid_adamw"])
def test_fp16_gradscaler_overflow_changes_nothing_and_lowers_the_scale(kind, first_step):
    m, opt = _fp16_setup(kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    warm = 0 if first_step else 2
    for s in range(warm):
        opt.zero_grad()
        scaler.scale(_fp16_loss(m, s)).backward()
        scaler.step(opt)
        scaler.update()
    params = [p.detach().clone() for p in m.parameters()]
    before = digest(opt.state_dict())
    opt.zero_grad()
    scaler.scale(_fp16_loss(m, 9)).backward()
    m[0].weight.grad[3, 1] = float("inf")  # the backup half for the hybrids
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    assert digest(opt.state_dict()) == before


def test_fp32_master_with_fp16_autocast_takes_the_ordinary_path_and_skips_the_step():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 16)
    opt = gefen.Gefen(m.named_parameters(), fused=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(2, 8)).float().sum()
    scaler.scale(loss).backward()
    assert not opt._step_supports_amp_scaling
    m.weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert opt.global_step == 0 and opt.codebook is None and len(opt.state) == 0
    assert scaler.get_scale() == 2.0**9


def test_bf16_autocast_trains_unchanged():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    opt = gefen.Gefen(m.named_parameters(), lr=1e-2, fused=False)
    x = torch.randn(16, 8)
    losses = []
    for _ in range(20):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert opt.global_step == 20 and losses[-1] < 0.5 * losses[0]
