"""Gefen's warnings point at the line that called into the optimizer (issue 38): the user's ``opt.step()``, or the
line of gefen's own command line that steps it, never a frame of the standard library that ran that code."""

from __future__ import annotations

import concurrent.futures
import os
import warnings

import pytest
import torch

import gefen
import gefen.cli
from gefen.kernels import native


@pytest.fixture
def native_disabled(monkeypatch):
    """The native library as if it were missing: ``backend="auto"`` falls back to the eager step with a warning."""
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native._load.cache_clear()
    yield
    monkeypatch.undo()
    native._load.cache_clear()


def _step_once() -> None:
    param = torch.nn.Parameter(torch.ones(64, 64))
    opt = gefen.Gefen([param], lr=1e-3)
    param.grad = torch.full_like(param, 0.5)
    opt.step()


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "using the eager step" in str(w.message)]


def test_fallback_warning_points_at_the_callers_step(native_disabled):
    assert not gefen.native_status().available
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step_once()
    (warning,) = _fallback_warnings(caught)
    assert os.path.abspath(warning.filename) == os.path.abspath(__file__)
    assert "GEFEN_NATIVE=0" in str(warning.message)


def test_fallback_warning_from_the_cli_in_an_executor_points_at_the_cli(native_disabled):
    """``gefen demo`` trains in a ``ProcessPoolExecutor`` child: the first frame past gefen's library code is its
    own training loop, not ``concurrent/futures`` (a thread pool has the same stack shape)."""
    cli_file = os.path.join(os.path.dirname(os.path.abspath(gefen.cli.__file__)), "_a_training_loop.py")
    source = (
        "def train(gefen, torch):\n"
        "    param = torch.nn.Parameter(torch.ones(64, 64))\n"
        "    opt = gefen.Gefen([param], lr=1e-3)\n"
        "    param.grad = torch.full_like(param, 0.5)\n"
        "    opt.step()\n"
    )
    namespace: dict[str, object] = {}
    exec(compile(source, cli_file, "exec"), namespace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(namespace["train"], gefen, torch).result()
    (warning,) = _fallback_warnings(caught)
    assert (warning.filename, warning.lineno) == (cli_file, 5)
