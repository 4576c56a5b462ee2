"""Regressions from trying Gefen as a new user would: each test is one finding, with the right behaviour."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch

import gefen
from gefen import ConfigError, StepError
from gefen.checkpoint import METADATA_KEY


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _steps(model, opt, n, offset=0):
    for s in range(n):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(offset + s))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_reading_state_before_the_first_step_is_harmless():
    model_a, model_b = _mlp(), _mlp()
    opt_a = gefen.Gefen(model_a.parameters(), lr=1e-2)
    opt_b = gefen.Gefen(model_b.parameters(), lr=1e-2)
    for p in model_a.parameters():
        assert opt_a.state[p] == {}  # defaultdict read creates an empty entry, as in torch.optim
    _steps(model_a, opt_a, 3)
    _steps(model_b, opt_b, 3)
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    opt_a.load_state_dict(opt_a.state_dict())  # its own checkpoint still loads


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


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_deepcopy_and_pickle_give_a_working_optimizer(how):
    model = _mlp()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    _steps(model, opt, 2)
    bundle = (model, opt)
    model2, opt2 = copy.deepcopy(bundle) if how == "deepcopy" else pickle.loads(pickle.dumps(bundle))
    assert torch.equal(opt2.codebook, opt.codebook) and opt2.global_step == 2
    _steps(model, opt, 2, offset=5)
    _steps(model2, opt2, 2, offset=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert METADATA_KEY in opt2.state_dict()






def test_numpy_and_tensor_hyperparameters_are_accepted():
    model = _mlp()
    opt = gefen.Gefen(
        model.parameters(),
        lr=np.float32(1e-3),
        betas=(torch.tensor(0.9), np.float64(0.999)),
        eps=np.float32(1e-8),
        weight_decay=np.array(0.01),
    )
    _steps(model, opt, 2)
    opt.param_groups[0]["lr"] = np.float32(5e-4)  # a hand-written schedule
    _steps(model, opt, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"maximize": True}, ConfigError, "maximize=True"),
        ({"amsgrad": True}, ConfigError, "amsgrad"),
        ({"foreach": True}, ConfigError, "foreach"),
        ({"momentum": 0.9}, TypeError, "unexpected keyword argument 'momentum'"),
    ],
)
def test_adamw_only_options_are_refused_clearly(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gefen.Gefen(_mlp().parameters(), **kwargs)


def test_adamw_default_options_are_accepted():
    gefen.Gefen(
        _mlp().parameters(),
        maximize=False,
        foreach=None,
        fused=False,
        capturable=False,
        differentiable=False,
        amsgrad=False,
    )




def test_first_gradient_overflowing_float32_is_a_step_error():
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float64))
    opt = gefen.Gefen([p], lr=1e-3, nonfinite="propagate")
    p.grad = torch.full((64,), 1e50, dtype=torch.float64)
    with pytest.raises(StepError, match="float32"):
        opt.step()
    assert opt.codebook is None and torch.equal(p, torch.zeros(64, dtype=torch.float64))
