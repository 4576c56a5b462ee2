"""The torch.optim contract for Gefen: param groups, names, add_param_group, LR schedulers, tensor lr,
closures, zero_grad, None / zero-numel / late gradients, errors before mutation, byte accounting."""

from __future__ import annotations

import math

import pytest
import torch

import gefen
from gefen import ConfigError, StepError
from gefen.state import PERIOD, STEP


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loss(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen)
    return model(x).square().mean()


def _snapshot(opt, params):
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state}
    codebook = None if opt.codebook is None else opt.codebook.clone()
    return [p.detach().clone() for p in params], state, codebook, opt.global_step


def _assert_unchanged(opt, params, snap):
    values, state, codebook, global_step = snap
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    assert {id(p) for p in params if p in opt.state} == set(state)
    for p in params:
        if p in opt.state:
            for k, v in state[id(p)].items():
                assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), k
    assert (opt.codebook is None) == (codebook is None)
    if codebook is not None:
        assert torch.equal(opt.codebook, codebook)
    assert opt.global_step == global_step


def test_named_parameters_and_caller_groups_are_kept():
    model = _model()
    named = list(model.named_parameters())
    opt = gefen.Gefen(
        [{"params": named[:2], "lr": 1e-2}, {"params": named[2:], "weight_decay": 0.1, "betas": (0.8, 0.9)}],
        lr=1e-3,
    )
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias"]
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.0
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["betas"] == (0.8, 0.9)
    _loss(model).backward()
    opt.step()
    assert [r["name"] for r in opt.state_report()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_per_group_lr_zero_freezes_that_group():
    model = _model()
    params = list(model.parameters())
    opt = gefen.Gefen([{"params": params[:2], "lr": 0.0}, {"params": params[2:]}], lr=1e-2)
    before = [p.detach().clone() for p in params]
    _loss(model).backward()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params[:2], before[:2]))
    assert not torch.equal(params[2], before[2])


def test_add_param_group_steps_new_params_and_is_all_or_nothing():
    model = _model()
    params = list(model.parameters())
    opt = gefen.Gefen(params[:2], lr=1e-2)
    with pytest.raises(ConfigError, match="betas"):
        opt.add_param_group({"params": params[2:], "betas": (0.9, 1.5)})
    with pytest.raises(ConfigError, match="same parameter twice"):
        opt.add_param_group({"params": [params[2], params[2]]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params[2:], "lr": 5e-3})
    assert opt.param_groups[1]["lr"] == 5e-3 and opt.param_groups[1]["eps"] == 1e-8
    before = params[3].detach().clone()
    _loss(model).backward()
    opt.step()
    assert not torch.equal(params[3], before)


def test_lr_scheduler_drives_group_lr():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()
        sched.step()
    assert math.isclose(opt.param_groups[0]["lr"], 1e-2 * 0.125)


def test_tensor_lr_equals_float_lr():
    results = []
    for lr in (float(torch.tensor(3e-3)), torch.tensor(3e-3)):  # same fp32 value
        model = _model()
        opt = gefen.Gefen(model.parameters(), lr=lr)
        for s in range(3):
            opt.zero_grad()
            _loss(model, s).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_closure_runs_before_anything_else():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        return loss

    loss = opt.step(closure)  # no gradients exist before the closure: step 1 must still learn and update
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert opt.codebook is not None and opt.global_step == 1
    assert all(int(opt.state[p][STEP]) == 1 for p in model.parameters())


def test_zero_grad_sets_none_and_step_without_grads_is_a_no_op():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2, weight_decay=0.1)
    _loss(model).backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    snap = _snapshot(opt, list(model.parameters()))
    opt.step()
    _assert_unchanged(opt, list(model.parameters()), snap)


def test_param_without_grad_untouched_and_late_param_starts_own_warmup():
    model = _model()
    params = list(model.parameters())
    opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1)
    late = params[3]
    for s in range(3):
        opt.zero_grad()
        _loss(model, s).backward()
        late_before = late.detach().clone()
        late.grad = None
        opt.step()
        assert torch.equal(late, late_before)  # no update, no weight decay
    assert late not in opt.state
    codebook = opt.codebook.clone()
    opt.zero_grad()
    _loss(model, 5).backward()
    opt.step()
    assert int(opt.state[late][STEP]) == 1 and int(opt.state[params[0]][STEP]) == 4
    assert PERIOD in opt.state[late]
    assert torch.equal(opt.codebook, codebook)  # frozen after the first step


def test_zero_numel_params_are_skipped():
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = gefen.Gefen([empty, w], lr=1e-2)
    empty.grad = torch.zeros(0, 4)
    w.grad = torch.randn(8, 8)
    opt.step()
    assert empty not in opt.state and w in opt.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_param_dtype_is_written_in_its_own_dtype(dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32, dtype=dtype))
    before = w.detach().clone()
    opt = gefen.Gefen([w], lr=1e-2)
    for s in range(2):
        w.grad = torch.randn(16, 32, generator=torch.Generator().manual_seed(s)).to(dtype)
        opt.step()
    assert w.dtype == dtype and torch.isfinite(w).all() and not torch.equal(w, before)
    st = opt.state[w]
    assert st["first_moment_codes"].dtype == torch.uint8
    assert st["first_moment_scale"].dtype == torch.float32
    assert st["second_moment_row"].dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"lr": -1e-3}, ConfigError, r"lr.*>= 0"),
        ({"lr": float("nan")}, ConfigError, r"lr.*finite"),
        ({"lr": torch.tensor([1e-3, 2e-3])}, ConfigError, r"1-element"),
        ({"betas": (1.0, 0.999)}, ConfigError, r"betas'?\]?\[0\]|betas\[0\]"),
        ({"betas": (0.9, -0.1)}, ConfigError, r"\[1\].*\[0, 1\)"),
        ({"betas": (0.9,)}, ConfigError, r"pair"),
        ({"eps": 0.0}, ConfigError, r"eps.*> 0"),
        ({"eps": float("inf")}, ConfigError, r"eps.*finite"),
        ({"weight_decay": -0.1}, ConfigError, r"weight_decay.*>= 0"),
        ({"factored_v_2d": 1}, TypeError, r"factored_v_2d.*bool"),
    ],
)
def test_constructor_refuses_bad_hyperparameters(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_constructor_refuses_bad_params():
    with pytest.raises(TypeError, match="single Tensor"):
        gefen.Gefen(torch.nn.Parameter(torch.randn(3)))
    with pytest.raises(ValueError, match="empty"):
        gefen.Gefen([])
    with pytest.raises(ConfigError, match="complex"):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4)), "weight"])
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ConfigError, match="same parameter twice"):
        gefen.Gefen([w, w])


def _trained(steps=2):
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(steps):
        opt.zero_grad()
        _loss(model, s).backward()
        opt.step()
    opt.zero_grad()
    _loss(model, 99).backward()
    return model, opt


@pytest.mark.parametrize("first_step", [True, False])
def test_refused_steps_change_nothing(first_step):
    if first_step:
        model = _model()
        opt = gefen.Gefen(model.parameters(), lr=1e-2)
        _loss(model).backward()
    else:
        model, opt = _trained()
    params = list(model.parameters())
    snap = _snapshot(opt, params)

    params[2].grad = params[2].grad.to_sparse()  # sparse gradient on a later param
    with pytest.raises(StepError, match="layout"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    params[2].grad = params[2].grad.to_dense()

    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ConfigError, match="lr"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    opt.param_groups[0]["lr"] = 1e-2

    saved = params[3].data
    params[3].data = torch.zeros(7)  # a wrapper swapped the tensor: grad shape no longer matches
    with pytest.raises(StepError, match="shape"):
        opt.step()
    params[3].data = saved
    _assert_unchanged(opt, params, snap)


def test_non_finite_first_gradient_is_refused_before_learning():
    """Even where later NaN steps propagate, a first gradient must be finite (its period and the codebook)."""
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2, nonfinite="propagate")
    _loss(model).backward()
    params = list(model.parameters())
    params[1].grad[0] = float("nan")
    snap = _snapshot(opt, params)
    with pytest.raises(StepError, match="NaN/Inf"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    assert opt.codebook is None






