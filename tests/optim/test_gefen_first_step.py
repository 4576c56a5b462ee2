"""Gefen's first step, which learns each parameter's period and the frozen codebook: an all-zero first gradient
defers both, a codebook from the gradients of too few parameters warns at the caller's line, and a first gradient
overflowing float32 is a StepError before anything changes."""

from __future__ import annotations

import warnings

import pytest
import torch

import gefen
from gefen import StepError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _steps(model, opt, n, offset=0):
    for s in range(n):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(offset + s))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_all_zero_first_gradient_defers_period_and_codebook():
    model = _mlp()
    opt = gefen.Gefen(model.parameters(), lr=1e-2, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # e.g. zero_grad(set_to_none=False) then a "warm-up" step
    assert opt.codebook is None and not any(opt.state.get(p) for p in model.parameters())
    w = list(model.parameters())[0]
    torch.testing.assert_close(w.detach(), before[0] * (1 - 1e-2 * 0.1), rtol=0, atol=1e-7)  # decay only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a real first gradient must not warn
        _steps(model, opt, 1)
    assert opt.codebook is not None and len(torch.unique(opt.codebook)) > 200


def test_codebook_from_a_tiny_first_step_warns():
    model = _mlp()
    bias = list(model.parameters())[-1]
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    bias.grad = torch.randn(bias.shape)
    with pytest.warns(UserWarning, match="codebook from the first step's gradients of only 1 parameter") as record:
        opt.step()
    assert record[0].filename == __file__  # points at the caller's opt.step() line


def test_first_gradient_overflowing_float32_is_a_step_error():
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float64))
    opt = gefen.Gefen([p], lr=1e-3, nonfinite="propagate")
    p.grad = torch.full((64,), 1e50, dtype=torch.float64)
    with pytest.raises(StepError, match="float32"):
        opt.step()
    assert opt.codebook is None and torch.equal(p, torch.zeros(64, dtype=torch.float64))
