"""``import gefen`` and ``gefen --help`` load no torch, gefen's optimizers no compiler stack (issue 38).

``torch._dynamo`` / ``torch._inductor`` (and Triton) cost ~1.5 s to import on a CPU; gefen loads them only when a
compiled step or ``torch.compile`` needs them. The time check is a ratio inside one ``-X importtime`` run (gefen's
cumulative import time against torch's, both from the same process), never absolute seconds.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

#: Module-name prefixes that must not be imported by ``import gefen`` or by building the CLI's parser.
COMPILER_STACK = ("torch._dynamo", "torch._inductor", "triton")


def _import_lines(*args: str) -> list[tuple[int, str]]:
    """Run ``python -X importtime *args`` in a fresh interpreter; ``(cumulative microseconds, indented name)`` of
    every import, in the order they ended (the name's indentation beyond one space is its nesting depth)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
        if cumulative_us.strip().isdigit():
            lines.append((int(cumulative_us), name))
    return lines


def _import_times(*args: str) -> dict[str, int]:
    """Cumulative microseconds by module name, from :func:`_import_lines`."""
    return {name.strip(): cumulative for cumulative, name in _import_lines(*args)}


def _compiler_modules(times: dict[str, int]) -> list[str]:
    return sorted(n for n in times if any(n == p or n.startswith(p + ".") for p in COMPILER_STACK))


@pytest.mark.slow
def test_import_gefen_loads_no_torch():
    times = _import_times("-c", "import gefen")
    assert "gefen" in times and "gefen.errors" in times
    assert "torch" not in times, "import gefen must defer torch to the first use of an optimizer"


@pytest.mark.slow
def test_gefen_optimizers_load_no_compiler_and_cost_under_one_and_a_half_torch():
    lines = _import_lines("-c", "from gefen import Gefen, GefenMuon, GefenMuonHybrid, native_status; native_status()")
    times = {name.strip(): cumulative for cumulative, name in lines}
    assert _compiler_modules(times) == []
    assert {"torch", "gefen.optim.gefen", "gefen.optim.muon", "gefen.optim.hybrid", "gefen.kernels.native"} <= set(
        times
    )
    total = sum(cumulative for cumulative, name in lines if not name.startswith("  "))  # the outermost: everything
    ratio = total / times["torch"]
    assert ratio < 1.5, f"importing gefen's optimizers took {total} us, {ratio:.2f}x import torch ({times['torch']} us)"


@pytest.mark.slow
def test_cli_help_loads_no_torch():
    times = _import_times("-m", "gefen.cli.main", "--help")
    assert {"gefen.cli.demo", "gefen.cli.capacity", "gefen.cli.find_lr", "gefen.cli.inspect_cmd"} <= set(times)
    assert "torch" not in times and _compiler_modules(times) == []


def test_lazy_names_resolve_to_their_modules_and_unknown_names_raise():
    import gefen
    import gefen.kernels.native
    import gefen.optim.hybrid

    assert gefen.Gefen is importlib.import_module("gefen.optim.gefen").Gefen
    assert gefen.GefenMuonHybrid is gefen.optim.hybrid.GefenMuonHybrid
    assert gefen.native_status is gefen.kernels.native.native_status
    assert gefen.checkpoint is importlib.import_module("gefen.checkpoint")  # a sub-module, on first use
    assert set(gefen.__all__) <= set(dir(gefen))
    namespace: dict[str, object] = {}
    exec("from gefen import *", namespace)
    assert {name for name in namespace if name != "__builtins__"} == set(gefen.__all__)
    with pytest.raises(AttributeError, match="module 'gefen' has no attribute 'Gefn'"):
        gefen.Gefn  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'Gefn'"):
        exec("from gefen import Gefn", {})
