"""FSDP2 (``fully_shard``) parameters are DTensors. Until sharded stepping lands (issue 6), every Gefen optimizer
refuses them at construction with a clear error on every rank, instead of failing inside ``step()``."""

from __future__ import annotations

import pytest
import torch

import gefen
from tests.distributed.harness import run_world

pytestmark = pytest.mark.timeout(300)


def _fsdp2_job(rank: int, world_size: int, kind: str) -> str:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 16))
    fully_shard(model)
    try:
        if kind == "gefen":
            gefen.Gefen(model.named_parameters(), fused=False)
        elif kind == "gefen_muon":
            gefen.GefenMuon([(n, p) for n, p in model.named_parameters() if n.startswith("1.w")], fused=False)
        else:
            gefen.GefenMuonHybrid(model, lr=1e-3, fused=False)
    except gefen.ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "gefen_muon", "hybrid"])
def test_fsdp2_parameters_are_refused_clearly_on_every_rank(kind):
    messages = run_world(_fsdp2_job, 2, kind)
    assert all("is a DTensor (FSDP2 fully_shard" in m for m in messages), messages
