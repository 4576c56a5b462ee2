"""A parameter changed under the optimizer (resized or reshaped in place after its state exists) is refused in the
preflight, naming the parameter and the fix, before anything changes (case 009); dropping its state lets it
start afresh."""

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
