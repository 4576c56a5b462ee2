"""Generate the hybrid fixtures of torch's layout, schema 1, under tests/fixtures/ (run once, with the code before
the hybrid's ``param_groups`` became a list in torch's order: ``git archive 50b824b src`` into a scratch folder and
run this with ``PYTHONPATH`` pointing at it).

Schema 1 wrote the groups half by half (every Muon group, then every backup group), whatever order
``add_param_group`` had been called in. Here groups are added after the first step (a Muon matrix, then a backup
bias, each with its own lr), so the saved order (Muon, Muon, backup, backup) differs from the order of the calls
(Muon, backup, Muon, backup), which is the list order of today's hybrid. Each fixture holds the parameters, the state
dict after two steps, the gradient of a third step and the parameters the old code produced after it, so the test
checks continuation against values of the old code.
"""

import copy
import sys
from pathlib import Path

import torch

import gefen

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


class Model(torch.nn.Module):
    """An embedding, a hidden matrix and a head; an extra matrix and bias joined by ``add_param_group`` later."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.hidden = torch.nn.Linear(16, 16, bias=False)
        self.head = torch.nn.Linear(16, 8)
        self.extra = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.extra_bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(x)))
        return self.head(h @ self.extra) + self.extra_bias


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return m(torch.randint(0, 32, (8, 4), generator=g)).square().mean()


def build(m: Model, backup: str) -> gefen.GefenMuonHybrid:
    """The hybrid over everything but the two late parameters."""
    named = [(n, p) for n, p in m.named_parameters() if not n.startswith("extra")]
    return gefen.GefenMuonHybrid(named, lr=1e-2, backup_lr=5e-3, backup_optimizer=backup, backend="eager")


def add_late_groups(opt: gefen.GefenMuonHybrid, m: Model) -> None:
    """The calls after the first step, as a progressive-unfreezing callback makes them (bare tensors)."""
    opt.add_param_group({"params": [m.extra], "lr": 2e-3})
    opt.add_param_group({"params": [m.extra_bias], "lr": 3e-3})


def main() -> None:
    for backup in ("gefen", "adamw"):
        m = Model()
        opt = build(m, backup)
        opt.zero_grad()
        loss_of(m, 0).backward()
        opt.step()
        add_late_groups(opt, m)
        opt.zero_grad()
        loss_of(m, 1).backward()
        opt.step()
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        sd = copy.deepcopy(opt.state_dict())
        assert sd["gefen_hybrid"]["schema_version"] == 1, "run this with the schema-1 code"
        assert [g["hybrid_half"] for g in sd["param_groups"]] == ["muon", "muon", "backup", "backup"]
        opt.zero_grad()
        loss_of(m, 2).backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        after = {n: p.detach().clone() for n, p in m.named_parameters()}
        path = OUT / f"schema1_hybrid_{backup}.pt"
        torch.save({"params": params, "optimizer": sd, "grads": grads, "expected_after": after}, path)
        print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
