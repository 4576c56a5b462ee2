"""Tests of ``gefen inspect``: real checkpoints of every optimizer are accepted with the values the live optimizer
reports, corrupted ones are refused with a message naming the key, and the committed schema-v1 fixtures load."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gefen
from gefen.checkpoint import GROUP_METADATA_KEY, METADATA_KEY, SCHEMA_VERSION
from gefen.cli.main import build_parser, main

_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CODEBOOK_BYTES = 256 * 4


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.Linear(32, 48),
        torch.nn.GELU(),
        torch.nn.LayerNorm(48),
        torch.nn.Linear(48, 64),
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (4, 12), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _gefen(factored_v_2d: bool = True) -> tuple[torch.nn.Module, gefen.Gefen]:
    """Two param groups (2-D weights with decay, the rest without) so the metadata is mirrored twice."""
    model = _model()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    optimizer = gefen.Gefen(
        [{"params": matrices}, {"params": others, "weight_decay": 0.0}],
        lr=1e-2,
        factored_v_2d=factored_v_2d,
        fused=False,
    )
    _train(model, optimizer)
    return model, optimizer


def _muon(normuon: bool) -> tuple[torch.nn.Module, gefen.GefenMuon]:
    model = _model()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    optimizer = gefen.GefenMuon(matrices, lr=1e-2, normuon=normuon, deterministic=not normuon, fused=False)
    _train(model, optimizer)
    return model, optimizer


def _hybrid(backup: str) -> tuple[torch.nn.Module, gefen.GefenMuonHybrid]:
    model = _model()
    optimizer = gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, fused=False)
    _train(model, optimizer)
    return model, optimizer


def _save(obj: object, path: Path) -> Path:
    torch.save(obj, path)
    return path


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["inspect", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _inspect_text(path: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["inspect", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(p.numel() for p in optimizer.state if optimizer.state[p])


def _periods(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {str(p): n for p, n in sorted(Counter(r["period"] for r in rows if r["period"] is not None).items())}


# ---------------------------------------------------------------------------------------------- good checkpoints
@pytest.mark.parametrize("factored_v_2d", [True, False])
def test_inspect_accepts_gefen_checkpoint_with_live_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], factored_v_2d: bool
) -> None:
    _, optimizer = _gefen(factored_v_2d)
    path = _save(optimizer.state_dict(), tmp_path / "gefen.pt")
    code, report = _inspect_json(path, capsys)
    assert code == 0, report["problems"]
    rows = optimizer.state_report()
    assert report["optimizer"] == "Gefen"
    assert report["backup_optimizer"] is None
    assert report["saved_schema_version"] == report["current_schema_version"] == SCHEMA_VERSION
    assert report["deterministic"] is False
    assert report["global_step"] == optimizer.global_step == 2
    assert report["n_groups"] == 2
    assert report["n_params_with_state"] == len(optimizer.state) == 7
    assert report["periods"] == _periods(rows)
    expected_kinds = Counter(r["second_moment"] for r in rows if r["second_moment"] is not None)
    assert report["second_moment_kinds"] == dict(expected_kinds)
    assert ("factored" in report["second_moment_kinds"]) is factored_v_2d
    assert report["state_bytes"] == optimizer.state_bytes()
    assert report["numel_with_state"] == _state_numel(optimizer) == sum(p.numel() for p in _model().parameters())
    assert report["state_bytes_per_param"] == pytest.approx(optimizer.state_bytes() / _state_numel(optimizer))
    assert report["loadable"] is True and report["problems"] == []


@pytest.mark.parametrize("normuon", [True, False])
def test_inspect_accepts_muon_checkpoint_with_live_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], normuon: bool
) -> None:
    _, optimizer = _muon(normuon)
    path = _save(optimizer.state_dict(), tmp_path / "muon.pt")
    code, report = _inspect_json(path, capsys)
    assert code == 0, report["problems"]
    assert report["optimizer"] == "GefenMuon"
    assert report["deterministic"] is (not normuon)
    assert report["global_step"] == 2
    assert report["n_params_with_state"] == 3
    assert report["periods"] == _periods(optimizer.state_report())
    assert report["second_moment_kinds"] == {("momentum_normuon" if normuon else "momentum"): 3}
    assert report["state_bytes"] == optimizer.state_bytes()
    assert report["state_bytes_per_param"] == pytest.approx(optimizer.state_bytes() / _state_numel(optimizer))


def test_inspect_accepts_hybrid_gefen_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, hybrid = _hybrid("gefen")
    assert hybrid.muon is not None and isinstance(hybrid.backup, gefen.Gefen)
    path = _save(hybrid.state_dict(), tmp_path / "hybrid.pt")
    code, report = _inspect_json(path, capsys)
    assert code == 0, report["problems"]
    assert (report["optimizer"], report["backup_optimizer"]) == ("GefenMuonHybrid", "gefen")
    assert [(h["label"], h["optimizer"]) for h in report["halves"]] == [("muon", "GefenMuon"), ("backup", "Gefen")]
    total_bytes = hybrid.muon.state_bytes() + hybrid.backup.state_bytes()
    numel = _state_numel(hybrid.muon) + _state_numel(hybrid.backup)
    assert report["state_bytes"] == total_bytes
    assert report["state_bytes_per_param"] == pytest.approx(total_bytes / numel)
    muon, backup = report["halves"]
    assert muon["state_bytes"] == hybrid.muon.state_bytes()
    assert backup["state_bytes"] == hybrid.backup.state_bytes()
    assert muon["periods"] == _periods(hybrid.muon.state_report())
    assert backup["periods"] == _periods(hybrid.backup.state_report())
    assert muon["second_moment_kinds"] == {"momentum_normuon": len(hybrid.muon.state)}  # hybrid default normuon
    assert backup["second_moment_kinds"] == {"block": len(hybrid.backup.state)}  # factored_v_2d=False


def test_inspect_accepts_hybrid_adamw_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, hybrid = _hybrid("adamw")
    assert hybrid.muon is not None and isinstance(hybrid.backup, torch.optim.AdamW)
    path = _save(hybrid.state_dict(), tmp_path / "hybrid.pt")
    code, report = _inspect_json(path, capsys)
    assert code == 0, report["problems"]
    assert report["backup_optimizer"] == "adamw"
    muon, backup = report["halves"]
    assert backup["optimizer"] == "AdamW"
    assert backup["n_params_with_state"] == len(hybrid.backup.state)
    adamw_bytes = sum(t.numel() * t.element_size() for s in hybrid.backup.state.values() for t in s.values())
    assert backup["state_bytes"] == adamw_bytes
    assert backup["numel_with_state"] == _state_numel(hybrid.backup)
    assert report["state_bytes"] == hybrid.muon.state_bytes() + adamw_bytes
    assert muon["periods"] == _periods(hybrid.muon.state_report())


def test_inspect_text_report_of_a_good_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, optimizer = _gefen()
    path = _save(optimizer.state_dict(), tmp_path / "gefen.pt")
    code, out, _ = _inspect_text(path, capsys)
    assert code == 0
    assert "optimizer: Gefen" in out
    assert f"saved {SCHEMA_VERSION}, current {SCHEMA_VERSION}" in out
    assert f"{optimizer.state_bytes():,} B" in out
    assert out.rstrip().splitlines()[-1].startswith("OK:")


def test_inspect_reads_trainer_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, optimizer = _gefen()
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    _save(optimizer.state_dict(), folder / "optimizer.pt")
    code, report = _inspect_json(folder, capsys)
    assert code == 0
    assert report["checkpoint"] == str(folder / "optimizer.pt")


@pytest.mark.parametrize("name", sorted(p.name for p in _FIXTURES.glob("v1_*.pt")))
def test_inspect_accepts_schema_v1_fixtures(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    fixture = torch.load(_FIXTURES / name, weights_only=True)
    path = _save(fixture["optimizer"], tmp_path / name)
    code, report = _inspect_json(path, capsys)
    assert code == 0, report["problems"]
    assert report["saved_schema_version"] == 1
    assert report["current_schema_version"] == SCHEMA_VERSION
    assert report["deterministic"] == "untagged"
    assert report["global_step"] == 2
    gefen_halves = [h for h in report["halves"] if h["optimizer"] != "AdamW"]
    assert gefen_halves and all(h["saved_schema_version"] == 1 for h in gefen_halves)
    code, out, _ = _inspect_text(path, capsys)
    assert code == 0 and f"saved 1, current {SCHEMA_VERSION}" in out and "untagged" in out


# ---------------------------------------------------------------------------------------------- corruptions
def _metadata_copies(sd: dict[str, Any]) -> list[dict[str, Any]]:
    """The top-level metadata and every group mirror, each distinct dict once (torch.save may share them)."""
    top = [sd[METADATA_KEY]] if METADATA_KEY in sd else []  # a hybrid half has the group mirrors only
    copies = top + [g[GROUP_METADATA_KEY] for g in sd["param_groups"] if GROUP_METADATA_KEY in g]
    return list({id(m): m for m in copies}.values())


def _set_metadata(**values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(sd: dict[str, Any]) -> None:
        for meta in _metadata_copies(sd):
            meta.update(values)

    return mutate


def _unsort_codebook(sd: dict[str, Any]) -> None:
    codebook = sd[METADATA_KEY]["codebook"].clone()
    codebook[5] = 0.9
    _set_metadata(codebook=codebook)(sd)


def _mirror_on_some_groups(sd: dict[str, Any]) -> None:
    sd["param_groups"][1] = {k: v for k, v in sd["param_groups"][1].items() if k != GROUP_METADATA_KEY}


def _state(sd: dict[str, Any], key: str, value: Callable[[torch.Tensor], torch.Tensor], pid: int = 0) -> None:
    sd["state"][pid][key] = value(sd["state"][pid][key])


def _set_index(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = value
    return tensor


def _factored_pid(sd: dict[str, Any]) -> int:
    return next(pid for pid, s in sd["state"].items() if "second_moment_row" in s)


def _half_view(sd: dict[str, Any], half: str) -> dict[str, Any]:
    """One half of a hybrid checkpoint (torch's layout) as its own state dict, sharing the group and state entry
    objects (so in-place edits land in ``sd``), indices renumbered from 0 like the child's own state_dict()."""
    groups = [g for g in sd["param_groups"] if g["hybrid_half"] == half]
    pids = [pid for g in groups for pid in g["params"]]
    return {"state": {i: sd["state"][pid] for i, pid in enumerate(pids) if pid in sd["state"]}, "param_groups": groups}


def _muon_half(mutate: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda sd: mutate(_half_view(sd, "muon"))


def _backup_half(mutate: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda sd: mutate(_half_view(sd, "backup"))


#: (case, base checkpoint, in-place mutation of the loaded dict, text every problem message must contain)
CORRUPTIONS: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    (
        "codes cast to float",
        "gefen",
        lambda sd: _state(sd, "first_moment_codes", lambda t: t.float()),
        "['first_moment_codes'] has dtype torch.float32",
    ),
    (
        "negative magnitude",
        "gefen",
        lambda sd: _state(sd, "first_moment_scale", lambda t: _set_index(t, -1.0)),
        "['first_moment_scale'] has negative or non-finite values",
    ),
    (
        "nan factored second moment",
        "gefen",
        lambda sd: _state(sd, "second_moment_row", lambda t: _set_index(t, float("nan")), _factored_pid(sd)),
        "['second_moment_row'] has negative or non-finite values",
    ),
    (
        "nan block second moment",
        "gefen_block",
        lambda sd: _state(sd, "second_moment", lambda t: _set_index(t, float("nan"))),
        "['second_moment'] has negative or non-finite values",
    ),
    ("period not dividing", "gefen", lambda sd: _state(sd, "period", lambda t: torch.tensor(7)), "['period']=7"),
    ("step zero", "gefen", lambda sd: _state(sd, "step", lambda t: torch.tensor(0)), "['step']=0 must be >= 1"),
    ("codebook removed everywhere", "gefen", _set_metadata(codebook=None), "no frozen codebook"),
    ("codebook unsorted", "gefen", _unsort_codebook, "codebook is invalid: is not sorted"),
    ("deterministic tag string", "gefen", _set_metadata(deterministic="true"), "deterministic policy must be a bool"),
    ("newer schema", "gefen", _set_metadata(schema_version=SCHEMA_VERSION + 1), "is newer than this gefen"),
    ("mirror on some groups", "gefen", _mirror_on_some_groups, f"'{GROUP_METADATA_KEY}' is present on only some"),
    ("eps zero", "gefen", lambda sd: sd["param_groups"][1].update(eps=0.0), "param_groups[1]['eps']=0.0"),
    ("unlisted state", "gefen", lambda sd: sd["state"].update({99: sd["state"][0]}), "parameter index 99"),
    (
        "factored state in a block group",
        "gefen",
        lambda sd: sd["param_groups"][0].update(factored_v_2d=False),
        "factored_v_2d=False keeps a block state",
    ),
    (
        "normuon flag edited",
        "muon_normuon",
        lambda sd: sd["param_groups"][0].update(normuon=False),
        "normuon=False keeps a momentum state",
    ),
    (
        "normuon step beyond step",
        "muon_normuon",
        lambda sd: _state(sd, "normuon_step", lambda t: torch.tensor(5)),
        "['normuon_step']=5 must be in [0, step=2]",
    ),
    (
        "muon half normuon_v nan",
        "hybrid_gefen",
        _muon_half(lambda sd: _state(sd, "normuon_v", lambda t: _set_index(t, float("nan")))),
        "muon half: checkpoint state[0]",
    ),
    (
        "backup half codes reshaped",
        "hybrid_gefen",
        _backup_half(lambda sd: _state(sd, "first_moment_codes", lambda t: t.reshape(1, -1))),
        "backup half: checkpoint state[",
    ),
    (
        "hybrid saved by another backup",
        "hybrid_adamw",
        lambda sd: sd["gefen_hybrid"].update(backup_optimizer="sgd"),
        "backup_optimizer='sgd'",
    ),
    (
        "muon half saved as Gefen",
        "hybrid_adamw",
        _muon_half(_set_metadata(optimizer="Gefen")),
        "cannot load it into GefenMuon",
    ),
]

#: Cases that refuse more than one parameter (one problem each); every other case has exactly one problem.
_PROBLEM_COUNTS = {"factored state in a block group": 3, "normuon flag edited": 3}  # the three 2-D weights

_BUILDERS: dict[str, Callable[[], torch.optim.Optimizer]] = {
    "gefen": lambda: _gefen(True)[1],
    "gefen_block": lambda: _gefen(False)[1],
    "muon_normuon": lambda: _muon(True)[1],
    "hybrid_gefen": lambda: _hybrid("gefen")[1],
    "hybrid_adamw": lambda: _hybrid("adamw")[1],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One pristine checkpoint file per base optimizer, built once for the module."""
    folder = tmp_path_factory.mktemp("pristine")
    return {name: _save(build().state_dict(), folder / f"{name}.pt") for name, build in _BUILDERS.items()}


def _corrupt(saved: dict[str, Path], base: str, mutate: Callable[[dict[str, Any]], None], path: Path) -> Path:
    sd = torch.load(saved[base], weights_only=True)
    mutate(sd)
    return _save(sd, path)


@pytest.mark.parametrize(("case", "base", "mutate", "needle"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_inspect_refuses_corrupted_checkpoint(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    saved: dict[str, Path],
    case: str,
    base: str,
    mutate: Callable[[dict[str, Any]], None],
    needle: str,
) -> None:
    code, report = _inspect_json(saved[base], capsys)
    assert code == 0, report["problems"]  # the pristine base is fine
    path = _corrupt(saved, base, mutate, tmp_path / "bad.pt")
    count = _PROBLEM_COUNTS.get(case, 1)
    code, out, _ = _inspect_text(path, capsys)
    assert code == 1
    assert f"REFUSED: {count} problem(s)" in out
    assert needle in out
    code, report = _inspect_json(path, capsys)
    assert code == 1 and report["loadable"] is False
    assert len(report["problems"]) == count and all(needle in p for p in report["problems"])


@pytest.mark.parametrize(("case", "base", "mutate", "needle"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_inspect_verdict_matches_live_load(
    tmp_path: Path, saved: dict[str, Path], case: str, base: str, mutate: Callable[[dict[str, Any]], None], needle: str
) -> None:
    """What inspect refuses, load_state_dict on the same model refuses too; the pristine dict loads."""
    live = _BUILDERS[base]()
    live.load_state_dict(torch.load(saved[base], weights_only=True))
    bad = torch.load(_corrupt(saved, base, mutate, tmp_path / "bad.pt"), weights_only=True)
    with pytest.raises(gefen.CheckpointError):
        live.load_state_dict(bad)


def test_inspect_collects_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], saved: dict[str, Path]
) -> None:
    def mutate(sd: dict[str, Any]) -> None:
        _state(sd, "first_moment_codes", lambda t: t.float(), pid=0)
        _state(sd, "step", lambda t: torch.tensor(0), pid=1)
        _state(sd, "period", lambda t: torch.tensor(7), pid=2)
        sd["param_groups"][0]["lr"] = -1.0
        sd["param_groups"][1]["eps"] = 0.0
        _set_metadata(deterministic="true")(sd)

    path = _corrupt(saved, "gefen", mutate, tmp_path / "bad.pt")
    code, report = _inspect_json(path, capsys)
    assert code == 1
    problems = report["problems"]
    assert len(problems) == 6
    for needle in (
        "state[0]",
        "state[1]",
        "['period']=7",
        "param_groups[0]['lr']",
        "param_groups[1]['eps']",
        "deterministic",
    ):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    # the rest of the report still describes the checkpoint
    assert report["n_params_with_state"] == 7
    assert report["deterministic"] == "true"
    code, out, _ = _inspect_text(path, capsys)
    assert "REFUSED: 6 problem(s)" in out


def test_inspect_refuses_corrupted_trainer_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], saved: dict[str, Path]
) -> None:
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    _corrupt(saved, "gefen", lambda sd: _state(sd, "step", lambda t: torch.tensor(0)), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text("{}")
    code, out, _ = _inspect_text(folder, capsys)
    assert code == 1
    assert "['step']=0" in out and "REFUSED: 1 problem(s)" in out


def test_inspect_refuses_non_gefen_and_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    _train(model, adamw)
    code, out, _ = _inspect_text(_save(adamw.state_dict(), tmp_path / "adamw.pt"), capsys)
    assert code == 1 and "not a Gefen checkpoint" in out and "'exp_avg'" in out
    assert "REFUSED: 1 problem(s)" in out  # one problem, not one per AdamW parameter
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    code, out, _ = _inspect_text(garbage, capsys)
    assert code == 1 and "cannot read" in out and "REFUSED: 1 problem(s)" in out


def test_inspect_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect_text(tmp_path / "missing.pt", capsys)
    assert code == 2 and "does not exist" in err and out == ""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    code, _, err = _inspect_text(folder, capsys)
    assert code == 2 and "no optimizer.pt" in err and "model.safetensors" in err


# ---------------------------------------------------------------------------------------------- plot, entry points
def test_inspect_plot_writes_codebook_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], saved: dict[str, Path]
) -> None:
    png = tmp_path / "codebook.png"
    capsys.readouterr()
    assert main(["inspect", str(saved["hybrid_gefen"]), "--plot", str(png), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["plot"] == str(png)
    assert f"wrote {png}" in captured.err
    assert png.read_bytes().startswith(_PNG_SIGNATURE)


def test_inspect_plot_without_codebook_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = gefen.Gefen(_model().parameters(), fused=False)  # no step yet: no state and no codebook
    path = _save(fresh.state_dict(), tmp_path / "fresh.pt")
    png = tmp_path / "codebook.png"
    capsys.readouterr()
    assert main(["inspect", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "no codebook" in out and "OK:" in out
    assert not png.exists()
    assert main(["inspect", str(path), "--plot", str(tmp_path / "missing" / "x.png")]) == 2


def test_main_keeps_demo_and_adds_inspect() -> None:
    help_text = build_parser().format_help()
    assert "demo" in help_text and "inspect" in help_text


def test_inspect_runs_as_module_in_subprocess(tmp_path: Path, saved: dict[str, Path]) -> None:
    bad = _corrupt(saved, "gefen", _set_metadata(schema_version=SCHEMA_VERSION + 1), tmp_path / "bad.pt")
    for path, expected in ((saved["hybrid_adamw"], 0), (bad, 1)):
        result = subprocess.run(
            [sys.executable, "-m", "gefen", "inspect", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == expected, result.stderr
        assert ("OK:" in result.stdout) is (expected == 0)
        assert ("[backup] AdamW" in result.stdout) is (expected == 0)  # the hybrid's halves are reported apart
        assert ("REFUSED: 1 problem(s)" in result.stdout) is (expected == 1)


INSPECT_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "inspect"
_MANIFEST = json.loads((INSPECT_FIXTURES / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(_MANIFEST))
def test_committed_fixtures_good_accepted_corrupted_refused(name, capsys):
    """``tests/fixtures/inspect/`` (``scripts/make_inspect_fixtures.py``): every ``good_*`` file exits 0, every
    ``bad_*`` file exits 1 and names its problem; a real ``load_state_dict`` agrees for the Gefen ones."""
    code = main(["inspect", str(INSPECT_FIXTURES / name)])
    out = capsys.readouterr().out
    expected = _MANIFEST[name]
    if expected is None:
        assert code == 0, out
        assert "OK" in out
    else:
        assert code == 1, out
        assert "REFUSED" in out
        problems = out.split("problems:", 1)[1]
        assert expected in problems, problems


def test_training_checkpoint_with_an_optimizer_entry_is_unwrapped(tmp_path, capsys):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "v1_gefen.pt"
    assert main(["inspect", str(fixture), "--json"]) == 0
    captured = capsys.readouterr()
    assert "reading the 'optimizer' entry" in captured.err
    assert json.loads(captured.out)["optimizer"] == "Gefen"
    folder = tmp_path / "checkpoint-5"
    (folder / "optimizer.pt").mkdir(parents=True)
    assert main(["inspect", str(folder)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_inspect_accepts_muon_normuon_state_of_a_column_as_the_loader_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GefenMuon checkpoint saved with NorMuon rows for a (24, 1) column (before NorMuon left matrices with rows of
    fewer than 8 elements out) loads, its NorMuon entries dropped; inspect says so too instead of refusing it."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(24, 1), (16, 32)]]
    monkeypatch.setattr("gefen.state.has_row_statistics", lambda shape: True)  # the kind rule before NorMuon's gate
    optimizer = gefen.GefenMuon(params, lr=1e-2, normuon=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        optimizer.step()
    monkeypatch.undo()
    code, report = _inspect_json(_save(optimizer.state_dict(), tmp_path / "muon.pt"), capsys)
    assert code == 0, report
    gefen.GefenMuon([torch.nn.Parameter(p.detach().clone()) for p in params], normuon=True).load_state_dict(
        torch.load(tmp_path / "muon.pt", weights_only=True)
    )
