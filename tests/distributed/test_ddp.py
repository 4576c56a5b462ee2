"""DDP (gloo, CPU): every rank steps its replica with the all-reduced gradients; with ``deterministic=True`` the
replicas stay bit-identical (parameters, optimizer state, codebook), first step included (hardening.md §5.1)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import gefen
from tests.distributed.harness import run_torchrun, run_world
from tests.optim.determinism_job import digest

pytestmark = pytest.mark.timeout(300)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)
    )


def _build(kind: str, model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "gefen":
        return gefen.Gefen(named, lr=3e-3, weight_decay=0.01, deterministic=True, fused=fused)
    if kind == "gefen_muon":
        hidden = [(n, p) for n, p in named if p.dim() == 2 and not n.startswith("0.")]
        return gefen.GefenMuon(hidden, lr=3e-3, normuon=True, deterministic=True, fused=fused)
    backup = kind.split("_")[1]
    return gefen.GefenMuonHybrid(model, lr=3e-3, backup_optimizer=backup, deterministic=True, fused=fused)


def _ddp_job(rank: int, world_size: int, kind: str, fused: bool) -> dict[str, object]:
    model = _model()
    start = digest(model.state_dict())
    ddp = DistributedDataParallel(model)
    opt = _build(kind, model, fused)
    for s in range(3):  # each rank its own batch: different local gradients, identical all-reduced ones
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(100 * s + rank))
        logits = ddp(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    children = [opt.muon, opt.backup] if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    return {
        "start": start,
        "params": digest(model.state_dict()),
        "optimizer": digest(opt.state_dict()),
        "codebooks": digest([getattr(c, "codebook", None) for c in children]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "gefen_muon", "hybrid_gefen", "hybrid_adamw"])
def test_ddp_replicas_stay_bit_identical_with_deterministic(kind):
    rank0, rank1 = run_world(_ddp_job, 2, kind, False)
    assert rank0 == rank1
    assert rank0["params"] != rank0["start"]  # it trained


@pytest.mark.slow
def test_ddp_replicas_stay_bit_identical_on_the_compiled_path():
    rank0, rank1 = run_world(_ddp_job, 2, "gefen", True, timeout_s=240)
    assert rank0 == rank1
    assert rank0["params"] != rank0["start"]


def _no_ddp_job(rank: int, world_size: int) -> str:
    model = _model()
    opt = _build("gefen", model, False)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
    model(tokens).square().mean().backward()
    opt.step()
    return digest([model.state_dict(), opt.state_dict()])


@pytest.mark.slow
def test_without_ddp_the_replicas_differ():
    """The control: the digests do see rank-local gradients."""
    rank0, rank1 = run_world(_no_ddp_job, 2)
    assert rank0 != rank1


@pytest.mark.slow
def test_ddp_example_runs_with_torchrun(tmp_path):
    """``examples/ddp_train.py`` as the README runs it: 2 ranks, replicas identical, loss falls, checkpoint loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ckpt = tmp_path / "opt.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    stdout = run_torchrun(root / "examples" / "ddp_train.py", 2, "--steps", "30", "--save", str(ckpt))
    assert "replicas bit-identical across 2 ranks: True" in stdout
    losses = [float(line.split("loss")[1]) for line in stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < 0.5 * losses[0]
    report = subprocess.run(
        [sys.executable, "-m", "gefen", "inspect", str(ckpt)], env=env, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0 and "deterministic:     True" in report.stdout
