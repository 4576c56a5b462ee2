"""Gefen's update against the dense float64 reference of tests/reference/gefen_ref.py, and against AdamW on a
real small problem."""

from __future__ import annotations

import pytest
import torch

import gefen
from gefen.state import FIRST_MOMENT_CODES, FIRST_MOMENT_SCALE, PERIOD
from tests.reference.gefen_ref import GefenReference


def _grad_sequence(shape, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.exp(torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=gen))
    return [torch.randn(shape, generator=gen) * row_scale for _ in range(steps)]


@pytest.mark.parametrize(
    ("shape", "factored", "weight_decay"),
    [((24, 32), True, 0.0), ((24, 32), False, 0.1), ((48, 16), True, 0.05), ((640,), False, 0.0)],
)
def test_steps_match_dense_float64_reference(shape, factored, weight_decay):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape))
    start = param.detach().clone()
    opt = gefen.Gefen([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, factored_v_2d=factored)
    grads = _grad_sequence(shape, 4, seed=1)
    ref = None
    ref_param = start.double()
    for g in grads:
        param.grad = g.clone()
        opt.step()
        if ref is None:
            period = int(opt.state[param][PERIOD])
            ref = GefenReference(
                shape,
                period,
                opt.codebook.tolist(),
                factored and len(shape) == 2,
                betas=(0.9, 0.99),
                eps=1e-8,
            )
        ref_param = ref.step(ref_param, g, lr=1e-2, weight_decay=weight_decay)
        codes = opt.state[param][FIRST_MOMENT_CODES].reshape(-1).tolist()
        mismatched = sum(a != b for a, b in zip(codes, ref.codes))
        assert mismatched <= 1, f"{mismatched} codes differ from the float64 reference"
        want = torch.tensor(ref.scale, dtype=torch.float64)
        # a 1-D parameter has one-element blocks (the row rule): a magnitude is one |m|, which can be tiny after
        # cancellation, so the fp32 rounding is bounded against the largest magnitude too
        torch.testing.assert_close(
            opt.state[param][FIRST_MOMENT_SCALE].double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max())
        )
        torch.testing.assert_close(param.detach().double(), ref_param, rtol=1e-5, atol=1e-6)


def test_two_code_style_sign_update_by_hand():
    # With beta1 = 0 the momentum is the gradient itself; in a block whose entries are ±a the normalised
    # values are exactly ±1, so codes are the ends of the codebook and m̂ = g exactly. Block second moment with
    # beta2 = 0 is mean(g²) = a², t = 1 gives bc1 = bc2 = 1, so the update is lr · g / (a + eps) = lr · sign(g).
    param = torch.nn.Parameter(torch.zeros(8, 16))
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0).reshape(8, 16)
    magnitudes = torch.tensor([1.0, 8.0, 0.25, 4.0, 0.5, 16.0, 1.0, 0.125]).reshape(8, 1)
    param.grad = signs * magnitudes
    opt = gefen.Gefen([param], lr=0.1, betas=(0.0, 0.0), eps=1e-30, factored_v_2d=False)
    opt.step()
    assert int(opt.state[param][PERIOD]) == 16  # the score finds the row structure
    torch.testing.assert_close(param.detach(), -0.1 * signs, rtol=0, atol=1e-7)


def _regression_problem():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=gen)
    w_true = torch.randn(32, 8, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(512, 8, generator=gen)
    return x, y


def _train(make_opt, steps=300):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = make_opt(model)
    x, y = _regression_problem()
    for i in range(steps):
        idx = slice((i * 64) % 512, (i * 64) % 512 + 64)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def test_close_to_adamw_on_small_regression():
    adamw = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01))
    ours = _train(lambda m: gefen.Gefen(m.named_parameters(), lr=3e-3, weight_decay=0.01))
    start = _train(lambda m: torch.optim.SGD(m.parameters(), lr=0.0), steps=1)
    assert adamw < 0.3 * start  # the problem is learnable
    assert ours < 1.15 * adamw, (ours, adamw)


@pytest.mark.parametrize("factored", [True, False])
def test_chunk_size_does_not_change_results(monkeypatch, factored):
    import gefen.optim.gefen as gefen_module

    results = []
    for chunk in (1 << 16, 96):  # one chunk per tensor vs many chunks (rounded up to whole blocks/rows)
        monkeypatch.setattr(gefen_module, "_CHUNK_ELEMENTS", chunk)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(48, 40), (30, 64), (1000,), (6, 5, 4)]]
        opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, factored_v_2d=factored)
        for s in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s))
            opt.step()
        results.append(([p.detach().clone() for p in params], [dict(opt.state[p]) for p in params]))
    (params_a, states_a), (params_b, states_b) = results
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    for sa, sb in zip(states_a, states_b):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
