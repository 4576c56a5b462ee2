"""Gefen's own constructor options: its hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
``factored_v_2d``) validated, numpy and tensor values accepted, AdamW-only options refused clearly (their defaults
accepted), bad parameter lists refused.

Gefen-only by nature: GefenMuon's and the hybrid's options are theirs (``test_muon.py``); the refusals every
optimizer shares run for all three in ``test_torch_contract.py`` (``test_errors``) and in the fault catalogue's
construct table (``tests/test_fault_catalogue.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gefen
from gefen import ConfigError
from tests.optim.test_gefen_first_step import _mlp, _steps


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
        ({"differentiable": True}, ConfigError, "differentiable"),
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
    for foreach in (False, True):  # only picks torch's loop: accepted, no effect (tests/optim/test_dropin_rules.py)
        gefen.Gefen(_mlp().parameters(), foreach=foreach)
