"""Checkpoints of sharded optimizers through ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (full state, gathered to rank 0's CPU), for Gefen, GefenMuon and the hybrid (passed to
the helpers as itself: its state dict is in torch.optim's layout).

* Same world size (2 → 2): the resumed run equals the uninterrupted one bit for bit, although the fresh optimizer
  goes through the helpers' hidden zero-gradient ``step()`` (which must learn nothing).
* Resharding 2 → 3 and 2 → 1: each rank keeps its rows of the rank-independent state (``gefen.sharding``), so the
  continuation is the same training run; the loss after 20 more steps is within 1 % of the uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch

import gefen
from tests.distributed.harness import run_world
from tests.distributed.test_fsdp2 import build, full_params, model_fn, train

pytestmark = pytest.mark.timeout(300)

BEFORE = 4


def _gefen_parts(opt: torch.optim.Optimizer) -> list[gefen.Gefen]:
    """The Gefen optimizers inside ``opt`` (a hybrid's Gefen halves), for their global steps."""
    parts = opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    return [o for o in parts if isinstance(o, gefen.Gefen)]


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _save_job(rank: int, world: int, kind: str, path: str, more: int) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = model_fn(True)
    fully_shard(model)
    opt = build(kind, model)
    train(model, opt, range(BEFORE), learnable=True)
    msd = get_model_state_dict(model, options=_options(cpu_offload=True))
    osd = get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, path)
    losses = train(model, opt, range(BEFORE, BEFORE + more), learnable=True)
    return {"losses": losses, "params": full_params(model)}


def _load_job(rank: int, world: int, kind: str, path: str, more: int) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = model_fn(True)
    fully_shard(model)
    opt = build(kind, model)
    ckpt = torch.load(path, weights_only=True)
    set_model_state_dict(model, ckpt["model"], options=_options())
    before = full_params(model)
    set_optimizer_state_dict(model, opt, ckpt["optim"], options=_options())
    unchanged = all(torch.equal(before[n], v) for n, v in full_params(model).items())
    losses = train(model, opt, range(BEFORE, BEFORE + more), learnable=True)
    steps = [o.global_step for o in _gefen_parts(opt)]
    return {"losses": losses, "params": full_params(model), "unchanged": unchanged, "steps": steps}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "muon_exact", "hybrid_gefen", "hybrid_adamw"])
def test_same_world_resume_is_bit_exact(kind, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = run_world(_save_job, 2, kind, path, 3)[0]
    resumed = run_world(_load_job, 2, kind, path, 3)
    for r in resumed:
        assert r["unchanged"], "loading (with the helpers' hidden step) changed the parameters"
        assert r["steps"] and all(s == BEFORE + 3 for s in r["steps"])
        assert r["losses"] == straight["losses"]
        for name, value in straight["params"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "muon_distributed", "hybrid_gefen"])
def test_reshard_two_to_three_and_one_continues_the_run(kind, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = run_world(_save_job, 2, kind, path, 20)[0]
    for world in (3, 1):
        resumed = run_world(_load_job, world, kind, path, 20)
        for r in resumed:
            assert abs(r["losses"][-1] - straight["losses"][-1]) <= 0.01 * straight["losses"][-1], (world, r["losses"])
            assert r["losses"][-1] < 0.9 * r["losses"][0]


def _plain_model() -> torch.nn.Module:
    """Unsharded: Linear, LayerNorm, Linear, plus a projection used only under ``no_grad`` (never a gradient)."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "body": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 12)),
            "frozen_use": torch.nn.Linear(12, 12, bias=False),
        }
    )


def _plain_build(kind: str, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    named = list(model.named_parameters())
    if kind == "gefen":
        return (gefen.Gefen(named, lr=1e-2, weight_decay=0.01),)
    if kind == "muon":
        return (gefen.GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2),)
    return (gefen.GefenMuonHybrid(named, lr=1e-2, backup_optimizer=kind.split("_")[1]),)


def _plain_train(model: torch.nn.Module, opts: tuple[torch.optim.Optimizer, ...], steps: range) -> None:
    for s in steps:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s))
        out = model["body"](x)
        with torch.no_grad():
            extra = model["frozen_use"](out)
        (out + extra).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _full_state_one_process_job(rank: int, world: int, kind: str) -> dict[str, object]:
    """Case 003: a full state from the helpers, through torch.save/torch.load, into a freshly built optimizer in a
    one-process group, with and without ``broadcast_from_rank0``; the resumed run must equal the straight one."""
    import copy
    import io

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _plain_model()
    opts = _plain_build(kind, model)
    _plain_train(model, opts, range(3))
    osd = get_optimizer_state_dict(model, opts, options=_options())
    buffer = io.BytesIO()
    torch.save(osd, buffer)
    straight_model = copy.deepcopy(model)
    straight_opts = _plain_build(kind, straight_model)
    for o, src in zip(straight_opts, opts):
        o.load_state_dict(src.state_dict())
    _plain_train(straight_model, straight_opts, range(3, 6))
    out: dict[str, object] = {}
    for label, broadcast in (("broadcast_from_rank0", True), ("full_state_dict", False)):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        resumed = copy.deepcopy(model)
        fresh = _plain_build(kind, resumed)
        set_optimizer_state_dict(resumed, fresh, saved, options=_options(broadcast_from_rank0=broadcast))
        _plain_train(resumed, fresh, range(3, 6))
        out[label] = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight_model.parameters())) and all(
            o.global_step == s.global_step
            for a, b in zip(fresh, straight_opts)
            for o, s in zip(_gefen_parts(a), _gefen_parts(b))
        )
    return out


@pytest.mark.parametrize("kind", ["gefen", "muon", "hybrid_gefen", "hybrid_adamw"])
def test_full_state_into_a_fresh_optimizer_in_one_process_case_003(kind):
    result = run_world(_full_state_one_process_job, 1, kind)[0]
    assert result == {"broadcast_from_rank0": True, "full_state_dict": True}


def _flattened_job(rank: int, world: int, kind: str) -> dict[str, object]:
    """Case 007 under FSDP2: the flattened layout (torchtitan's default), sharded, kept in memory, set into a
    template that already holds state; both runs then continue."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = model_fn(True)
    fully_shard(model)
    opt = build(kind, model)
    train(model, opt, range(BEFORE), learnable=True)
    osd = get_optimizer_state_dict(model, opt, options=flat)
    msd = copy.deepcopy(get_model_state_dict(model))
    resumed = model_fn(True)
    fully_shard(resumed)
    template = build(kind, resumed)
    train(resumed, template, range(100, 101), learnable=True)
    set_model_state_dict(resumed, msd)
    set_optimizer_state_dict(resumed, template, osd, options=flat)
    steps = [o.global_step for o in _gefen_parts(template)]
    train(model, opt, range(BEFORE, BEFORE + 2), learnable=True)
    train(resumed, template, range(BEFORE, BEFORE + 2), learnable=True)
    same = all(torch.equal(a, b) for a, b in zip(full_params(model).values(), full_params(resumed).values()))
    return {"same": same, "steps": steps}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "hybrid_adamw"])
def test_flattened_layout_round_trips_under_fsdp2_case_007(kind):
    for r in run_world(_flattened_job, 2, kind):
        assert r["steps"] and all(s == BEFORE for s in r["steps"])
        assert r["same"]
