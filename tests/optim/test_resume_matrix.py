"""Bit-exact resume for Gefen, GefenMuon and GefenMuonHybrid × {fp32, bf16} × {eager, compiled} ×
{deterministic on, off} (issue 5 acceptance). Schema-v1 checkpoints (committed fixtures) resuming where the v1 code
went are in ``tests/test_checkpoint.py``.

"Bit-exact": train 4 steps without interruption, versus 2 steps → ``state_dict`` → ``torch.save``/``torch.load``
(weights_only) → a brand-new model and optimizer → ``load_state_dict`` → 2 more steps; the SHA-256 digests of the
parameters, of the optimizer's full state dict and of the codebook must be identical.
"""

from __future__ import annotations

import io

import pytest
import torch

import gefen
from tests.optim.determinism_job import digest


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    )
    return model.to(dtype)


def _build(kind: str, model: torch.nn.Module, backend: str, deterministic: bool) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(
            model.named_parameters(), lr=3e-3, weight_decay=0.01, backend=backend, deterministic=deterministic
        )
    if kind == "gefen_muon":
        hidden = [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("0.")]
        return gefen.GefenMuon(hidden, lr=3e-3, normuon=True, backend=backend, deterministic=deterministic)
    return gefen.GefenMuonHybrid(model, lr=3e-3, backend=backend, deterministic=deterministic)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(1000 + s)
        tokens = torch.randint(0, 32, (4, 6), generator=gen)
        loss = model(tokens).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _codebooks(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    children = [opt.muon, opt.backup] if isinstance(opt, gefen.GefenMuonHybrid) else [opt]
    return [getattr(c, "codebook", None) for c in children if c is not None]


CASES = [
    pytest.param(
        kind,
        dtype,
        backend,
        det,
        marks=[pytest.mark.slow] if backend == "compiled" else [],
        id=f"{kind}-{name}-{backend}-det{det}",
    )
    for kind in ("gefen", "gefen_muon", "hybrid")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    for backend in ("eager", "native", "compiled")
    for det in (True, False)
]


@pytest.mark.parametrize(("kind", "dtype", "backend", "deterministic"), CASES)
def test_resume_is_bit_exact(kind, dtype, backend, deterministic):
    whole_model = _model(dtype)
    whole = _build(kind, whole_model, backend, deterministic)
    _train(whole_model, whole, range(4))

    first_model = _model(dtype)
    first = _build(kind, first_model, backend, deterministic)
    _train(first_model, first, range(2))
    saved_params = _roundtrip(first_model.state_dict())
    saved_opt = _roundtrip(first.state_dict())

    resumed_model = _model(dtype)
    resumed_model.load_state_dict(saved_params)
    resumed = _build(kind, resumed_model, backend, deterministic)
    resumed.load_state_dict(saved_opt)
    _train(resumed_model, resumed, range(2, 4))

    assert digest(resumed_model.state_dict()) == digest(whole_model.state_dict())
    assert digest(resumed.state_dict()) == digest(whole.state_dict())
    assert digest(_codebooks(resumed)) == digest(_codebooks(whole))
    assert all(cb is not None for cb in _codebooks(resumed))
