"""``GefenMuonHybrid.state_bytes()`` and ``state_report()``: both halves, every parameter once (issue 38)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gefen
from gefen.cli._optimizers import state_bytes as demo_state_bytes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: routing of the model below (algorithm.md §8.1): hidden 2-D weights to Muon, embedding and biases to the backup
MUON = {"1.weight": (32, 16), "2.weight": (16, 32)}
BACKUP = {"0.weight": (32, 16), "1.bias": (32,), "2.bias": (16,)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32), nn.Linear(32, 16))


def _stepped(backup: str) -> tuple[nn.Module, gefen.GefenMuonHybrid]:
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, backend="eager")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_state_bytes_is_the_sum_of_its_halves(backup: str) -> None:
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, backend="eager")
    assert opt.state_bytes() == 0  # no state before the first step
    _, opt = _stepped(backup)
    muon_bytes = opt.muon.state_bytes()  # GefenMuon's own accounting (codebook included)
    assert muon_bytes > 0
    if backup == "adamw":
        # torch AdamW: exp_avg and exp_avg_sq of the parameter's fp32 size, plus a 0-dim fp32 step
        backup_bytes = sum(2 * 4 * _numel(shape) + 4 for shape in BACKUP.values())
    else:
        backup_bytes = opt.backup.state_bytes()
    assert opt.state_bytes() == muon_bytes + backup_bytes
    assert demo_state_bytes(opt) == opt.state_bytes()  # the demo measures the hybrid through it


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_state_report_covers_every_parameter_once(backup: str) -> None:
    model, opt = _stepped(backup)
    rows = opt.state_report()
    assert [r["name"] for r in rows] == list(MUON) + list(BACKUP)  # param_groups order: Muon's group first
    assert {r["name"]: r["half"] for r in rows} == {**dict.fromkeys(MUON, "muon"), **dict.fromkeys(BACKUP, "backup")}
    keys = set(opt.muon.state_report()[0]) | {"half"}
    for row in rows:
        assert set(row) == keys
        assert row["shape"] == {**MUON, **BACKUP}[row["name"]] and row["numel"] == _numel(row["shape"])
    codebooks = 256 * 4 * (1 + (backup == "gefen"))  # one fp32 (256,) codebook per Gefen half
    assert sum(r["state_bytes"] for r in rows) + codebooks == opt.state_bytes()
    for row in rows:
        if row["half"] == "muon":
            assert row["second_moment"] == "momentum" and row["period"] is not None
        elif backup == "adamw":
            assert row["period"] is None and row["layout"] is None and row["backend"] == "torch"
            assert row["state_bytes"] == 2 * 4 * row["numel"] + 4
            assert row["second_moment"] == "elementwise (torch AdamW)"
        else:
            assert row["second_moment"] == "block" and row["period"] is not None


def test_hybrid_state_report_before_a_step_and_without_names() -> None:
    model = _model()
    opt = gefen.GefenMuonHybrid(list(model.parameters()), lr=1e-2, backup_optimizer="adamw", backend="eager")
    rows = opt.state_report()
    assert len(rows) == 5 and len({r["name"] for r in rows}) == 5
    assert all(r["state_bytes"] == 0 and r["backend"] is None and r["second_moment"] is None for r in rows)
    assert all(r["name"].startswith("param_groups[") for r in rows)
