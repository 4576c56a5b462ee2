"""A fixed training job whose SHA-256 digest (parameters, optimizer state, codebooks) is compared across runs and
processes by ``test_determinism.py``. Run as ``python -m tests.optim.determinism_job KIND FUSED``; prints the digest."""

from __future__ import annotations

import sys

import torch

import gefen
from gefen.digest import state_digest


def digest(obj: object) -> str:
    """SHA-256 of a nested state: :func:`gefen.digest.state_digest`."""
    return state_digest(obj)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)
    )


def build(kind: str, m: torch.nn.Module, backend: str) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(m.named_parameters(), lr=3e-3, weight_decay=0.01, backend=backend, deterministic=True)
    if kind == "gefen_muon":
        hidden = [(n, p) for n, p in m.named_parameters() if p.dim() == 2 and not n.startswith("0.")]
        return gefen.GefenMuon(hidden, lr=3e-3, normuon=True, backend=backend, deterministic=True)
    return gefen.GefenMuonHybrid(m, lr=3e-3, backend=backend, deterministic=True)


def run(kind: str, backend: str, steps: int = 3) -> str:
    """Train ``steps`` steps from a fixed seed (the first one learns periods and the codebook); the digest."""
    m = model()
    opt = build(kind, m, backend)
    for s in range(steps):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(s))
        loss = torch.nn.functional.cross_entropy(m(tokens).reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    children = [opt.muon, opt.backup] if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    return digest([m.state_dict(), opt.state_dict(), [getattr(c, "codebook", None) for c in children]])


if __name__ == "__main__":
    print(run(sys.argv[1], sys.argv[2]))
