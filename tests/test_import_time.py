"""``import gefen`` and ``gefen --help`` load no compiler stack (issue 38).

``torch._dynamo`` / ``torch._inductor`` (and Triton) cost ~1.5 s to import on a CPU; gefen loads them only when a
compiled step or ``torch.compile`` needs them. The time check is a ratio inside one ``-X importtime`` run (gefen's
cumulative import time against torch's, both from the same process), never absolute seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: Module-name prefixes that must not be imported by ``import gefen`` or by building the CLI's parser.
COMPILER_STACK = ("torch._dynamo", "torch._inductor", "triton")


def _import_times(*args: str) -> dict[str, int]:
    """Run ``python -X importtime *args`` in a fresh interpreter; cumulative microseconds by module name."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    times: dict[str, int] = {}
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
        if cumulative_us.strip().isdigit():
            times[name.strip()] = int(cumulative_us)
    return times


def _compiler_modules(times: dict[str, int]) -> list[str]:
    return sorted(n for n in times if any(n == p or n.startswith(p + ".") for p in COMPILER_STACK))


@pytest.mark.slow
def test_import_gefen_loads_no_compiler_and_costs_under_one_and_a_half_torch():
    times = _import_times("-c", "import gefen")
    assert _compiler_modules(times) == []
    assert "torch" in times and "gefen" in times
    ratio = times["gefen"] / times["torch"]  # gefen's cumulative time includes torch's
    assert ratio < 1.5, f"import gefen took {times['gefen']} us, {ratio:.2f}x import torch ({times['torch']} us)"


@pytest.mark.slow
def test_cli_help_loads_no_compiler():
    times = _import_times("-m", "gefen.cli.main", "--help")
    assert _compiler_modules(times) == []
    assert {"gefen.cli.demo", "gefen.cli.capacity", "gefen.cli.find_lr", "gefen.cli.inspect_cmd"} <= set(times)
