"""The Triton backend's device self-check (gefen.kernels.triton_check), run by Triton's interpreter on the CPU.

The self-check is what stands between a GPU the kernels were never run on and a user's training: it must pass on
correct kernels and refuse, with a reason, every kind of wrong result a device could give (a code, a magnitude, a
second moment, a NaN step not skipped, a compile error); ``backend="auto"`` then moves on to the next backend and an
explicit ``backend="triton"`` refuses before any write.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import gefen  # noqa: E402
from gefen.errors import ConfigError  # noqa: E402
from gefen.kernels import backends, triton_check  # noqa: E402
from gefen.kernels.triton_plan import TritonPlan  # noqa: E402
from tests.triton_interpreter import interpreted_kernels  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _interpreter():
    with interpreted_kernels():
        yield


def test_self_check_passes_on_the_kernels() -> None:
    assert triton_check.self_check(CPU) == ""


def _corrupting(monkeypatch: pytest.MonkeyPatch, corrupt) -> None:  # type: ignore[no-untyped-def]
    original = TritonPlan.run

    def run(self, groups, *, check):  # type: ignore[no-untyped-def]
        flags = original(self, groups, check=check)
        corrupt(self)
        return flags

    monkeypatch.setattr(TritonPlan, "run", run)


@pytest.mark.parametrize(
    "where,expected",
    [
        (lambda plan: plan._jobs[1].codes.view(-1)[5].add_(1), "codes differ"),
        (lambda plan: plan._jobs[3].scale[1].mul_(1.0000002), "magnitudes differ"),
        (lambda plan: plan._jobs[2].second[0].mul_(1.001), "ulps from the eager reference"),
        (lambda plan: plan._jobs[0].param.add_(1e-3), "parameters are"),
        (lambda plan: plan._jobs[4].out.add_(1e-7), "m-hat differs"),
    ],
)
def test_self_check_refuses_a_wrong_result(monkeypatch: pytest.MonkeyPatch, where, expected: str) -> None:  # type: ignore[no-untyped-def]
    _corrupting(monkeypatch, where)
    verdict = triton_check.self_check(CPU)
    assert expected in verdict and "step 1" in verdict


def test_self_check_refuses_a_nan_step_that_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TritonPlan.run
    monkeypatch.setattr(TritonPlan, "run", lambda self, groups, *, check: original(self, groups, check=False))
    assert "NaN gradient was not flagged" in triton_check.self_check(CPU)


def test_self_check_turns_a_compile_error_into_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(TritonPlan, "run", broken)
    verdict = triton_check.self_check(CPU)
    assert "could not run" in verdict and "PTX assembly failed" in verdict


def test_a_failed_self_check_moves_auto_on_and_refuses_the_explicit_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict is taken once per device; a failing one sends ``auto`` to the next backend of its order (here
    the eager one, as on a CUDA machine it would be the compiled one) and makes ``backend="triton"`` refuse at
    construction, naming the failure."""
    calls = []

    def failing(device: torch.device) -> str:
        calls.append(device)
        return "first-moment codes differ from the eager reference"

    monkeypatch.setattr(triton_check, "self_check", failing)
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("triton",))
    p = torch.nn.Parameter(torch.randn(8, 48))
    p.grad = torch.randn_like(p)
    chooser = backends.Backends()
    assert chooser.choose("auto", p, p.grad.dtype, False) == ("eager", "")
    assert chooser.choose("auto", p, p.grad.dtype, False) == ("eager", "")
    assert len(calls) == 1  # remembered per device
    with pytest.raises(ConfigError, match="self-check on this device failed: first-moment codes differ"):
        gefen.Gefen([p], backend="triton")
