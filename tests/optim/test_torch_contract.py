"""torch.optim's generic optimizer contract, for all three optimizers from one parametrisation (issue 15).

Written from torch's documented behaviour (``torch.optim.Optimizer`` and its hook registration methods), not from
torch's test code: step hooks (global and per-optimizer, pre and post, order and firing counts, removal), state-dict
hooks (they see and may replace torch's layout), the documented ``register_load_state_dict_pre_hook`` recipe that
rebuilds a state dict by parameter name, ``state`` keys that are not parameters, parameters frozen at
construction and unfrozen later (case 008), ``zero_grad(set_to_none=...)``, a parameter without a gradient being
left alone, and ``test_errors``-style bad inputs; and what Gefen's own contract file once checked for Gefen
alone: caller param groups and ``add_param_group``, lr per group, from a scheduler or as a tensor, closures, late
and empty parameters, every parameter dtype, refused steps changing nothing, ``inference_mode``, deepcopy and
pickle. Two deliberate differences from torch are asserted as such: duplicate parameters are refused (torch
warns), and a loader cannot cast quantized state.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gefen
from gefen import CheckpointError, ConfigError, StepError
from gefen.checkpoint import METADATA_KEY
from gefen.state import PERIOD, STEP
from tests.optim.determinism_job import digest
from tests.optim.test_torch_conventions import _build as _build_named

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")

pytestmark = pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")


def _model(names: tuple[str, ...] = ("inp", "out")) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = {"inp": (8, 16), "mid": (16, 16), "out": (16, 4)}
    return torch.nn.Sequential(torch.nn.ModuleDict({n: torch.nn.Linear(*sizes[n]) for n in names}))


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model[0].values():
        x = torch.tanh(layer(x))
    return x


def _build(kind: str, model: torch.nn.Module, **options: Any) -> torch.optim.Optimizer:
    if not kind.startswith("hybrid"):
        return _build_named(kind, model.named_parameters(), **options)
    with warnings.catch_warnings():  # the hybrid from the module itself: routing by module type
        warnings.simplefilter("ignore")
        return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=kind.split("_")[1], **options)


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    return _forward(model, x).square().mean()


def _backward(model: torch.nn.Module, seed: int) -> None:
    _loss(model, seed).backward()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        _backward(model, s)
        opt.step()


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


# ----------------------------------------------------------------------------------------------- step hooks
@pytest.mark.parametrize("kind", KINDS)
def test_step_hooks_global_and_own_fire_once_per_step_in_torch_order(kind):
    model = _model()
    opt = _build(kind, model)
    calls: list[tuple[str, str]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", type(o).__name__))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("own pre", type(o).__name__))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("own post", type(o).__name__))),
    ]
    try:
        _train(model, opt, range(2))
    finally:
        for h in handles[:2]:
            h.remove()
    name = type(opt).__name__
    one = [("global pre", name), ("own pre", name), ("own post", name), ("global post", name)]
    assert calls == one + one  # a hybrid's halves step without firing the global hooks again
    for h in handles[2:]:
        h.remove()
    calls.clear()
    _train(model, opt, range(2, 3))
    assert calls == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_pre_hook_sees_the_closure_and_the_closure_runs_once(kind):
    model = _model()
    opt = _build(kind, model)
    seen: list[Any] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append((len(a), sorted(k))))
    runs = []

    def closure():
        runs.append(1)
        opt.zero_grad()
        _backward(model, 0)
        return torch.tensor(1.5)

    assert float(opt.step(closure)) == 1.5
    assert runs == [1] and len(seen) == 1


# ----------------------------------------------------------------------------------------- state-dict hooks
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_hooks_see_and_replace_torch_layout(kind):
    model = _model()
    opt = _build(kind, model)
    _train(model, opt, range(2))
    events: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: events.append("pre"))

    def post(o, sd):
        events.append("post")
        assert isinstance(sd["state"], dict) and isinstance(sd["param_groups"], list)
        assert sorted(sd["state"]) == list(range(len(_params(o))))  # torch's layout: positions, every parameter
        return {**sd, "user_tag": 7}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert events == ["pre", "post"] and sd["user_tag"] == 7

    fresh = _build(kind, copy.deepcopy(model))
    loads: list[str] = []

    def load_pre(o, sd):
        loads.append("pre")
        assert sd["user_tag"] == 7
        return {k: v for k, v in sd.items() if k != "user_tag"}

    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_post_hook(lambda o: loads.append("post"))
    fresh.load_state_dict(sd)
    assert loads == ["pre", "post"]
    broken = copy.deepcopy(sd)
    broken["param_groups"][0]["lr"] = -1.0
    with pytest.raises(CheckpointError):
        fresh.load_state_dict(broken)
    assert loads == ["pre", "post", "pre"]  # no post-hook after a refused load


# ------------------------------------------------------------------- the documented load pre-hook recipe
def _adapt_by_name(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """torch's documented recipe: start from the live state dict, take the saved groups' settings, and copy the
    saved state of every parameter whose name the checkpoint has (applied to every group)."""
    adapted = copy.deepcopy(optimizer.state_dict())
    by_name = {}
    for group in saved["param_groups"]:
        by_name.update(dict(zip(group["param_names"], group["params"])))
    for new_group, old_group in zip(adapted["param_groups"], saved["param_groups"]):
        for key, value in old_group.items():
            if key not in ("params", "param_names"):
                new_group[key] = value
        for pid, name in zip(new_group["params"], new_group["param_names"]):
            if name in by_name:
                adapted["state"][pid] = copy.deepcopy(saved["state"][by_name[name]])
    return adapted


@pytest.mark.parametrize("kind", KINDS)
def test_the_load_pre_hook_recipe_loads_a_checkpoint_into_a_grown_model(kind):
    """A layer is inserted (names and positions change): the recipe's dict, with the codebook it came with,
    loads; every old parameter gets its saved state; the new one starts without state."""
    old = _model(("inp", "out"))
    opt = _build(kind, old)
    _train(old, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    grown = _model(("inp", "mid", "out"))
    grown[0]["inp"].load_state_dict(old[0]["inp"].state_dict())
    grown[0]["out"].load_state_dict(old[0]["out"].state_dict())
    fresh = _build(kind, grown)
    fresh.register_load_state_dict_pre_hook(_adapt_by_name)
    fresh.load_state_dict(saved)
    old_named = dict(old.named_parameters())
    compared = 0
    for name, p in grown.named_parameters():
        if not any(p is q for q in _params(fresh)):
            continue
        if name in old_named and opt.state.get(old_named[name]):
            want, got = opt.state[old_named[name]], fresh.state[p]
            assert sorted(got) == sorted(want), name
            assert all(torch.equal(got[k], want[k]) for k in want), name
            compared += 1
        elif "mid" in name:
            assert not fresh.state.get(p), name
    assert compared >= 2
    for a, b in zip(_children(opt), _children(fresh)):
        if isinstance(a, gefen.Gefen):
            assert torch.equal(a.codebook, b.codebook) and a.global_step == b.global_step
    _train(grown, fresh, range(3, 5))
    assert all(torch.isfinite(p).all() for p in grown.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_the_recipe_cannot_mix_state_quantized_against_two_codebooks(kind):
    """A warm optimizer keeps its own state for the new layer; that state was quantized against its own codebook,
    not the checkpoint's: refused, naming the parameter, with nothing changed (a hybrid's halves alike)."""
    old = _model(("inp", "out"))
    opt = _build(kind, old)
    _train(old, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    grown = _model(("inp", "mid", "out"))
    warm = _build(kind, grown)
    _train(grown, warm, range(10, 12))
    before = copy.deepcopy(warm.state_dict())
    warm.register_load_state_dict_pre_hook(_adapt_by_name)
    with pytest.raises(CheckpointError, match=r"mid\.weight.*own live state.*another codebook"):
        warm.load_state_dict(saved)
    after = warm.state_dict()
    assert all(torch.equal(after["state"][i][k], v) for i, s in before["state"].items() for k, v in s.items())


def _children(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]


# ------------------------------------------------------------------------------ state keys, frozen, zero_grad
@pytest.mark.parametrize("kind", KINDS)
def test_state_takes_keys_that_are_not_parameters(kind):
    model = _model()
    opt = _build(kind, model)
    assert opt.state["never set"] == {}  # a defaultdict, as torch's
    opt.state["user"]["count"] = 3
    _train(model, opt, range(2))
    assert opt.state["user"] == {"count": 3}
    sd = opt.state_dict()
    assert sd["state"]["user"] == {"count": 3}
    fresh = _build(kind, copy.deepcopy(model))
    fresh.load_state_dict(sd)
    assert fresh.state["user"] == {"count": 3}
    assert fresh.state["user"] is not sd["state"]["user"]
    _train(model, fresh, range(2, 3))


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_frozen_at_construction_train_once_unfrozen_case_008(kind):
    model = _model()
    model[0]["inp"].requires_grad_(False)
    opt = _build(kind, model)
    held = {id(p) for p in _params(opt)}
    assert id(model[0]["inp"].weight) in held  # kept, as by torch.optim
    _train(model, opt, range(2))
    frozen = model[0]["inp"].weight.detach().clone()
    model[0]["inp"].requires_grad_(True)
    _train(model, opt, range(2, 4))
    assert not torch.equal(frozen, model[0]["inp"].weight)


def test_a_hybrid_of_frozen_parameters_only_is_built_case_008():
    model = _model()
    model.requires_grad_(False)
    opt = gefen.GefenMuonHybrid(model, lr=1e-2)
    assert len(_params(opt)) == 4
    opt.step()  # no gradient anywhere: nothing happens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(kind, set_to_none):
    model = _model()
    opt = _build(kind, model)
    _backward(model, 0)
    opt.zero_grad(set_to_none=set_to_none)
    for p in _params(opt):
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_without_a_gradient_is_left_alone(kind):
    model = _model()
    opt = _build(kind, model)
    _train(model, opt, range(2))
    frozen = model[0]["inp"].weight
    before = frozen.detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[frozen].items()}
    opt.zero_grad()
    _backward(model, 5)
    frozen.grad = None
    opt.step()
    assert torch.equal(frozen, before)
    assert all(torch.equal(opt.state[frozen][k], v) for k, v in state_before.items())
    counts = [c.global_step for c in _children(opt) if isinstance(c, gefen.Gefen)]
    opt.zero_grad(set_to_none=True)
    snapshot = [p.detach().clone() for p in _params(opt)]
    opt.step()  # no gradient at all: a no-op, global steps included
    assert all(torch.equal(a, b) for a, b in zip(snapshot, _params(opt)))
    assert counts == [c.global_step for c in _children(opt) if isinstance(c, gefen.Gefen)]


# ----------------------------------------------------------------------------------------------- bad inputs
def _make(kind: str, params: Any, **kw: Any) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(params, **kw)
    if kind == "muon":
        return gefen.GefenMuon(params, **kw)
    if isinstance(params, list) and all(isinstance(p, torch.Tensor) for p in params):
        params = [(f"w{i}", p) for i, p in enumerate(params)]
    return gefen.GefenMuonHybrid(params, **{"lr": 1e-3, **kw})


@pytest.mark.parametrize("kind", ["gefen", "muon", "hybrid_gefen"])
@pytest.mark.parametrize(
    "label, params, options, error, match",
    [
        ("negative lr", "weights", {"lr": -1.0}, ConfigError, r"lr.*must be a finite number >= 0"),
        ("nan lr", "weights", {"lr": float("nan")}, ConfigError, r"lr.*must be a finite number"),
        ("empty list", "empty", {}, ValueError, r"empty parameter list|no parameter"),
        ("a bare tensor", "tensor", {}, TypeError, r"single Tensor|needs an nn.Module or \(name, tensor\) pairs"),
        ("a non-leaf tensor", "non-leaf", {}, ValueError, r"non-leaf"),
        ("the same tensor twice (refused; torch warns)", "duplicate", {}, ValueError, r"twice"),
    ],
)
def test_errors(kind, label, params, options, error, match):
    w = torch.zeros(3, 4, requires_grad=True)
    given = {
        "weights": [w],
        "empty": [],
        "tensor": w,
        "non-leaf": [w * 2],
        "duplicate": [w, w],
    }[params]
    with pytest.raises(error, match=match):
        _make(kind, given, **options)


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_loader_cannot_cast_quantized_state(kind):
    """Deliberate difference: torch's load casts floating state to the parameter's dtype; Gefen keeps uint8 codes
    and fp32 magnitudes whatever the parameter dtype, and refuses a checkpoint whose state dtypes were changed."""
    model = _model()
    opt = _build(kind, model)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    bf16 = _build(kind, copy.deepcopy(model).to(torch.bfloat16))
    bf16.load_state_dict(copy.deepcopy(sd))
    first = next(p for p in _params(bf16) if bf16.state.get(p))
    assert bf16.state[first]["first_moment_codes"].dtype == torch.uint8
    assert bf16.state[first]["first_moment_scale"].dtype == torch.float32
    cast = copy.deepcopy(sd)
    entry = next(s for s in cast["state"].values() if "first_moment_scale" in s)
    entry["first_moment_scale"] = entry["first_moment_scale"].to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"first_moment_scale.*dtype"):
        _build(kind, copy.deepcopy(model)).load_state_dict(cast)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trained_sibling_s_state_dict_loads_into_a_trained_optimizer(kind):
    """Population-based training: two workers resumed from one checkpoint (one codebook) train on different data;
    one then loads the other's unmodified state dict. Same codebook, same global step, other states: it loads."""
    model = _model()
    opt = _build(kind, model)
    _train(model, opt, range(3))
    start = copy.deepcopy(opt.state_dict())
    models, opts = [], []
    for seed in (100, 200):
        m = copy.deepcopy(model)
        o = _build(kind, m)
        o.load_state_dict(copy.deepcopy(start))
        _train(m, o, range(seed, seed + 2))
        models.append(m)
        opts.append(o)
    opts[1].load_state_dict(opts[0].state_dict())
    models[1].load_state_dict(models[0].state_dict())
    _train(models[0], opts[0], range(7, 9))
    _train(models[1], opts[1], range(7, 9))
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_reading_state_of_a_parameter_without_state_keeps_state_dict_loadable(kind):
    """``opt.state[p]`` (a defaultdict read) or ``p in opt.state`` for a parameter without state: the optimizer's
    own ``state_dict()`` still loads (the empty entry is saved as zero counters)."""
    model = _model(("inp", "mid", "out"))
    opt = _build(kind, model)
    unused = model[0]["mid"].weight
    for s in range(2):
        opt.zero_grad()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(s))
        torch.tanh(model[0]["out"](torch.tanh(model[0]["inp"](x)))).square().mean().backward()
        opt.step()
    assert (unused in opt.state) is False or not opt.state[unused]
    assert not opt.state.get(unused)
    opt.state[unused]  # noqa: B018 - the read itself is the case
    _build(kind, copy.deepcopy(model)).load_state_dict(opt.state_dict())


def test_the_recipe_into_a_hybrid_takes_the_checkpoint_s_hybrid_counters():
    """The recipe keeps the live hybrid's top-level ``gefen_hybrid`` entry and copies the checkpoint's group
    mirrors: the mirrors win (here a checkpoint that skipped a NaN step)."""
    old = _model(("inp", "out"))
    opt = gefen.GefenMuonHybrid(old, lr=1e-2)
    _train(old, opt, range(2))
    opt.zero_grad()
    _backward(old, 9)
    next(iter(old.parameters())).grad.view(-1)[0] = float("nan")
    with pytest.warns(UserWarning, match="skipped"):
        opt.step()
    assert opt.skipped_steps == 1
    saved = copy.deepcopy(opt.state_dict())
    fresh = gefen.GefenMuonHybrid(_model(("inp", "mid", "out")), lr=1e-2)
    fresh.register_load_state_dict_pre_hook(_adapt_by_name)
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 1


# ------------------------------------------------------- groups, lr, closures, late parameters, refusals, copies
# (once checked for Gefen alone; now for every optimizer from KINDS where it applies)
THREE = ("inp", "mid", "out")


@dataclass(frozen=True)
class CallerGroups:
    """How Gefen and GefenMuon take the caller's param groups. (The hybrid makes its own, one per half, by its routing
    rule; a caller's group reaches it through ``add_param_group``, which routes it: ``test_muon.py``, case 002.)

    Attributes:
        make: the optimizer class.
        takes: which of a model's parameters it steps (GefenMuon: matrices only).
        option: a group option of its own, with a valid value.
        bad_option: that option with an invalid value.
        defaults: constructor defaults a group without them gets.
    """

    make: Callable[..., torch.optim.Optimizer]
    takes: Callable[[torch.Tensor], bool]
    option: tuple[str, Any]
    bad_option: tuple[str, Any]
    defaults: dict[str, Any]


CALLER_GROUPS = {
    "gefen": CallerGroups(
        gefen.Gefen, lambda p: True, ("betas", (0.8, 0.9)), ("betas", (0.9, 1.5)), {"weight_decay": 1e-2, "eps": 1e-8}
    ),
    "muon": CallerGroups(
        gefen.GefenMuon,
        lambda p: p.dim() == 2,
        ("momentum", 0.9),
        ("momentum", 1.5),
        {"weight_decay": 0.1, "eps": 1e-7},
    ),
}


def _held(kind: str, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if CALLER_GROUPS[kind].takes(p)]


def _caller_groups(kind: str) -> Callable[..., torch.optim.Optimizer]:
    def make(model: torch.nn.Module, lr: Any = 1e-2, first_lr: float | None = None) -> torch.optim.Optimizer:
        held = _held(kind, model)
        first = {"params": held[:2]} if first_lr is None else {"params": held[:2], "lr": first_lr}
        return CALLER_GROUPS[kind].make([first, {"params": held[2:]}], lr=lr)

    return make


def _hybrid(backup: str) -> Callable[..., torch.optim.Optimizer]:
    def make(model: torch.nn.Module, lr: Any = 1e-2, first_lr: float | None = None) -> torch.optim.Optimizer:
        lrs = {"lr": lr} if first_lr is None else {"lr": first_lr, "backup_lr": lr}  # the Muon half's group is first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return gefen.GefenMuonHybrid(model, backup_optimizer=backup, **lrs)

    return make


#: The optimizer of a kind over a model with two param groups: for Gefen and GefenMuon the caller's (the first two
#: parameters | the rest), for the hybrid its two halves (Muon | backup); ``first_lr``: the first group's own lr.
TWO_GROUPS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "gefen": _caller_groups("gefen"),
    "muon": _caller_groups("muon"),
    "hybrid_gefen": _hybrid("gefen"),
    "hybrid_adamw": _hybrid("adamw"),
}

#: The top-level metadata entry of a kind's state dict.
TOP_KEY = {"gefen": METADATA_KEY, "muon": METADATA_KEY, "hybrid_gefen": "gefen_hybrid", "hybrid_adamw": "gefen_hybrid"}


def _gefens(opt: torch.optim.Optimizer) -> list[gefen.Gefen]:
    """The optimizer itself or its halves, less a torch AdamW backup."""
    return [c for c in _children(opt) if isinstance(c, gefen.Gefen)]


def _snapshot(opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    params = _params(opt)
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state}
    codebooks = [None if c.codebook is None else c.codebook.clone() for c in _gefens(opt)]
    return [p.detach().clone() for p in params], state, codebooks, [c.global_step for c in _gefens(opt)]


def _assert_unchanged(opt: torch.optim.Optimizer, snap: tuple[Any, ...]) -> None:
    values, state, codebooks, global_steps = snap
    params = _params(opt)
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    assert {id(p) for p in params if p in opt.state} == set(state)
    for p in params:
        if p in opt.state:
            for k, v in state[id(p)].items():
                assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), k
    for c, codebook in zip(_gefens(opt), codebooks):
        assert (c.codebook is None) == (codebook is None)
        if codebook is not None:
            assert torch.equal(c.codebook, codebook)
    assert [c.global_step for c in _gefens(opt)] == global_steps


@pytest.mark.parametrize("kind", ["gefen", "muon"])  # the hybrid makes its own groups (see CallerGroups)
def test_named_parameters_and_caller_groups_are_kept(kind):
    rules = CALLER_GROUPS[kind]
    model = _model(THREE)
    named = _held(kind, model)
    key, value = rules.option
    opt = rules.make(
        [{"params": named[:2], "lr": 1e-2}, {"params": named[2:], "weight_decay": 0.1, key: value}], lr=1e-3
    )
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["param_names"] == [n for n, _ in named[:2]]
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == rules.defaults["weight_decay"]
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1][key] == value
    _backward(model, 0)
    opt.step()
    assert [r["name"] for r in opt.state_report()] == [n for n, _ in named]


@pytest.mark.parametrize("kind", KINDS)
def test_per_group_lr_zero_freezes_that_group(kind):
    model = _model(THREE)
    opt = TWO_GROUPS[kind](model, first_lr=0.0)
    assert opt.param_groups[0]["lr"] == 0.0
    frozen = list(opt.param_groups[0]["params"])
    others = [p for g in opt.param_groups[1:] for p in g["params"]]
    before = [p.detach().clone() for p in frozen + others]
    _backward(model, 0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(frozen, before))
    assert others and not any(torch.equal(p, b) for p, b in zip(others, before[len(frozen) :]))


@pytest.mark.parametrize("kind", ["gefen", "muon"])  # the hybrid routes an added group to a half: test_muon.py
def test_add_param_group_steps_new_params_and_is_all_or_nothing(kind):
    rules = CALLER_GROUPS[kind]
    model = _model(THREE)
    params = [p for _, p in _held(kind, model)]
    opt = rules.make(params[:2], lr=1e-2)
    key, bad = rules.bad_option
    with pytest.raises(ConfigError, match=key):
        opt.add_param_group({"params": params[2:], key: bad})
    with pytest.raises(ConfigError, match="same parameter twice"):
        opt.add_param_group({"params": [params[2], params[2]]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params[2:], "lr": 5e-3})
    assert opt.param_groups[1]["lr"] == 5e-3 and opt.param_groups[1]["eps"] == rules.defaults["eps"]
    before = params[-1].detach().clone()
    _backward(model, 0)
    opt.step()
    assert not torch.equal(params[-1], before)


@pytest.mark.parametrize("kind", KINDS)
def test_lr_scheduler_drives_group_lr(kind):
    model = _model()
    opt = _build(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for s in range(3):
        opt.zero_grad()
        _backward(model, s)
        opt.step()
        sched.step()
    assert all(math.isclose(g["lr"], 1e-2 * 0.125) for g in opt.param_groups)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_lr_equals_float_lr(kind):
    results = []
    for lr in (float(torch.tensor(3e-3)), torch.tensor(3e-3)):  # same fp32 value
        model = _model(THREE)
        opt = TWO_GROUPS[kind](model, lr=lr)
        _train(model, opt, range(3))
        ours = {id(p) for c in _gefens(opt) for g in c.param_groups for p in g["params"]}
        results.append([(id(p) in ours, p.detach().clone()) for p in model.parameters()])
    for (ours, a), (_, b) in zip(*results):
        if ours:
            assert torch.equal(a, b)
        else:  # torch's own AdamW (a hybrid's backup) rounds a tensor lr's arithmetic otherwise: a few ulps apart
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_closure_runs_before_anything_else(kind):
    model = _model()
    opt = _build(kind, model)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)  # no gradients exist before the closure: step 1 must still learn and update
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert all(c.codebook is not None and c.global_step == 1 for c in _gefens(opt))
    assert all(int(opt.state[p][STEP]) == 1 for p in _params(opt))


@pytest.mark.parametrize("kind", KINDS)
def test_zero_grad_sets_none_and_step_without_grads_is_a_no_op(kind):
    model = _model()
    opt = _build(kind, model, weight_decay=0.1)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in _params(opt))
    snap = _snapshot(opt)
    opt.step()
    _assert_unchanged(opt, snap)


@pytest.mark.parametrize("kind", KINDS)
def test_param_without_grad_untouched_and_late_param_starts_own_warmup(kind):
    model = _model(THREE)
    opt = _build(kind, model, weight_decay=0.1)
    late = _gefens(opt)[-1].param_groups[-1]["params"][-1]  # the last parameter Gefen (or GefenMuon) steps
    first = _params(opt)[0]
    for s in range(3):
        opt.zero_grad()
        _backward(model, s)
        late_before = late.detach().clone()
        late.grad = None
        opt.step()
        assert torch.equal(late, late_before)  # no update, no weight decay
    assert late not in opt.state
    codebooks = [c.codebook.clone() for c in _gefens(opt)]
    opt.zero_grad()
    _backward(model, 5)
    opt.step()
    assert int(opt.state[late][STEP]) == 1 and int(opt.state[first][STEP]) == 4
    assert PERIOD in opt.state[late]
    assert all(torch.equal(c.codebook, codebook) for c, codebook in zip(_gefens(opt), codebooks))  # frozen


@pytest.mark.parametrize("kind", KINDS)
def test_zero_numel_params_are_skipped(kind):
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = _build_named(kind, [("empty", empty), ("w", w)])
    empty.grad = torch.zeros(0, 4)
    w.grad = torch.randn(8, 8)
    opt.step()
    assert empty not in opt.state and w in opt.state


#: State entries held in float32 whatever the parameter's dtype (besides the uint8 codes).
FLOAT32_STATE = {"gefen": ("first_moment_scale", "second_moment_row"), "muon": ("first_moment_scale",)}


# the hybrid holds a matrix in its GefenMuon half and vectors in a Gefen (or torch's AdamW) backup: the cases here
@pytest.mark.parametrize("kind", ["gefen", "muon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_param_dtype_is_written_in_its_own_dtype(kind, dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32, dtype=dtype))
    before = w.detach().clone()
    opt = CALLER_GROUPS[kind].make([w], lr=1e-2)
    for s in range(2):
        w.grad = torch.randn(16, 32, generator=torch.Generator().manual_seed(s)).to(dtype)
        opt.step()
    assert w.dtype == dtype and torch.isfinite(w).all() and not torch.equal(w, before)
    st = opt.state[w]
    assert st["first_moment_codes"].dtype == torch.uint8
    assert all(st[k].dtype == torch.float32 for k in FLOAT32_STATE[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first_step", [True, False])
def test_refused_steps_change_nothing(kind, first_step):
    """(The fault catalogue runs many more such faults, each on the first step and after two.)"""
    model = _model(THREE)
    opt = _build(kind, model, weight_decay=0.1)
    _train(model, opt, range(0 if first_step else 2))
    opt.zero_grad()
    _backward(model, 99)
    params = _params(opt)
    snap = _snapshot(opt)

    params[2].grad = params[2].grad.to_sparse()  # sparse gradient on a later param
    with pytest.raises(StepError, match="layout"):
        opt.step()
    _assert_unchanged(opt, snap)
    params[2].grad = params[2].grad.to_dense()

    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ConfigError, match="lr"):
        opt.step()
    _assert_unchanged(opt, snap)
    opt.param_groups[0]["lr"] = 1e-2

    last = params[-1]
    saved = last.data
    last.data = torch.zeros(7, *saved.shape[1:])  # a wrapper swapped the tensor: grad shape no longer matches
    with pytest.raises(StepError, match="shape"):
        opt.step()
    last.data = saved
    _assert_unchanged(opt, snap)


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_first_gradient_is_refused_before_learning(kind):
    """Even where later NaN steps propagate, a first gradient must be finite (its period and the codebook)."""
    model = _model()
    opt = _build(kind, model, nonfinite="propagate")
    _backward(model, 0)
    params = _params(opt)
    params[1].grad[0] = float("nan")
    snap = _snapshot(opt)
    with pytest.raises(StepError, match="NaN/Inf"):
        opt.step()
    _assert_unchanged(opt, snap)
    assert all(c.codebook is None for c in _gefens(opt))


@pytest.mark.parametrize("kind", KINDS)
def test_step_under_inference_mode_is_refused_before_any_change(kind):
    model = _model()
    opt = _build(kind, model)
    _backward(model, 0)
    with torch.inference_mode(), pytest.raises(StepError, match="inference_mode"):
        opt.step()
    assert all(c.codebook is None for c in _gefens(opt)) and all(len(c.state) == 0 for c in _children(opt))
    opt.step()  # and a normal step afterwards works
    assert all(c.global_step == 1 for c in _gefens(opt))


@pytest.mark.parametrize("kind", KINDS)
def test_reading_state_before_the_first_step_is_harmless(kind):
    model_a, model_b = _model(), _model()
    opt_a, opt_b = _build(kind, model_a), _build(kind, model_b)
    for p in _params(opt_a):
        assert opt_a.state[p] == {}  # defaultdict read creates an empty entry, as in torch.optim
    _train(model_a, opt_a, range(3))
    _train(model_b, opt_b, range(3))
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    opt_a.load_state_dict(opt_a.state_dict())  # its own checkpoint still loads


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_deepcopy_and_pickle_give_a_working_optimizer(kind, how):
    model = _model()
    opt = _build(kind, model)
    _train(model, opt, range(2))
    bundle = (model, opt)
    model2, opt2 = copy.deepcopy(bundle) if how == "deepcopy" else pickle.loads(pickle.dumps(bundle))
    assert all(torch.equal(b.codebook, a.codebook) and b.global_step == 2 for a, b in zip(_gefens(opt), _gefens(opt2)))
    _train(model, opt, range(5, 7))
    _train(model2, opt2, range(5, 7))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert TOP_KEY[kind] in opt2.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_with_hooks_and_a_scheduler_pickles_without_them(kind):
    model = _model()
    opt = _build(kind, model)
    opt.register_step_post_hook(lambda o, a, k: None)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5)
    _backward(model, 0)
    opt.step()
    clone = pickle.loads(pickle.dumps(opt))
    assert not clone._optimizer_step_post_hooks
    assert digest(clone.state_dict()) == digest(opt.state_dict())
