"""torch.optim's loading conventions (issue 15): parameter names never block a load (case 006), what torch's
ecosystem adds to live param groups (an LR scheduler's ``initial_lr``) does not make a checkpoint "edited", and
``torch.distributed.checkpoint``'s flattened layout round-trips (case 007; the process-group variant is in
``tests/distributed/test_dcp.py``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gefen
from gefen import CheckpointError
from tests.optim.test_resume_matrix import _roundtrip

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))


def _build(kind: str, named, **options) -> torch.optim.Optimizer:
    named = list(named)
    if kind == "gefen":
        return gefen.Gefen(named, lr=1e-2, **options)
    if kind == "muon":
        return gefen.GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gefen.GefenMuonHybrid(named, lr=1e-2, backup_optimizer=kind.split("_")[1], **options)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.parametrize("prefix", ["_orig_mod.", "module."])
@pytest.mark.parametrize("kind", KINDS)
def test_names_of_a_wrapper_do_not_block_a_load_case_006(kind, prefix):
    """Saved through a torch.compile / DDP wrapper (prefixed names), loaded into the bare model, and the other way
    round: the load goes by position as torch's does and the run continues bit for bit."""
    model = _model()
    opt = _build(kind, [(prefix + n, p) for n, p in model.named_parameters()])
    _train(model, opt, range(2))
    saved = _roundtrip(opt.state_dict())
    straight = copy.deepcopy(model)
    straight_opt = _build(kind, [(prefix + n, p) for n, p in straight.named_parameters()])
    straight_opt.load_state_dict(copy.deepcopy(saved))
    _train(straight, straight_opt, range(2, 4))
    for names in ("bare", "prefixed twice"):
        resumed = copy.deepcopy(model)
        named = resumed.named_parameters()
        fresh = _build(kind, named if names == "bare" else [(prefix + prefix + n, p) for n, p in named])
        fresh.load_state_dict(copy.deepcopy(saved))
        _train(resumed, fresh, range(2, 4))
        assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters())), names
        # Gefen halves keep the live names (torch's AdamW keeps the saved ones)
        parts = fresh._children() if isinstance(fresh, gefen.GefenMuonHybrid) else [fresh]
        live = [n for o in parts if isinstance(o, gefen.Gefen) for g in o.param_groups for n in g["param_names"]]
        assert live and all(n.startswith(prefix + prefix) for n in live) == (names != "bare")


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.parametrize("kind", ["gefen", "muon", "hybrid_gefen"])
def test_a_scheduler_made_before_the_load_does_not_make_the_checkpoint_edited(kind):
    """Trainer's order: optimizer, then LR scheduler (which writes ``initial_lr`` into the live groups), then the
    checkpoint (saved without a scheduler) is loaded: it loads, saved values win, the scheduler keeps working."""
    model = _model()
    opt = _build(kind, model.named_parameters())
    _train(model, opt, range(2))
    saved = _roundtrip(opt.state_dict())
    fresh = _build(kind, copy.deepcopy(model).named_parameters(), weight_decay=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.5**step)
    assert all("initial_lr" in g for g in fresh.param_groups)
    fresh.load_state_dict(saved)
    assert all(g["initial_lr"] == 1e-2 for g in fresh.param_groups)  # the live key is kept
    assert all(g["weight_decay"] != 0.5 for g in fresh.param_groups)  # the saved value wins
    scheduler.step()
    assert all(g["lr"] == pytest.approx(5e-3) for g in fresh.param_groups)


def test_a_missing_hyperparameter_of_ours_is_still_refused():
    model = _model()
    opt = _build("gefen", model.named_parameters())
    _train(model, opt, range(1))
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["eps"]
    with pytest.raises(CheckpointError, match=r"lacks the hyperparameters \['eps'\]"):
        _build("gefen", _model().named_parameters()).load_state_dict(saved)


def _flat(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kw)


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_dcp_flattened_layout_round_trips_bit_exactly_case_007(kind):
    """torchtitan's layout: ``get``/``set_optimizer_state_dict(flatten_optimizer_state_dict=True)`` with the
    optimizer itself (the hybrid too), into a template that already holds state, with no process group: the
    continuation equals the uninterrupted run bit for bit, counters and codebooks included."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _model()
    opt = _build(kind, model.named_parameters())
    _train(model, opt, range(3))
    flat = get_optimizer_state_dict(model, opt, options=_flat())
    assert all(k.startswith(("state.", "param_groups.")) for k in flat)
    resumed = copy.deepcopy(model)
    template = _build(kind, resumed.named_parameters())
    _train(resumed, template, range(50, 51))  # different state, and different weights until the model loads
    resumed.load_state_dict(model.state_dict())
    set_optimizer_state_dict(resumed, template, copy.deepcopy(flat), options=_flat())
    parts = opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    loaded = template._children() if isinstance(template, gefen.GefenMuonHybrid) else [template]
    for a, b in zip(parts, loaded):
        if isinstance(a, gefen.Gefen):
            assert b.global_step == a.global_step == 3
            assert torch.equal(b.codebook, a.codebook)
    assert all(g.get("gefen_metadata") is None for g in template.param_groups)  # the live stand-in is kept
    _train(model, opt, range(3, 5))
    _train(resumed, template, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.parametrize("kind", ["gefen", "hybrid_adamw"])
def test_dcp_flattened_layout_into_a_fresh_optimizer_is_refused_clearly(kind):
    """A fresh Gefen optimizer holds no state keys, so the flattened layout's rebuild reads none of the saved
    state (torch's AdamW gets its keys from the helpers' zero-gradient step): refused, naming the fix, with the
    optimizer unchanged."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _model()
    opt = _build(kind, model.named_parameters())
    _train(model, opt, range(3))
    flat = get_optimizer_state_dict(model, opt, options=_flat())
    resumed = copy.deepcopy(model)
    fresh = _build(kind, resumed.named_parameters())
    before = fresh.state_dict()
    with pytest.raises(CheckpointError, match=r"is empty.*flatten_optimizer_state_dict=False"):
        set_optimizer_state_dict(resumed, fresh, flat, options=_flat())
    after = fresh.state_dict()
    # (the rebuild's reads of the live defaultdict leave empty entries, as for any torch optimizer; an AdamW backup
    # got its state from the helpers' zero-gradient step, before the load)
    parts = fresh._children() if isinstance(fresh, gefen.GefenMuonHybrid) else [fresh]
    assert not any(o.state[p] for o in parts if isinstance(o, gefen.Gefen) for g in o.param_groups for p in g["params"])
    assert after["param_groups"] == before["param_groups"]


@pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_dcp_flattened_layout_with_a_parameter_that_never_had_a_gradient(kind):
    """An unused layer has no state in the checkpoint nor in the template: its entry comes back empty, which the
    checkpoint's count of parameters with state tells apart from lost state; the round trip is exact."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def train(model, opt, steps):
        for s in steps:
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            model[2](model[1](model[0](x))).square().mean().backward()
            opt.step()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4)
    )  # model[3] never gets a gradient
    opt = _build(kind, model.named_parameters())
    train(model, opt, range(3))
    flat = get_optimizer_state_dict(model, opt, options=_flat())
    resumed = copy.deepcopy(model)
    template = _build(kind, resumed.named_parameters())
    train(resumed, template, range(50, 51))
    resumed.load_state_dict(model.state_dict())
    set_optimizer_state_dict(resumed, template, copy.deepcopy(flat), options=_flat())
    train(model, opt, range(3, 5))
    train(resumed, template, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))
    template.load_state_dict(template.state_dict())  # and its own dict still loads
