"""Tests of ``gefen demo``: runs the command in-process (training in spawned children) on a tiny model."""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gefen.cli import _optimizers
from gefen.cli._data import BatchSampler, eval_windows, load_corpus
from gefen.cli._model import build_model
from gefen.cli._optimizers import describe, param_groups, state_bytes
from gefen.cli.demo import LAUNCH_ENV, _busy_runs, _fresh_process, _lr_multiplier, _process_start_unix_s
from gefen.cli.main import main
from gefen.kernels.native import NativeStatus

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LN_256 = math.log(256)
_WORDS = (
    "def",
    "return",
    "self",
    "value",
    "if",
    "else",
    "for",
    "in",
    "range",
    "print",
    "import",
    "class",
    "None",
    "True",
    "x",
    "y",
    "total",
    "index",
    "name",
    "data",
    "(",
    ")",
    ":",
    "=",
    "+",
    ",",
)
_FAST = [
    "--model-size",
    "tiny",
    "--steps",
    "30",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-every",
    "10",
    "--threads",
    "1",
    "--seed",
    "3",
]


def _write_text_dir(root: Path, n_files: int = 12, lines_per_file: int = 60) -> Path:
    """Python-looking text, deterministic: ``n_files`` files of ``lines_per_file`` lines each (~2 KB)."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = [
            " " * rng.choice((0, 4, 8)) + " ".join(rng.choices(_WORDS, k=rng.randint(3, 8)))
            for _ in range(lines_per_file)
        ]
        (root / f"module_{i:02d}.py").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_text_dir(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def torch_peers_run(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("out")
    json_path, plot_path = out / "demo.json", out / "demo.png"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(LAUNCH_ENV, raising=False)  # start-up counts from this (pytest) process's start
        code = _run_torch_peers(text_dir, json_path, plot_path)
    return code, json.loads(json_path.read_text()), plot_path


def _run_torch_peers(text_dir: Path, json_path: Path, plot_path: Path) -> int:
    return main(
        [
            "demo",
            "--optimizers",
            "adamw,adafactor",
            "--data",
            str(text_dir),
            *_FAST,
            "--json",
            str(json_path),
            "--plot",
            str(plot_path),
        ]
    )


@pytest.mark.slow
def test_demo_json_has_documented_keys_and_sane_values(torch_peers_run: tuple[int, dict, Path]) -> None:
    code, report, _ = torch_peers_run
    assert code == 0
    assert set(report) == {"steps", "model_params", "data", "optimizers", "settings", "start_up"}
    # The first training step came after this pytest process started (the launch without scripts/demo.sh).
    assert report["start_up"]["since"] == "the gefen process started"
    assert 0 < report["start_up"]["seconds"] < time.time() - _process_start_unix_s() + 0.05
    assert report["settings"]["model_size"] == "tiny" and report["settings"]["seq_len"] > 0
    assert report["steps"] == 30
    assert report["model_params"] == sum(p.numel() for p in build_model("tiny", 32, 0).parameters())
    data = report["data"]
    assert data["n_files"] == 12 and data["n_eval_files"] == 1  # file index 9 of 12 is held out
    assert data["train_bytes"] > 0 and data["eval_bytes"] > 0 and isinstance(data["held_out_rule"], str)
    assert list(report["optimizers"]) == ["adamw", "adafactor"]
    expected = {
        "lr": float,
        "eval_loss": float,
        "train_loss": float,
        "state_bytes_per_param": float,
        "opt_step_time_s": float,
        "train_step_time_s": float,
        "peak_rss_bytes": int,
        "compile_time_s": float,
        "total_time_s": float,
        "load_average_1min_before": (float, type(None)),  # None where the platform has no load average
        "load_average_1min_after": (float, type(None)),
        "eval_curve": list,
        "train_curve": list,
    }
    for name, result in report["optimizers"].items():
        assert set(result) == set(expected), name
        for key, kind in expected.items():
            assert isinstance(result[key], kind), (name, key)
        assert math.isfinite(result["eval_loss"]) and math.isfinite(result["train_loss"])
        assert 0 < result["opt_step_time_s"] <= result["train_step_time_s"]
        assert result["peak_rss_bytes"] > 50 * 2**20
        assert result["compile_time_s"] == 0.0  # torch's optimizers compile nothing
        assert result["total_time_s"] > 30 * result["train_step_time_s"] * 0.9
        assert [step for step, _ in result["eval_curve"]] == [0, 10, 20, 30]
        assert [step for step, _ in result["train_curve"]] == list(range(1, 31))
        initial = result["eval_curve"][0][1]
        assert abs(initial - _LN_256) < 0.3, "an untrained byte model predicts ~uniformly"
        assert result["eval_loss"] < initial - 1.0, f"{name} did not learn: {result['eval_curve']}"
        assert result["train_loss"] < result["train_curve"][0][1] - 1.0
    adamw = report["optimizers"]["adamw"]
    # Two fp32 moments per element, plus one 4-byte step counter per parameter tensor.
    assert 8.0 <= adamw["state_bytes_per_param"] < 8.01
    assert report["optimizers"]["adafactor"]["state_bytes_per_param"] < 1.0  # factored, no momentum


@pytest.mark.slow
def test_demo_plot_is_a_png(torch_peers_run: tuple[int, dict, Path]) -> None:
    _, _, plot_path = torch_peers_run
    blob = plot_path.read_bytes()
    assert blob.startswith(_PNG_SIGNATURE) and len(blob) > 10_000


@pytest.mark.slow
def test_demo_same_seed_gives_identical_losses(
    torch_peers_run: tuple[int, dict, Path], text_dir: Path, tmp_path: Path
) -> None:
    _, first, _ = torch_peers_run
    json_path = tmp_path / "again.json"
    argv = ["demo", "--optimizers", "adamw", "--data", str(text_dir), *_FAST, "--json", str(json_path)]
    assert main(argv) == 0
    again = json.loads(json_path.read_text())["optimizers"]["adamw"]
    assert again["train_curve"] == first["optimizers"]["adamw"]["train_curve"]
    assert again["eval_curve"] == first["optimizers"]["adamw"]["eval_curve"]


def _has_gefen() -> bool:
    try:
        return hasattr(importlib.import_module("gefen"), "Gefen")
    except ImportError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_gefen(), reason="gefen.Gefen is not importable in this tree yet")
def test_demo_runs_gefen(text_dir: Path, tmp_path: Path) -> None:
    json_path = tmp_path / "gefen.json"
    argv = ["demo", "--optimizers", "gefen", "--data", str(text_dir), *_FAST, "--json", str(json_path)]
    assert main(argv) == 0
    result = json.loads(json_path.read_text())["optimizers"]["gefen"]
    assert math.isfinite(result["eval_loss"])
    assert result["eval_loss"] < result["eval_curve"][0][1] - 1.0
    assert 0 < result["state_bytes_per_param"] < 8.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizers", "adamw,sgd"], r"unknown optimizer.*'sgd'.*valid names: adamw, adamw-foreach"),
        (["--optimizers", "adamw,"], r"empty name"),
        (["--optimizers", "adamw,adamw"], r"more than once"),
        (["--lr", "sgd=1e-3"], r"unknown optimizer 'sgd'"),
        (["--lr", "adafactor=1e-3"], r"'adafactor' is not in --optimizers"),
        (["--lr", "adamw"], r"malformed; use NAME=VALUE"),
        (["--lr", "adamw=fast"], r"'fast' is not a number"),
        (["--lr", "adamw=-1"], r"finite and > 0"),
        (["--steps", "0"], r"--steps=0 must be >= 1"),
        (["--json", "/nonexistent-folder/x.json"], r"does not exist; create it first"),
        (["--json", "/tmp"], r"'/tmp' is a folder; give a file name"),  # refused before training, not after
        (["--plot", "curves.txt"], r"give a \.png, \.pdf or \.svg file name"),
    ],
)
def test_demo_rejects_bad_arguments(
    argv: list[str], message: str, text_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    optimizers = [] if "--optimizers" in argv else ["--optimizers", "adamw"]
    assert main(["demo", "--data", str(text_dir), *optimizers, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gefen demo: error: ")
    assert re.search(message, err), err


def test_demo_rejects_missing_data_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--optimizers", "adamw", "--data", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_rejects_empty_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    assert main(["demo", "--optimizers", "adamw", "--data", str(tmp_path)]) == 2
    assert "0 bytes in total" in capsys.readouterr().err


def test_demo_rejects_data_smaller_than_one_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "short.txt").write_text("x = 1\n" * 20)  # 120 bytes; eval tail is 12 bytes
    assert main(["demo", "--optimizers", "adamw", "--data", str(tmp_path), "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "the eval split has 12 bytes, fewer than one window of seq_len + 1 = 33 bytes" in err


def test_corpus_holds_out_every_tenth_file(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i]) * (i + 1))
    corpus = load_corpus(tmp_path)
    held_out = bytes([65 + 9]) * 10 + bytes([65 + 19]) * 20
    assert corpus.eval.numpy().tobytes() == held_out
    assert corpus.train.numel() == sum(range(1, 21)) - 30
    assert (corpus.n_files, corpus.n_eval_files) == (20, 2)


def test_corpus_skips_hidden_and_binary_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 10)
    (tmp_path / "b.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.txt").write_text("secret")
    corpus = load_corpus(tmp_path)
    assert (corpus.n_files, corpus.n_skipped_files) == (1, 1)
    assert corpus.train.numel() + corpus.eval.numel() == 120 and corpus.eval.numel() == 12  # tail rule


def test_batches_depend_only_on_seed() -> None:
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    first, second = BatchSampler(data, 4, 16, seed=5), BatchSampler(data, 4, 16, seed=5)
    for _ in range(3):
        batch = first.next()
        assert batch.shape == (4, 17) and batch.dtype == torch.uint8
        assert torch.equal(batch, second.next())
        assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 16, dtype=torch.uint8))  # contiguous
    windows = eval_windows(data, 16, 5)
    assert windows[0, 0] == 0 and windows[-1, -1] == data[-1]


def test_lr_multiplier_warms_up_then_decays_to_a_tenth() -> None:
    total = 100  # warmup = 10 steps
    assert _lr_multiplier(0, total) == pytest.approx(0.1)
    assert _lr_multiplier(9, total) == pytest.approx(1.0)
    assert _lr_multiplier(54, total) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert _lr_multiplier(99, total) == pytest.approx(0.1)


def test_param_groups_decay_only_matrices_outside_the_embedding() -> None:
    model = build_model("tiny", 32, 0)
    decay, no_decay = param_groups(model, 0.1)
    decayed = {name for name, _ in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "lm_head.weight" in decayed and "blocks.0.attn.q_proj.weight" in decayed
    assert "embed_tokens.weight" not in decayed
    assert all(param.ndim == 1 or name == "embed_tokens.weight" for name, param in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_state_bytes_counts_every_state_tensor() -> None:
    param = torch.nn.Parameter(torch.zeros(3, 5))
    optimizer = torch.optim.AdamW([param], foreach=False)
    param.grad = torch.ones(3, 5)
    optimizer.step()
    step_bytes = optimizer.state[param]["step"].numel() * optimizer.state[param]["step"].element_size()
    assert state_bytes(optimizer) == 2 * 15 * 4 + step_bytes


@pytest.mark.parametrize("name", ["gefen", "gefen-muon-hybrid"])
def test_describe_names_the_step_backend_that_will_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gefen.kernels.native_status", lambda: NativeStatus(True, "", level="avx2"))
    assert "step backend here: native (avx2)" in describe(name, 1e-3)
    missing = NativeStatus(False, "the native library is missing (somewhere)")
    monkeypatch.setattr("gefen.kernels.native_status", lambda: missing)
    line = describe(name, 1e-3)
    assert "step backend here: eager" in line and "the native library is missing (somewhere)" in line
    assert "native (" not in line and "native on CPU)" not in line  # no claim that the native step runs
    assert _optimizers.OPTIMIZERS[name].description in line


def test_busy_runs_warns_only_for_runs_above_the_cores() -> None:
    results = {
        "adamw": {"_load_before": 0.4, "_load_after": 2.3},  # its own 2 threads on 2 cores: not busy
        "gefen": {"_load_before": 1.9, "_load_after": 4.1},
        "adafactor": {"_load_before": None, "_load_after": None},  # no load average on this platform
    }
    lines = _busy_runs(results, cores=2)
    assert len(lines) == 1 and lines[0].startswith("warning: the machine was busy during gefen's run")
    assert "1.90 before, 4.10 after, on 2 core(s)" in lines[0] and "not comparable" in lines[0]
    assert _busy_runs(results, cores=8) == []


_DEMO_SCRIPT = "import sys; from gefen.cli.main import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.slow
def test_demo_without_the_native_library_says_so_in_the_header_and_warns_once(text_dir: Path) -> None:
    env = {
        **os.environ,
        "GEFEN_NATIVE_LIB": "/nonexistent/libgefen_kernels.so",  # as an install without a C compiler
        "PYTHONPATH": str(Path(importlib.import_module("gefen").__file__).parents[1]),  # this gefen, in the child too
    }
    fast = [*_FAST]
    fast[fast.index("--steps") + 1] = "3"
    launched_at = time.time() - 1.0  # as scripts/demo.sh would say, a second before the command
    env[LAUNCH_ENV] = f"{launched_at:.6f}"
    result = subprocess.run(
        [sys.executable, "-c", _DEMO_SCRIPT, "demo", "--optimizers", "gefen", "--data", str(text_dir), *fast],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    finished = time.time()
    assert result.returncode == 0, result.stderr[-4000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("[gefen] gefen.Gefen"))
    assert "step backend here: eager" in header and "GEFEN_NATIVE_LIB=/nonexistent" in header, header
    assert result.stderr.count("the native backend is unavailable") == 1, result.stderr[-4000:]
    assert "train step ms*" in result.stdout and "measured in sequential runs" in result.stdout
    # The launch time exported by scripts/demo.sh is the start-up's origin: the first step came after it,
    # and before the command ended.
    line = next(line for line in result.stdout.splitlines() if "first training step began" in line)
    match = re.fullmatch(r"\[gefen\] its first training step began (\d+\.\d) s after scripts/demo.sh started .*", line)
    assert match is not None, line
    assert 1.0 < float(match[1]) < finished - launched_at, (line, finished - launched_at)


def test_process_start_is_when_the_process_began() -> None:
    before = time.time()
    script = "import time; now = time.time(); from gefen.cli.demo import _process_start_unix_s as s; print(now, s())"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    child_now, child_start = map(float, result.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= child_start <= child_now + 2 * tick, (before, child_start, child_now)


def test_launch_counts_from_the_script_when_it_says_when_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import gefen.cli.demo as demo

    monkeypatch.setattr(demo, "_process_start_unix_s", lambda: 1000.5)
    monkeypatch.setenv(LAUNCH_ENV, "1765000000.123456789")
    assert demo._launch() == (1765000000.123456789, "scripts/demo.sh started")
    for unusable in ("", "1765000000.N", "nan", "-3", str(time.time() + 3600)):  # no %N, garbage, the future
        monkeypatch.setenv(LAUNCH_ENV, unusable)
        assert demo._launch() == (1000.5, "the gefen process started"), unusable
    monkeypatch.setattr(demo, "_process_start_unix_s", lambda: None)
    assert demo._launch() is None


def test_fused_adamw_check_agrees_with_a_real_fused_step() -> None:
    # The list torch checks AdamW(fused=True) against, and one fused step on this build: the same answer.
    assert _optimizers._fused_adamw_on_cpu() is _optimizers._fused_adamw_probe()


@pytest.mark.slow
def test_demo_parent_builds_no_optimizer_and_its_children_import_before_the_job() -> None:
    # The parent's descriptions load no torch._dynamo (building any optimizer would: 1-2 s before training).
    script = (
        "import sys; from gefen.cli._optimizers import OPTIMIZERS, describe; "
        "[describe(name, spec.lr) for name, spec in OPTIMIZERS.items()]; print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["False"], done.stderr[-2000:]
    # A training process runs its warm-up (torch, gefen, torch._dynamo) first, before any job it is given.
    with _fresh_process() as pool:
        loaded = pool.submit(eval, "[m in __import__('sys').modules for m in ('torch._dynamo', 'gefen.optim.gefen')]")
        assert loaded.result(timeout=300) == [True, True]
