"""Generate the schema-v1 checkpoint fixtures under tests/fixtures/ (run once, with gefen at schema 1).

Each fixture holds a small model's parameters, the optimizer state dict after two steps, the gradient of a third
step and the parameters the v1 code produced after that third step, so a migration test checks bit-exact
continuation against values computed by the old code, not by the code under test.
"""

import copy
import sys
from pathlib import Path

import torch

import gefen
from gefen.checkpoint import SCHEMA_VERSION

assert SCHEMA_VERSION == 1, "run this with the schema-1 code (git checkout 3b57a7b)"
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (8, 4), generator=g)


def build(kind: str, m: torch.nn.Module):
    if kind == "gefen":
        return gefen.Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.01, fused=False)
    if kind == "gefen_block":
        return gefen.Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.0, factored_v_2d=False, fused=False)
    if kind == "gefen_muon":
        return gefen.GefenMuon(
            [(n, p) for n, p in m.named_parameters() if p.dim() == 2 and n.startswith("1")], lr=1e-2, fused=False
        )
    if kind == "hybrid_gefen":
        return gefen.GefenMuonHybrid(m, lr=1e-2, backup_optimizer="gefen")
    if kind == "hybrid_adamw":
        return gefen.GefenMuonHybrid(m, lr=1e-2, backup_optimizer="adamw")
    raise ValueError(kind)


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    return m(batch(step)).square().mean()


def main() -> None:
    for kind in ("gefen", "gefen_block", "gefen_muon", "hybrid_gefen", "hybrid_adamw"):
        m = model()
        opt = build(kind, m)
        for step in range(2):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
        opt.zero_grad()
        loss_of(m, 2).backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        after = {n: p.detach().clone() for n, p in m.named_parameters()}
        torch.save(
            {"kind": kind, "params": params, "optimizer": sd, "grads": grads, "expected_after": after},
            OUT / f"v1_{kind}.pt",
        )
        print("wrote", OUT / f"v1_{kind}.pt", file=sys.stderr)


if __name__ == "__main__":
    main()
