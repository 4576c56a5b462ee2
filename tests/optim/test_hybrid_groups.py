"""The param groups as torch.optim keeps them (issue 36): ``param_groups`` a plain list in ``add_param_group``'s
order, read, indexed, edited, extended and assigned as frameworks do, ``param_names`` written by torch's rules,
and a group listed twice numbered as torch numbers it. Mostly about :class:`gefen.GefenMuonHybrid`, whose list
spans two child optimizers (case 011: Lightning's ``BackboneFinetuning`` and its resume path).

References are computed independently: ``torch.optim.AdamW`` run through the same calls, or the same run without
the interruption, never numbers printed by the code under test.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gefen

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KINDS = ("gefen", "muon")


def _same(a: Any, b: Any) -> bool:
    """Equality of state dicts as torch's tests compare them: tensors by value, dtype and shape."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(params, lr=1e-2)
    if kind == "muon":
        return gefen.GefenMuon([p for p in params if p.dim() == 2], lr=1e-2)
    return gefen.GefenMuonHybrid(params, lr=1e-2, backup_optimizer=kind.split("_")[1])


@pytest.mark.parametrize("kind", KINDS)
def test_state_dicts_of_equal_optimizers_stay_equal_with_a_repeated_group(kind):
    """pytorch#36831: two optimizers with equal (not identical) parameters and state give equal state dicts, also
    once one lists its groups twice (``param_groups.extend(param_groups)``): a parameter listed again keeps its
    first index, so the last group of each names the same parameters with the same metadata. Gefen counted a
    repeated parameter twice in its ``stateful_params`` metadata."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4))
    x = torch.randn(6)

    def closure(opt, w, b):
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    opt = _optimizer(kind, [weight, bias])
    for _ in range(3):
        opt.step(lambda: closure(opt, weight, bias))
    weight_c, bias_c = (torch.nn.Parameter(p.detach().clone()) for p in (weight, bias))
    opt_c = _optimizer(kind, [weight_c, bias_c])
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(4):
        opt.step(lambda: closure(opt, weight, bias))
        opt_c.step(lambda: closure(opt_c, weight_c, bias_c))
    assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    assert _same(opt.state_dict(), opt_c.state_dict())
    count = len(opt_c.param_groups)
    opt_c.param_groups.extend(opt_c.param_groups)
    repeated = opt_c.state_dict()
    assert _same(opt.state_dict()["param_groups"][-1], repeated["param_groups"][-1])
    numbered = [g["params"] for g in repeated["param_groups"]]
    assert numbered[count:] == numbered[:count]
