"""Generate the `gefen inspect` fixtures under tests/fixtures/inspect/: good checkpoints of every optimizer at the
current schema, and corrupted copies of them and of the schema-1 fixtures, with a manifest naming the problem each
corrupted file must be refused for (``manifest.json``: file name -> substring of the expected problem, ``null``
for a good file). Re-run only when the schema changes (then bump the schema and keep the old files).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

import gefen

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "inspect"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))


def _trained(kind: str) -> dict:
    model = _model()
    named = list(model.named_parameters())
    if kind == "gefen":
        opt = gefen.Gefen(named, lr=1e-2, weight_decay=0.0, fused=False)  # 0.0: the default when written
    elif kind == "gefen_muon":
        opt = gefen.GefenMuon([(n, p) for n, p in named if p.dim() == 2 and n[0] != "0"], normuon=True, fused=False)
    else:
        opt = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=kind.split("_")[1], fused=False)
    for s in range(2):
        tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()
    return copy.deepcopy(opt.state_dict())


def _two_groups() -> dict:
    model = _model()
    weights = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [(n, p) for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
    opt = gefen.Gefen(groups, lr=1e-2, weight_decay=0.0, fused=False)  # 0.0: the default when written
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    model(tokens).square().mean().backward()
    opt.step()
    return copy.deepcopy(opt.state_dict())


def _edit(sd: dict, fn: Callable[[dict], None]) -> dict:
    sd = copy.deepcopy(sd)
    fn(sd)
    return sd


def _meta_all(sd: dict, **values: object) -> None:
    """Edit the top-level metadata and every group's copy alike."""
    for meta in [sd.get("gefen"), *(g.get("gefen_metadata") for g in sd["param_groups"])]:
        if meta is not None:
            meta.update(values)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, str | None] = {}

    def save(name: str, sd: dict, problem: str | None) -> None:
        torch.save(sd, OUT / name)
        manifest[name] = problem

    good = {kind: _trained(kind) for kind in ("gefen", "gefen_muon", "hybrid_gefen", "hybrid_adamw")}
    for kind, sd in good.items():
        save(f"good_{kind}.pt", sd, None)
    g = good["gefen"]
    s0 = 0
    save(
        "bad_codes_float.pt",
        _edit(g, lambda d: d["state"][s0].update(first_moment_codes=d["state"][s0]["first_moment_codes"].float())),
        "first_moment_codes",
    )
    save(
        "bad_scale_negative.pt",
        _edit(g, lambda d: d["state"][s0]["first_moment_scale"].__setitem__(0, -1.0)),
        "first_moment_scale",
    )
    save(
        "bad_second_moment_nan.pt",
        _edit(g, lambda d: d["state"][1]["second_moment_row"].__setitem__(0, float("nan"))),
        "second_moment_row",
    )
    save("bad_period.pt", _edit(g, lambda d: d["state"][s0].update(period=torch.tensor(7))), "period")
    save("bad_step_zero.pt", _edit(g, lambda d: d["state"][s0].update(step=torch.tensor(0))), "'step'")
    save("bad_codebook_stripped.pt", _edit(g, lambda d: _meta_all(d, codebook=None)), "codebook")
    save("bad_codebook_unsorted.pt", _edit(g, lambda d: d["gefen"]["codebook"].__setitem__(5, 0.99)), "codebook")
    save("bad_policy_tag.pt", _edit(g, lambda d: _meta_all(d, deterministic="true")), "must be a bool")
    save("bad_newer_schema.pt", _edit(g, lambda d: _meta_all(d, schema_version=99)), "newer")
    save(
        "bad_mirror_partial.pt", _edit(_two_groups(), lambda d: d["param_groups"][0].pop("gefen_metadata")), "only some"
    )
    save("bad_eps_zero.pt", _edit(g, lambda d: d["param_groups"][0].update(eps=0.0)), "eps")
    m = good["gefen_muon"]
    save("bad_normuon_negative.pt", _edit(m, lambda d: d["state"][0]["normuon_v"].__setitem__(0, -1.0)), "normuon_v")
    save(
        "bad_hybrid_backend.pt",
        _edit(good["hybrid_gefen"], lambda d: d.update(backup_optimizer="sgd")),
        "backup_optimizer",
    )
    v1 = torch.load(ROOT / "tests" / "fixtures" / "v1_gefen.pt", weights_only=True)["optimizer"]
    save("good_v1_gefen.pt", v1, None)
    assert v1["state"][0]["first_moment_codes"].shape[0] > 1
    save(
        "bad_v1_codes_shape.pt",
        _edit(
            v1, lambda d: d["state"][0].update(first_moment_codes=d["state"][0]["first_moment_codes"].reshape(1, -1))
        ),
        "first_moment_codes",
    )
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(manifest)} fixtures to {OUT}")


if __name__ == "__main__":
    main()
