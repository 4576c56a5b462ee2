"""Tests of ``gefen capacity``: the model family, the search (driven by made-up runs), the classification of a
child's end, real child runs under a limit, and the command end to end on a small budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gefen.cli._capacity_probe import EXIT_OOM, ProbeSpec, outcome_from_events, run_probe
from gefen.cli._capacity_search import (
    FamilyMember,
    Outcome,
    format_params,
    largest_fitting,
    model_family,
    parameter_count,
)
from gefen.cli._model import ByteTransformer, ModelConfig
from gefen.cli.main import main

GIB = 2**30
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- the family ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, 57, 140, 260])
def test_family_parameter_count_is_the_models(index: int) -> None:
    member = model_family()[index]
    config = ModelConfig(member.d_model, member.n_layers, member.n_heads, member.d_ff, context_len=16)
    with torch.device("meta"):
        model = ByteTransformer(config)
    assert (
        sum(p.numel() for p in model.parameters()) == member.params == parameter_count(member.d_model, member.n_layers)
    )


def test_family_grows_by_2_to_6_percent_with_sane_shapes() -> None:
    family = model_family()
    assert [m.index for m in family] == list(range(len(family)))
    growth = [b.params / a.params for a, b in zip(family, family[1:])]
    assert min(growth) >= 1.02
    middle = [g for a, g in zip(family, growth) if 10**8 <= a.params <= 10**11]
    assert max(middle) < 1.05  # the resolution of the answer between 100M and 100B parameters
    assert max(g for a, g in zip(family, growth) if a.params >= 10**7) < 1.12
    assert family[0].params < 10**6 and family[-1].params > 10**11
    assert len({format_params(m.params) for m in family}) == len(family)  # neighbours never print alike
    for member in family:
        assert member.d_model % 64 == 0 and 32 <= member.d_model / member.n_layers <= 128
        assert member.d_ff % 64 == 0 and member.d_ff >= 8 * member.d_model // 3


# -- the search, on made-up runs -----------------------------------------------------------------------------------


class _FakeRuns:
    """Runs whose peak is ``base + slope · params`` (stopped at the limit when it is passed)."""

    def __init__(self, base: float, slope: float, broken_at: int | None = None) -> None:
        self.base, self.slope, self.broken_at = base, slope, broken_at
        self.calls: list[tuple[int, int]] = []

    def peak(self, member: FamilyMember) -> int:
        return int(self.base + self.slope * member.params)

    def __call__(self, member: FamilyMember, budget: int) -> Outcome:
        self.calls.append((member.index, budget))
        if member.index == self.broken_at:
            return Outcome(member, "error", None, budget, phase="step 1", detail="failed: RuntimeError: boom")
        peak = self.peak(member)
        if peak > budget:
            return Outcome(member, "over_budget", budget + 1, budget, phase="step 1")
        return Outcome(member, "fit", peak, budget, state_bytes=member.params, steps=3, phase="done")


def _truth(runs: _FakeRuns, budget: int) -> int:
    return max(m.index for m in model_family() if runs.peak(m) <= budget)


@pytest.mark.parametrize("slope, prior", [(17.3, 17.0), (10.4, 17.0), (25.0, 10.0)])
@pytest.mark.parametrize("budget_gib", [1.0, 8.0, 80.0])
def test_search_finds_the_exact_boundary_in_few_runs(slope: float, prior: float, budget_gib: float) -> None:
    runs = _FakeRuns(0.46 * GIB, slope)
    budget = int(budget_gib * GIB)
    result = largest_fitting(runs, budget, [], prior)
    truth = _truth(runs, budget)
    assert result.largest is not None and result.largest.member.index == truth
    assert result.next_larger is not None and result.next_larger.member.index == truth + 1
    assert result.next_larger.status == "over_budget" and result.error is None
    assert result.probes == len(runs.calls) <= 8  # the smallest model, then the predicted boundary
    assert all(budget_ == budget for _, budget_ in runs.calls)


def test_search_reuses_completed_runs_for_other_budgets() -> None:
    runs = _FakeRuns(0.46 * GIB, 11.0)
    outcomes: list[Outcome] = []
    answers = [largest_fitting(runs, int(b * GIB), outcomes, 11.0) for b in (2, 4, 8)]
    for answer, budget in zip(answers, (2, 4, 8)):
        assert answer.largest is not None and answer.largest.member.index == _truth(runs, budget * GIB)
    assert answers[1].probes + answers[2].probes < answers[0].probes + 4  # the smallest run is not repeated
    assert runs.calls.count((0, 2 * GIB)) == 1 and all(index != 0 for index, b in runs.calls if b > 2 * GIB)


def test_a_run_stopped_at_a_lower_limit_does_not_decide_a_larger_budget() -> None:
    member = model_family()[100]
    stopped = Outcome(member, "over_budget", 2 * GIB + 1, 2 * GIB, phase="step 1")
    assert stopped.fits(2 * GIB) is False and stopped.fits(GIB) is False and stopped.fits(3 * GIB) is None
    done = Outcome(member, "fit", int(2.5 * GIB), 3 * GIB, steps=3, phase="done")
    assert done.fits(3 * GIB) is True and done.fits(2 * GIB) is False  # a completed run's peak is exact
    errored = Outcome(member, "error", None, 3 * GIB, phase="build", detail="x")
    assert errored.fits(3 * GIB) is None and errored.fits(GIB) is None


def test_search_when_nothing_fits_then_a_larger_budget_starts_from_the_smallest_model() -> None:
    runs = _FakeRuns(0.46 * GIB, 10.0)
    outcomes: list[Outcome] = []
    result = largest_fitting(runs, int(0.3 * GIB), outcomes, 10.0)
    assert result.largest is None and result.error is None and runs.calls == [(0, int(0.3 * GIB))]
    larger = largest_fitting(runs, GIB, outcomes, 10.0)
    assert runs.calls[1] == (0, GIB) and larger.largest.member.index == _truth(runs, GIB)
    assert larger.probes <= 5


def test_search_stops_on_a_run_that_failed_for_another_reason() -> None:
    runs = _FakeRuns(0.46 * GIB, 10.0)
    truth = _truth(runs, 4 * GIB)
    runs.broken_at = truth
    result = largest_fitting(runs, 4 * GIB, [], 10.0)
    assert result.error is not None and result.error.member.index == truth and "boom" in result.error.detail
    assert result.largest is None or result.largest.member.index < truth  # never a size that did not run


def test_search_respects_its_run_limit() -> None:
    runs = _FakeRuns(0.46 * GIB, 40.0)
    result = largest_fitting(runs, 64 * GIB, [], 4.0, max_probes=3)
    assert result.probes == 3 == len(runs.calls)


# -- the end of a child, classified --------------------------------------------------------------------------------


def _member() -> FamilyMember:
    return model_family()[10]


def _steps(*losses: float) -> list[dict]:
    return [{"event": "phase", "phase": f"step {i + 1}"} for i in range(len(losses))] + [
        {"event": "step", "step": i + 1, "loss": loss, "seconds": 0.1} for i, loss in enumerate(losses)
    ]


def test_classify_a_completed_run() -> None:
    events = _steps(5.5, 5.4, 5.3) + [{"event": "done", "peak_bytes": 900, "state_bytes": 123}]
    outcome = outcome_from_events(_member(), events, 0, 1000, None, 950, 2.0)
    assert (outcome.status, outcome.peak_bytes, outcome.state_bytes, outcome.steps) == ("fit", 950, 123, 3)
    assert outcome.losses == (5.5, 5.4, 5.3) and outcome.phase == "done"
    late = outcome_from_events(_member(), events, 0, 850, None, None, 2.0)  # finished between two looks
    assert late.status == "over_budget" and late.peak_bytes == 900 and late.fits(925) is True


@pytest.mark.parametrize(
    "events, returncode, stopped, status, words",
    [
        (_steps(5.5), -9, "over_budget", "over_budget", "passed the budget during step 1"),
        ([{"event": "phase", "phase": "build"}], -9, None, "killed", "OOM killer"),
        (
            [{"event": "phase", "phase": "optimizer"}, {"event": "oom", "message": "CUDA out of memory"}],
            EXIT_OOM,
            None,
            "oom",
            "out of memory during optimizer: CUDA out of memory",
        ),  # fmt: skip
        (
            [{"event": "phase", "phase": "build"}, {"event": "error", "message": "KeyError: 'nope'"}],
            1,
            None,
            "error",
            "KeyError: 'nope'",
        ),  # fmt: skip
        (
            _steps(5.5, math.nan, 5.0) + [{"event": "done", "peak_bytes": 1, "state_bytes": 1}],
            0,
            None,
            "error",
            "not finite",
        ),  # fmt: skip
        ([{"event": "phase", "phase": "step 2"}], -9, "timeout", "timeout", "during step 2"),
        ([], 1, None, "error", "Traceback line"),
    ],
)
def test_classify_a_run_that_did_not_finish(events, returncode, stopped, status, words) -> None:
    outcome = outcome_from_events(_member(), events, returncode, 1000, stopped, 1001, 1.0, "x\nTraceback line\n")
    assert outcome.status == status and words in outcome.detail
    assert outcome.fits(1000) is (None if status in ("error", "timeout") else False)


# -- real children ---------------------------------------------------------------------------------------------------


def _spec(name: str, member: FamilyMember, budget: int) -> ProbeSpec:
    return ProbeSpec(name, member.d_model, member.n_layers, member.d_ff, budget, seq_len=32, threads=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, state_per_param", [("adamw", (8.0, 8.01)), ("gefen", (0.95, 1.3))])
def test_a_small_model_trains_and_is_measured(name: str, state_per_param: tuple[float, float]) -> None:
    member = model_family()[20]
    outcome = run_probe(_spec(name, member, 4 * GIB), member)
    assert outcome.status == "fit", outcome.detail
    assert outcome.steps == 3 and all(math.isfinite(x) for x in outcome.losses)
    assert 0.2 * GIB < outcome.peak_bytes < GIB  # the interpreter and torch, the model, a few MiB of state
    low, high = state_per_param
    assert low <= outcome.state_bytes / member.params <= high


@pytest.mark.timeout(120)
def test_a_run_over_the_budget_is_stopped_and_reported() -> None:
    member = model_family()[20]
    outcome = run_probe(_spec("adamw", member, int(0.15 * GIB)), member)  # less than torch's own import
    assert outcome.status == "over_budget" and outcome.peak_bytes > 0.15 * GIB
    assert outcome.fits(int(0.15 * GIB)) is False and "passed the budget" in outcome.detail


@pytest.mark.timeout(120)
def test_a_failing_run_and_a_hung_run_are_reported_not_raised() -> None:
    member = model_family()[5]
    broken = run_probe(_spec("no-such-optimizer", member, 4 * GIB), member)
    assert broken.status == "error" and "KeyError" in broken.detail and broken.phase == "optimizer"
    slow = run_probe(_spec("adamw", member, 4 * GIB), member, timeout_s=0.3)
    assert slow.status == "timeout" and slow.fits(4 * GIB) is None


@pytest.mark.timeout(60)
def test_an_interrupted_watch_kills_its_child(monkeypatch: pytest.MonkeyPatch) -> None:
    import gefen.cli._capacity_probe as probe_module

    started = []
    real_popen = probe_module.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(probe_module.subprocess, "Popen", popen)
    monkeypatch.setattr(probe_module.time, "sleep", interrupt)
    member = model_family()[5]
    with pytest.raises(KeyboardInterrupt):
        run_probe(_spec("adamw", member, 4 * GIB), member)
    (child,) = started
    assert child.returncode == -9  # killed and reaped, not left running


# -- the command ------------------------------------------------------------------------------------------------------


def test_command_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--optimizers", "adamw,sgd"], "unknown optimizer 'sgd'"),
        (["--optimizers", "adamw,adamw"], "give each name once"),
        (["--budget-gib", "0.01"], "at least 0.125 GiB"),
        (["--steps", "0"], "--steps=0 must be >= 1"),
        (["--device", "tpu"], "use cpu or cuda"),
        (["--json", "/no/such/folder/x.json"], "does not exist"),
        (["--optimizers", ","], "names no optimizer"),
        (["--seed", str(2**64)], "must be in [0, 2**63)"),
        (["--json", "/tmp"], "is a folder"),
        (["--plot", "x.txt"], "give a .png, .pdf or .svg"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA device"))
    for argv, words in cases:
        assert (
            main(["capacity", "--budget-gib", "1", *argv] if "--budget-gib" not in argv else ["capacity", *argv]) == 2
        )
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "x"])
def test_command_refuses_budgets_and_timeouts_that_are_not_positive_numbers(value: str) -> None:
    for flag in ("--budget-gib", "--probe-timeout"):
        with pytest.raises(SystemExit) as exit_info:
            main(
                ["capacity", flag, value] if flag == "--budget-gib" else ["capacity", "--budget-gib", "1", flag, value]
            )
        assert exit_info.value.code == 2


@pytest.mark.timeout(120)
def test_a_stopped_search_is_marked_has_no_ratio_and_fails_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cap.json"
    argv = [
        "capacity",
        "--budget-gib",
        "1",
        "--optimizers",
        "adamw,gefen",
        "--probe-timeout",
        "0.2",
        "--json",
        str(out),
    ]
    assert main(argv) == 1
    report = json.loads(out.read_text())
    assert report["complete"] is False
    for name in ("adamw", "gefen"):
        (budget,) = report["results"][name]["budgets"]
        assert budget["complete"] is False and budget["params_vs_adamw"] is None
        assert budget["error"]["status"] == "timeout" and budget["largest"] is None
    captured = capsys.readouterr()
    assert "search stopped" in captured.err or "stopped" in captured.out
    assert "lower bounds" in captured.err


@pytest.mark.timeout(120)
def test_sigterm_stops_the_command_and_its_child(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal
    import threading

    import gefen.cli._capacity_probe as probe_module

    started = []
    real_popen = probe_module.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return started[-1]

    monkeypatch.setattr(probe_module.subprocess, "Popen", popen)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["capacity", "--budget-gib", "1", "--optimizers", "adamw"]) == 143
    assert started[0].returncode == -9 and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux: PR_SET_PDEATHSIG")
def test_a_child_dies_with_its_parent_even_under_kill_9() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "from gefen.cli._capacity_probe import ProbeSpec, run_probe\n"
        "from gefen.cli._capacity_search import model_family\n"
        "m = model_family()[200]\n"
        "run_probe(ProbeSpec('adamw', m.d_model, m.n_layers, m.d_ff, 8 * 2**30, threads=1), m)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    children: list[int] = []
    deadline = time.monotonic() + 60
    while not children and time.monotonic() < deadline:
        time.sleep(0.1)
        text = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        children = [int(pid) for pid in text]
    assert children, "the parent never started its child"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        return "\nState:\tZ" not in state  # a zombie waiting to be reaped is dead

    deadline = time.monotonic() + 10
    while alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(children[0])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_command_end_to_end_on_a_small_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "cap.json", tmp_path / "cap.png"
    argv = ["capacity", "--budget-gib", "0.7", "--optimizers", "adamw,gefen", "--seq-len", "64", "--threads", "1",
            "--json", str(out), "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert plot.read_bytes().startswith(_PNG_SIGNATURE)
    printed = capsys.readouterr().out
    budget = int(0.7 * GIB)
    largest = {}
    for name in ("adamw", "gefen"):
        (entry,) = report["results"][name]["budgets"]
        best, above = entry["largest"], entry["next_larger"]
        assert best["status"] == "fit" and best["steps"] == 3 and best["peak_bytes"] <= budget
        assert above["status"] == "over_budget" and above["params"] > best["params"]
        family = {m.params: m.index for m in model_family()}
        assert family[above["params"]] == family[best["params"]] + 1  # neighbours: the boundary is exact
        assert name in printed and format_params(best["params"]) in printed
        largest[name] = best["params"]
    assert largest["gefen"] > 1.3 * largest["adamw"]  # even where the interpreter is half the budget
    assert report["complete"] is True and all(b["complete"] for e in report["results"].values() for b in e["budgets"])
    ratio = report["results"]["gefen"]["budgets"][0]["params_vs_adamw"]
    assert ratio == round(largest["gefen"] / largest["adamw"], 3)
    runs = [r for r in report["runs"] if r["optimizer"] == "gefen"]
    assert len(runs) == report["results"]["gefen"]["budgets"][0]["probes"]
