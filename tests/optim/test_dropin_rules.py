"""A drop-in keeps its anchor's behaviour (issue 36, item 1): ``gefen.Gefen`` against ``torch.optim.AdamW`` and
``gefen.GefenMuon`` against ``torch.optim.Muon``, rule by rule of their constructors and ``add_param_group``.

Every input is given to both. Where torch accepts it, ours accepts it with the same meaning: the same group
values for every key the two share (tensors compared by shape, dtype and value), the caller's dict as the group,
the same parameters. Where torch refuses it (at construction, or at its first step), ours refuses it too, before
anything changes. The remaining deliberate differences each have a test here, named in the
"torch.optim compatibility" table of docs/torch_compatibility.md.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gefen
from gefen import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")

ADAMW_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "decoupled_weight_decay")
MUON_KEYS = ["lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"]


def _p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


def _same(a: Any, b: Any) -> bool:
    """Equal group values: tensors by shape, dtype and value; sequences item by item (tuple vs list counts)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _assert_same_groups(theirs: torch.optim.Optimizer, ours: torch.optim.Optimizer) -> None:
    """The same number of groups, the same parameters (by identity) and names, and equal values for every key
    the two optimizers' groups share; every key of ours that torch has too is there."""
    assert len(theirs.param_groups) == len(ours.param_groups)
    for t, o in zip(theirs.param_groups, ours.param_groups):
        assert [id(p) for p in t["params"]] == [id(p) for p in o["params"]]
        shared = (set(t) & set(o)) - {"params"}
        assert set(t) - set(o) <= set(ADAMW_FLAGS), set(t) - set(o)  # only AdamW's flags are not stored
        for key in shared:
            assert _same(t[key], o[key]), (key, t[key], o[key])


def _both(anchor: type, ours: type, params: Callable[[], Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Build both over the same parameters (``params`` is called twice: generators and dicts are fresh)."""
    return anchor(params(), *args, **kwargs), ours(params(), *args, **kwargs)


# ---------------------------------------------------------------------------------------------------- Gefen / AdamW
W, B = _p(4, 4), _p(4)
FROZEN = torch.zeros(3)  # requires_grad=False: kept, as torch keeps it (case 008)


def test_gefen_defaults_are_adamws():
    theirs, ours = torch.optim.AdamW([W]), gefen.Gefen([W])
    for key in ("lr", "betas", "eps", "weight_decay", "fused"):
        assert _same(theirs.defaults[key], ours.defaults[key]), key
    assert ours.defaults["weight_decay"] == 1e-2  # AdamW's, decided for the drop-in user (it was 0.0)
    _assert_same_groups(theirs, ours)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {"lr": 3e-4}),
        ((), {"lr": 1}),
        ((), {"lr": 0.0}),
        ((), {"lr": torch.tensor(1e-3)}),
        ((), {"lr": torch.tensor([1e-3])}),
        ((), {"betas": [0.8, 0.9]}),
        ((), {"betas": (torch.tensor(0.8), torch.tensor(0.9))}),
        ((), {"betas": (torch.tensor([0.8]), torch.tensor([[0.9]]))}),  # stored 0-dim, as torch stores them
        ((), {"eps": torch.tensor(1e-6)}),
        ((), {"weight_decay": 0.0}),
        ((), {"weight_decay": torch.tensor(0.1)}),
        ((1e-3, (0.9, 0.999), 1e-8, 1e-2, False), {}),  # every positional argument, amsgrad included
        ((), {"amsgrad": False, "maximize": False, "differentiable": False, "capturable": False}),
        ((), {"foreach": None}),
        ((), {"foreach": False}),
        ((), {"foreach": True}),  # picks torch's loop only: accepted, no effect on Gefen's step
        ((), {"fused": None}),
        ((), {"fused": False}),
    ],
)
def test_gefen_accepts_adamws_arguments_with_the_same_values(args, kwargs):
    theirs, ours = _both(torch.optim.AdamW, gefen.Gefen, lambda: [W, B], *args, **kwargs)
    _assert_same_groups(theirs, ours)


PARAMS = {
    "list": lambda: [W, B],
    "generator": lambda: (p for p in [W, B]),
    "named pairs": lambda: [("w", W), ("b", B)],
    "named generator": lambda: ((n, p) for n, p in [("w", W), ("b", B)]),
    "dicts": lambda: [{"params": [W], "lr": 0.1, "tag": "decay"}, {"params": B, "weight_decay": 0.0}],
    "dict of a generator": lambda: [{"params": (p for p in [W, B])}],
    "named dicts": lambda: [{"params": [("w", W)]}, {"params": [("b", B)], "eps": 1e-6}],
    "empty group": lambda: [{"params": [W, B]}, {"params": [], "weight_decay": 0.0}],
    "only empty groups": lambda: [{"params": []}, {"params": []}],
    "frozen": lambda: [FROZEN, W],
    "param_names given": lambda: [{"params": [W], "param_names": ["mine"]}],
}


@pytest.mark.parametrize("form", list(PARAMS))
def test_gefen_accepts_adamws_params_forms(form):
    theirs, ours = _both(torch.optim.AdamW, gefen.Gefen, PARAMS[form])
    _assert_same_groups(theirs, ours)


def test_gefen_keeps_the_callers_dicts_as_its_groups():
    """torch's groups are the caller's dicts, filled in (defaults, names); a scheduler or a user that kept a
    reference edits the live group. A refused dict is left as it was."""
    for cls in (torch.optim.AdamW, gefen.Gefen):
        first, extra = {"params": [("w", W)], "lr": 0.1, "tag": 1}, {"params": [("b", B)]}
        opt = cls([first])
        opt.add_param_group(extra)
        assert opt.param_groups[0] is first and opt.param_groups[1] is extra
        assert first["params"] == [W] and first["param_names"] == ["w"] and first["tag"] == 1
        assert extra["lr"] == 1e-3 and extra["weight_decay"] == 1e-2 and extra["param_names"] == ["b"]
        first["lr"] = 0.5  # the caller's reference is the live group
        assert opt.param_groups[0]["lr"] == 0.5
    bad = {"params": [_p(3)], "eps": 0.0}
    before = dict(bad)
    opt = gefen.Gefen([W])
    with pytest.raises(ConfigError):
        opt.add_param_group(bad)
    assert bad == before and len(opt.param_groups) == 1


def test_gefen_construction_changes_no_callers_dict_when_it_refuses():
    good, bad = {"params": [W], "lr": 0.1}, {"params": [B], "betas": (0.9, 1.0)}
    with pytest.raises(ConfigError, match=r"betas"):
        gefen.Gefen([good, bad])
    assert good == {"params": [W], "lr": 0.1} and bad == {"params": [B], "betas": (0.9, 1.0)}


@pytest.mark.parametrize(
    ("params", "kwargs", "group"),
    [
        (lambda: [W], {}, lambda: {"params": [B], "lr": 0.5, "tag": "x"}),
        (lambda: [W], {}, lambda: {"params": B}),  # a single tensor
        (lambda: [W], {}, lambda: {"params": []}),  # an empty group (Lightning's unfreezing adds them)
        (lambda: [W], {}, lambda: {"params": (p for p in [B])}),
        (lambda: [("w", W)], {}, lambda: {"params": [("b", B)], "betas": (0.5, 0.6)}),
        (lambda: [W], {"lr": 0.2, "weight_decay": 0.3}, lambda: {"params": [B], "eps": 1e-5}),  # from defaults
    ],
)
def test_gefen_add_param_group_fills_and_keeps_what_adamw_does(params, kwargs, group):
    theirs, ours = _both(torch.optim.AdamW, gefen.Gefen, params, **kwargs)
    theirs.add_param_group(group())
    ours.add_param_group(group())
    _assert_same_groups(theirs, ours)


@pytest.mark.parametrize(
    ("params", "kwargs", "error"),
    [
        (lambda: [], {}, ValueError),  # an empty parameter list
        (lambda: iter([]), {}, ValueError),
        (lambda: W, {}, TypeError),  # a single tensor
        (lambda: [{"params": {W}}], {}, TypeError),  # a set
        (lambda: [W, "b"], {}, TypeError),
        (lambda: [[W]], {}, TypeError),
        (lambda: [W * 2], {}, ValueError),  # not a leaf
        (lambda: [("w", W), B], {}, ValueError),  # names on some parameters only
        (lambda: [{"params": [("w", W)]}, {"params": [B]}], {}, ValueError),  # names in some groups only
        (lambda: [{"params": [W]}, {"params": [W]}], {}, ValueError),  # one parameter in two groups
        (lambda: [{"lr": 0.1}], {}, (KeyError, ValueError)),  # no 'params'
        (lambda: [W], {"lr": -1.0}, ValueError),
        (lambda: [W], {"lr": float("nan")}, ValueError),
        (lambda: [W], {"lr": torch.tensor([1e-3, 1e-3])}, ValueError),
        (lambda: [W], {"betas": (1.0, 0.999)}, ValueError),
        (lambda: [W], {"betas": (0.9, -0.1)}, ValueError),
        (lambda: [W], {"weight_decay": -0.1}, ValueError),
        (lambda: [W], {"eps": -1e-8}, ValueError),
        (lambda: [W], {"decoupled_weight_decay": True}, TypeError),  # Adam's keyword, not AdamW's
        (lambda: [W], {"momentum": 0.9}, TypeError),
    ],
)
def test_gefen_refuses_what_adamw_refuses(params, kwargs, error):
    with pytest.raises(error):
        torch.optim.AdamW(params(), **kwargs)
    with pytest.raises(error):
        gefen.Gefen(params(), **kwargs)


@pytest.mark.parametrize(
    "group",
    [
        [B],  # not a dict
        {"lr": 0.1},  # no 'params'
        {"params": [W]},  # already in the optimizer
        {"params": {B}},  # a set
        {"params": [("b", B)]},  # names in an optimizer without
        {"params": [B * 2]},  # not a leaf
    ],
)
def test_gefen_add_param_group_refuses_what_adamw_refuses_and_changes_nothing(group):
    with pytest.raises((TypeError, ValueError, KeyError)):
        torch.optim.AdamW([W]).add_param_group(copy.copy(group) if isinstance(group, dict) else group)
    opt = gefen.Gefen([W])
    before = copy.copy(group)
    with pytest.raises((TypeError, ValueError)):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1 and group == before


def test_a_group_appended_by_hand_without_keys_is_refused_at_step_before_any_change():
    """``param_groups.append`` bypasses ``add_param_group`` in torch too; torch's step raises KeyError after
    updating the first group, ours before touching anything."""
    for cls in (torch.optim.AdamW, gefen.Gefen):
        w, b = _p(4, 4), _p(4, 4)
        opt = cls([w])
        opt.param_groups.append({"params": [b]})
        w.grad, b.grad = torch.randn(4, 4), torch.randn(4, 4)
        before = w.detach().clone()
        with pytest.raises(KeyError):
            opt.step()
        if cls is gefen.Gefen:
            assert torch.equal(w, before) and not opt.state


# deliberate differences (docs/torch_compatibility.md)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": 0.0}, r"eps'?\]?=0\.0 must be a finite number > 0"),
        ({"eps": float("inf")}, r"eps'?\]?=inf must be a finite number > 0"),
        ({"lr": float("inf")}, r"lr'?\]?=inf must be a finite number >= 0"),
        ({"weight_decay": float("inf")}, r"weight_decay'?\]?=inf must be a finite number >= 0"),
    ],
)
def test_gefen_refuses_zero_or_infinite_eps_lr_and_weight_decay_that_adamw_accepts(kwargs, message):
    """eps is a divisor floor (0 divides by zero for an all-zero block); an infinite lr or decay makes every
    parameter non-finite on the first step."""
    torch.optim.AdamW([W], **kwargs)  # accepted by torch
    with pytest.raises(ConfigError, match=message):
        gefen.Gefen([W], **kwargs)
    with pytest.raises(ConfigError, match=message):
        gefen.Gefen([W]).add_param_group({"params": [B], **kwargs})


def test_gefen_refuses_betas_that_are_not_a_pair():
    torch.optim.AdamW([W], betas=(0.9, 0.99, 0.5))  # torch reads the first two and ignores the rest
    with pytest.raises(ConfigError, match=r"must be a pair \(beta1, beta2\)"):
        gefen.Gefen([W], betas=(0.9, 0.99, 0.5))


@pytest.mark.parametrize(
    ("key", "value"),
    [("amsgrad", True), ("maximize", True), ("differentiable", True), ("decoupled_weight_decay", False)],
)
def test_gefen_refuses_adamw_options_it_does_not_implement_also_in_a_group(key, value):
    """Refused in the constructor and in a group (where torch honours them per group; Gefen used to ignore them
    there), at construction, at ``add_param_group``, and at ``step()`` when set by hand."""
    if key != "decoupled_weight_decay":  # not an AdamW keyword argument
        torch.optim.AdamW([W], **{key: value})
        with pytest.raises(ConfigError, match=rf"does not implement torch\.optim\.AdamW's {key}={value}"):
            gefen.Gefen([W], **{key: value})
    torch.optim.AdamW([{"params": [W], key: value}])
    with pytest.raises(ConfigError, match=rf"param_groups\[0\]\['{key}'\]={value}: Gefen does not implement"):
        gefen.Gefen([{"params": [W], key: value}])
    opt = gefen.Gefen([W])
    with pytest.raises(ConfigError, match=rf"param_groups\[1\]\['{key}'\]"):
        opt.add_param_group({"params": [B], key: value})
    w = _p(4, 4)
    opt = gefen.Gefen([w])
    opt.param_groups[0][key] = value
    w.grad = torch.randn(4, 4)
    before = w.detach().clone()
    with pytest.raises(ConfigError, match=rf"param_groups\[0\]\['{key}'\]"):
        opt.step()
    assert torch.equal(w, before) and not opt.state


def test_gefen_capturable_is_one_setting_for_the_optimizer():
    torch.optim.AdamW([{"params": [W], "capturable": True}])  # torch: per group
    with pytest.raises(ConfigError, match=r"\['capturable'\]=True, the optimizer's is False"):
        gefen.Gefen([{"params": [W], "capturable": True}])
    opt = gefen.Gefen([{"params": [W], "capturable": False, "foreach": True}])  # its own value, any foreach: fine
    assert opt.param_groups[0]["capturable"] is False and opt.param_groups[0]["foreach"] is True  # user keys kept


def test_gefen_groups_hold_gefens_options_not_adamws_flags():
    """AdamW's implementation flags are accepted at the values Gefen implements but not stored: its groups and
    ``defaults`` hold Gefen's own options (every torch optimizer class has its own keys; a ``capturable`` key
    would also be set by ``torch.compile``'s optimizer tracing, which Gefen's step does not read)."""
    theirs = torch.optim.AdamW([W], foreach=False)
    ours = gefen.Gefen([W], foreach=False)
    assert set(theirs.defaults) - set(ours.defaults) == set(ADAMW_FLAGS)
    assert set(ours.defaults) == {"lr", "betas", "eps", "weight_decay", "factored_v_2d", "backend", "fused"}
    assert set(ours.param_groups[0]) == set(ours.defaults) | {"params", "gefen_metadata"}


def test_gefen_accepts_some_inputs_adamw_refuses():
    """A superset, not a difference of meaning: betas of mixed kinds or ints, a tensor lr with foreach=True, and
    AdamW's off values given to GefenMuon."""
    for kwargs in (
        {"betas": (torch.tensor(0.9), 0.999)},
        {"betas": (0, 0)},
        {"lr": torch.tensor(1e-3), "foreach": True},
    ):
        with pytest.raises(ValueError):
            torch.optim.AdamW([W], **kwargs)
        gefen.Gefen([W], **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'maximize'"):
        torch.optim.Muon([M1], maximize=False)
    gefen.GefenMuon([M1], maximize=False, foreach=None)  # AdamW call sites' explicit defaults keep working


@pytest.mark.parametrize("ours", [gefen.Gefen, gefen.GefenMuon])
def test_a_parameter_listed_twice_is_refused(ours):
    anchor = torch.optim.AdamW if ours is gefen.Gefen else torch.optim.Muon
    with pytest.warns(UserWarning, match="duplicate parameters"):
        anchor([W, W])
    with pytest.raises(ConfigError, match="same parameter twice"):
        ours([W, W])


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_gefen_refuses_integer_and_complex_parameters(dtype):
    """torch keeps an integer tensor (it never gets a gradient) and steps complex ones as real pairs; Gefen's
    codes and blocks are for real floating tensors: optimize ``torch.view_as_real(p)``."""
    tensor = torch.zeros(4, dtype=dtype, requires_grad=dtype.is_complex)
    torch.optim.AdamW([tensor])
    with pytest.raises(ConfigError, match=r"real floating tensors only"):
        gefen.Gefen([tensor])


def test_a_nan_gradient_skips_gefens_step_where_adamw_propagates_it():
    """Default ``nonfinite="skip"``: the step changes nothing and warns; AdamW writes NaN into every parameter
    the gradient reaches. ``nonfinite="propagate"`` is AdamW's behaviour."""
    results = {}
    for name, make in {
        "adamw": lambda ps: torch.optim.AdamW(ps),
        "gefen": lambda ps: gefen.Gefen(ps),
        "propagate": lambda ps: gefen.Gefen(ps, nonfinite="propagate"),
    }.items():
        torch.manual_seed(0)
        w = _p(8, 8)
        opt = make([w])
        w.grad = torch.randn(8, 8)
        opt.step()  # a first, finite step
        before = w.detach().clone()
        w.grad = torch.full((8, 8), float("nan"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        results[name] = (torch.equal(w, before), w.isnan().all().item(), [str(c.message) for c in caught])
    assert results["adamw"][:2] == (False, True)
    assert results["propagate"][:2] == (False, True)
    assert results["gefen"][:2] == (True, False) and any("NaN" in m for m in results["gefen"][2])


def test_gefen_default_weight_decay_decays_as_adamw():
    """With a zero gradient both updates are the decoupled decay alone, ``p·(1 − lr·λ)`` with λ = 1e-2."""
    torch.manual_seed(0)
    start = torch.randn(16, 16)
    out = []
    for cls in (torch.optim.AdamW, gefen.Gefen):
        w = nn.Parameter(start.clone())
        opt = cls([w], lr=0.1)
        w.grad = torch.zeros_like(w)
        opt.step()
        out.append(w.detach())
    torch.testing.assert_close(out[1], out[0])
    torch.testing.assert_close(out[1], start * (1 - 0.1 * 1e-2))


# ---------------------------------------------------------------------------------------------- GefenMuon / Muon
M1, M2 = _p(8, 4), _p(4, 6)


def test_gefen_muon_defaults_are_muons_in_torchs_order():
    theirs, ours = torch.optim.Muon([M1]), gefen.GefenMuon([M1])
    assert list(ours.defaults)[: len(MUON_KEYS)] == list(theirs.defaults) == MUON_KEYS
    for key in MUON_KEYS:
        assert _same(theirs.defaults[key], ours.defaults[key]), key
    _assert_same_groups(theirs, ours)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((2e-2, 0.05, 0.9, False, (3.0, -3.2, 1.2), 1e-6, 3, "match_rms_adamw"), {}),  # torch's positional order
        ((), {"lr": torch.tensor(1e-3), "weight_decay": torch.tensor(0.0)}),
        ((), {"momentum": 0.0}),
        ((), {"ns_coefficients": [3.0, -3.2, 1.2]}),
        ((), {"ns_steps": 99}),
        ((), {"adjust_lr_fn": "original"}),
        ((), {"eps": torch.tensor(1e-7)}),
    ],
)
def test_gefen_muon_accepts_muons_arguments_with_the_same_values(args, kwargs):
    theirs, ours = _both(torch.optim.Muon, gefen.GefenMuon, lambda: [M1, M2], *args, **kwargs)
    _assert_same_groups(theirs, ours)


MUON_PARAMS = {
    "generator": lambda: (p for p in [M1, M2]),
    "named pairs": lambda: [("a", M1), ("b", M2)],
    "dicts with user keys": lambda: [{"params": [M1], "lr": 0.1, "maximize": True}, {"params": M2, "tag": 1}],
    "empty group": lambda: [{"params": [M1]}, {"params": []}],
    "group ns_coefficients": lambda: [{"params": [M1], "ns_coefficients": (3.0, -3.2, 1.2), "ns_steps": 4}],
}


@pytest.mark.parametrize("form", list(MUON_PARAMS))
def test_gefen_muon_accepts_muons_params_forms(form):
    theirs, ours = _both(torch.optim.Muon, gefen.GefenMuon, MUON_PARAMS[form])
    _assert_same_groups(theirs, ours)
    matrix = _p(3, 3)
    extra = {"params": [("c", matrix)] if form == "named pairs" else [matrix], "momentum": 0.8}
    theirs.add_param_group(copy.copy(extra))
    ours.add_param_group(extra)
    _assert_same_groups(theirs, ours)
    assert ours.param_groups[-1] is extra


def _one_muon_step(cls: type, start: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    w = nn.Parameter(start.clone())
    opt = cls([w], **kwargs)
    w.grad = grad.clone()
    opt.step()
    return w.detach()


def test_gefen_muon_honours_ns_coefficients_and_ns_steps_as_muon_does():
    """momentum=0 with Nesterov makes both updates ``NS(G)`` of the exact gradient (Gefen's quantized momentum
    drops out), so the two steps agree to bf16 rounding; the standard coefficients give a clearly other step.
    Before issue 36, ``ns_coefficients`` was refused as a keyword and ignored in a group."""
    torch.manual_seed(0)
    start, grad = torch.randn(32, 16), torch.randn(32, 16)
    options = {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    custom = {"ns_coefficients": (2.0, -1.5, 0.5), "ns_steps": 3}
    theirs = _one_muon_step(torch.optim.Muon, start, grad, **options, **custom)
    ours = _one_muon_step(gefen.GefenMuon, start, grad, **options, **custom)
    standard = _one_muon_step(gefen.GefenMuon, start, grad, **options)
    update = (theirs - start).abs().max()
    assert (ours - theirs).abs().max() <= 2**-7 * update
    assert (standard - theirs).abs().max() > 0.1 * update
    w = nn.Parameter(start.clone())  # the same through a group's own value
    opt = gefen.GefenMuon([{"params": [w], **custom}], **options)
    w.grad = grad.clone()
    opt.step()
    assert torch.equal(w.detach(), ours)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ns_steps": 100}, r"ns_steps=100 must be in \[1, 100\)"),
        ({"ns_steps": 3.0}, r"ns_steps=3\.0 must be an int"),
        ({"ns_coefficients": (3.0, -3.0)}, r"ns_coefficients=\(3\.0, -3\.0\) must be three finite numbers"),
    ],
)
def test_gefen_muon_refuses_at_construction_what_muon_refuses_at_its_first_step(kwargs, message):
    w = _p(4, 4)
    torch_opt = torch.optim.Muon([w], **kwargs)
    w.grad = torch.randn(4, 4)
    with pytest.raises((ValueError, TypeError)):
        torch_opt.step()
    with pytest.raises((ConfigError, TypeError), match=message):
        gefen.GefenMuon([w], **kwargs)


def test_gefen_muon_refuses_a_non_matrix_added_later_where_muon_fails_at_step():
    w, bias = _p(4, 4), _p(4)
    torch_opt = torch.optim.Muon([w])
    torch_opt.add_param_group({"params": [bias]})  # torch checks the shape in its constructor only
    w.grad, bias.grad = torch.randn(4, 4), torch.randn(4)
    with pytest.raises(ValueError, match="2D"):
        torch_opt.step()
    opt = gefen.GefenMuon([w])
    with pytest.raises(ConfigError, match=r"has shape \(4,\); GefenMuon optimizes 2-D"):
        opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"adjust_lr_fn": "x"}, ConfigError, r"adjust_lr_fn'\]='x' must be None"),
        ({"weight_decay": -1.0}, ConfigError, r"weight_decay'\]=-1\.0 must be a finite number >= 0"),
        ({"lr": -1.0}, ConfigError, r"lr'\]=-1\.0 must be a finite number >= 0"),
        ({"momentum": -0.1}, ConfigError, r"momentum'\]=-0\.1 must be a number in \[0, 1\)"),
    ],
)
def test_gefen_muon_refuses_what_muon_refuses(kwargs, error, message):
    with pytest.raises(ValueError):
        torch.optim.Muon([M1], **kwargs)
    with pytest.raises(error, match=message):
        gefen.GefenMuon([M1], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"momentum": 1.0}, ConfigError, r"momentum'\]=1\.0 must be a number in \[0, 1\)"),
        ({"momentum": 1.5}, ConfigError, r"momentum'\]=1\.5 must be a number in \[0, 1\)"),
        ({"eps": 0.0}, ConfigError, r"eps'\]=0\.0 must be a finite number > 0"),
        ({"ns_steps": 0}, ConfigError, r"ns_steps=0 must be in \[1, 100\)"),
        ({"nesterov": 1}, TypeError, r"nesterov=1 must be a bool"),
        ({"lr": float("inf")}, ConfigError, r"lr'\]=inf must be a finite number >= 0"),
    ],
)
def test_gefen_muon_refuses_degenerate_values_muon_accepts(kwargs, error, message):
    """momentum >= 1 never forgets (1: the momentum stays zero; above: it grows without bound), eps = 0 divides
    an all-zero update by zero, zero iterations are no orthogonalisation, a flag is never coerced from an int."""
    w = _p(4, 4)
    torch_opt = torch.optim.Muon([w], **kwargs)
    w.grad = torch.randn(4, 4)
    torch_opt.step()  # torch runs it
    with pytest.raises(error, match=message):
        gefen.GefenMuon([M1], **kwargs)


def test_gefen_muon_refuses_ns_coefficients_together_with_another_schedule():
    with pytest.raises(ConfigError, match=r"ns_coefficients=.* and ns_schedule='tuned3' both choose"):
        gefen.GefenMuon([M1], ns_coefficients=(3.0, -3.2, 1.2), ns_schedule="tuned3")
    gefen.GefenMuon([M1], ns_schedule="tuned3")  # the default coefficients go with any schedule


def test_gefen_muon_loads_a_checkpoint_saved_before_ns_coefficients():
    """A group saved without the key keeps the live value (torch keeps live keys a checkpoint lacks)."""
    torch.manual_seed(0)
    w = _p(8, 8)
    opt = gefen.GefenMuon([w])
    w.grad = torch.randn(8, 8)
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["ns_coefficients"]
    fresh = gefen.GefenMuon([_p(8, 8)], ns_coefficients=(3.0, -3.2, 1.2))
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["ns_coefficients"] == (3.0, -3.2, 1.2)


def test_the_compatibility_table_names_an_existing_test_for_every_difference():
    """Each row of the "torch.optim compatibility" table (docs/torch_compatibility.md, linked from README) names
    tests that exist."""
    root = Path(__file__).resolve().parents[2]
    assert "docs/torch_compatibility.md" in (root / "README.md").read_text(encoding="utf-8")
    section = (root / "docs" / "torch_compatibility.md").read_text(encoding="utf-8")
    rows = [line for line in section.splitlines() if line.startswith("| ") and "::" in line]
    assert len(rows) >= 10
    for row in rows:
        for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row):
            assert re.search(rf"^def {name}\(", (root / path).read_text(encoding="utf-8"), re.M), (path, name)
