"""Checkpoints of sharded optimizers through ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (full state, gathered to rank 0's CPU), for Gefen, GefenMuon and the hybrid.

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


def _optimizers(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, ...]:
    return (opt.muon, opt.backup) if isinstance(opt, gefen.GefenMuonHybrid) else (opt,)


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
    osd = get_optimizer_state_dict(model, _optimizers(opt), options=_options(cpu_offload=True))
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
    set_optimizer_state_dict(model, _optimizers(opt), ckpt["optim"], options=_options())
    unchanged = all(torch.equal(before[n], v) for n, v in full_params(model).items())
    losses = train(model, opt, range(BEFORE, BEFORE + more), learnable=True)
    steps = [o.global_step for o in _optimizers(opt) if isinstance(o, gefen.Gefen)]
    return {"losses": losses, "params": full_params(model), "unchanged": unchanged, "steps": steps}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "muon_exact", "hybrid_gefen", "hybrid_adamw"])
def test_same_world_resume_is_bit_exact(kind, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = run_world(_save_job, 2, kind, path, 3)[0]
    resumed = run_world(_load_job, 2, kind, path, 3)
    for r in resumed:
        assert r["unchanged"], "loading (with the helpers' hidden step) changed the parameters"
        assert all(s == BEFORE + 3 for s in r["steps"])
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
