"""``deterministic=True``: bit-identical parameters, state and codebook for identical inputs, the first step (period
search and codebook) included, in-process, in a fresh process and compiled. The policy recorded in checkpoints is
in ``tests/test_checkpoint.py`` and ``tests/test_checkpoint_hybrid.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optim.determinism_job import run

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["gefen", "gefen_muon", "hybrid"]


@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_runs_are_bit_identical_including_the_first_step(kind, backend):
    first, second = run(kind, backend), run(kind, backend)
    assert first == second
    assert run(kind, backend, steps=1) == run(kind, backend, steps=1)  # period search + codebook alone


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_digest_is_the_same_in_a_fresh_process(kind, backend):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GEFEN_FUSED": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.optim.determinism_job", kind, backend],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == run(kind, backend)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_compiled_runs_are_bit_identical(kind):
    assert run(kind, "compiled") == run(kind, "compiled")
