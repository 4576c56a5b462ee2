"""Generate the hybrid fixtures of the "halves" layout under tests/fixtures/ (run once, with the code before the
hybrid moved to torch.optim's layout: ``git checkout 3f8f16b``).

That layout was ``{"muon": <GefenMuon state dict>, "backup": <Gefen/AdamW state dict>, "backup_optimizer": str,
"deterministic": bool, "skipped_steps": int}``. Each fixture holds the same content as ``make_v1_fixtures.py``'s:
the parameters, the state dict after two steps, the gradient of a third step and the parameters the old code
produced after it, so the migration test checks continuation against values of the old code.
"""

import copy
import sys
from pathlib import Path

import torch

import gefen
from gefen.checkpoint import HYBRID_KEYS

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return m(torch.randint(0, 32, (8, 4), generator=g)).square().mean()


def main() -> None:
    for backup in ("gefen", "adamw"):
        m = model()
        opt = gefen.GefenMuonHybrid(m, lr=1e-2, backup_optimizer=backup, fused=False)
        for step in range(2):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        sd = copy.deepcopy(opt.state_dict())
        assert HYBRID_KEYS <= set(sd), "run this with the halves-layout code"
        opt.zero_grad()
        loss_of(m, 2).backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        after = {n: p.detach().clone() for n, p in m.named_parameters()}
        path = OUT / f"halves_hybrid_{backup}.pt"
        torch.save({"params": params, "optimizer": sd, "grads": grads, "expected_after": after}, path)
        print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
