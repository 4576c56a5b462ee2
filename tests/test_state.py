"""Per-parameter state (``gefen.state``): what it costs per shape (about one byte per parameter, tensors of
one-element rows included; tests/optim/test_shapes_memory.py holds the property over shapes), how the optimizer
counts it (``state_bytes``, ``state_report``), and a state that no longer fits its parameter: a parameter changed
under the optimizer (resized or reshaped in place after its state exists) is refused in the preflight, naming the
parameter and the fix, before anything changes (case 009); dropping its state lets it start afresh."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gefen
from gefen import StepError

pytestmark = pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")


def _build(kind: str, named):
    if kind == "gefen_eager":
        return gefen.Gefen(named, lr=1e-2, backend="eager")
    if kind == "gefen_native":
        return gefen.Gefen(named, lr=1e-2)
    if kind == "muon":
        return gefen.GefenMuon(named, lr=1e-2, normuon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gefen.GefenMuonHybrid(named, lr=1e-2)


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_equal(u, v) for u, v in zip(x, y))
    return x == y


# ---------------------------------------------------------------------------------------------- fit
@pytest.mark.parametrize("change", ["grown", "transposed"])
@pytest.mark.parametrize("kind", ["gefen_eager", "gefen_native", "muon", "hybrid"])
def test_a_parameter_changed_under_the_optimizer_is_refused_before_anything_changes_case_009(kind, change):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(16, 32))
    b = torch.nn.Parameter(torch.randn(16, 32))
    opt = _build(kind, [("a", a), ("b", b)])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    b.data = torch.randn(24, 32) if change == "grown" else torch.randn(32, 16)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    saved, a_before, b_before = copy.deepcopy(opt.state_dict()), a.detach().clone(), b.detach().clone()
    with pytest.raises(StepError, match=r"the state of b no longer fits the parameter .*del opt.state\[param\]"):
        opt.step()
    assert torch.equal(a, a_before) and torch.equal(b, b_before)
    assert _equal(opt.state_dict(), saved)
    del opt.state[b]  # the documented way out: b starts afresh, a keeps training
    opt.step()
    assert not torch.equal(a, a_before) and not torch.equal(b, b_before)
    assert opt.state[b]["first_moment_codes"].numel() == b.numel()


# ---------------------------------------------------------------------------------------------- size
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loss(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen)
    return model(x).square().mean()


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


@pytest.mark.parametrize("shape", [(100003,), (100003, 3), (1, 4096), (70001, 1)])
def test_odd_shapes_stay_near_one_byte_per_param(shape):
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = gefen.Gefen([p], lr=1e-3)
    p.grad = torch.randn(shape)
    opt.step()
    assert opt.state_bytes() - 1024 <= 1.01 * p.numel() + 64


@pytest.mark.parametrize("shape, period", [((7919,), 7919), ((4096, 1), 2048), ((65536,), 2048)])
def test_tensors_with_one_element_rows_take_the_flattened_period(shape, period):
    """The layout rule (``layout_period``): rows of one element are too short to hold a block, so the tensor keeps
    the period of its flattened gradient. A constant gradient has no block structure (every §3.2 score is 0): the
    §3.4 fallback, the largest divisor <= 2048 (7919 is prime: the whole tensor). State: one byte of codes per
    element, a 4-byte magnitude and a 4-byte second moment per block, two int64 counters (it was 9 bytes/element:
    one-element blocks)."""
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = gefen.Gefen([p], lr=1e-3)
    p.grad = torch.full(shape, 0.25)
    opt.step()
    assert int(opt.state[p]["period"]) == period
    assert opt.state_bytes() - 1024 == p.numel() + 8 * (p.numel() // period) + 16


def test_state_bytes_counts_live_tensors_and_report_adds_up():
    model, opt = _trained()
    report = opt.state_report()
    by_hand = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert opt.state_bytes() == by_hand + 256 * 4
    assert sum(r["state_bytes"] for r in report) == by_hand
    w = report[0]
    assert w["shape"] == (32, 16) and w["second_moment"] == "factored"
    assert w["state_bytes"] == 512 + 4 * (512 // w["period"]) + 4 * (32 + 16) + 16


def test_bytes_per_param_bound_on_gpt_shaped_set():
    torch.manual_seed(0)
    d, ff, vocab = 256, 704, 2048
    shapes = [(vocab, d)] + [(d, d)] * 4 * 2 + [(ff, d), (ff, d), (d, ff)] * 2 + [(d,)] * 5
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = gefen.Gefen(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)))
    opt.step()
    n = sum(p.numel() for p in params)
    assert opt.state_bytes() / n <= 1.05
    adamw = torch.optim.AdamW(params, lr=1e-3)
    adamw.step()
    adamw_bytes = sum(t.numel() * t.element_size() for st in adamw.state.values() for t in st.values())
    assert adamw_bytes / n >= 8.0
