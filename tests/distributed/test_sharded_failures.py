"""Deadlock-free preflight on FSDP2 (hardening.md §5.5, §5.6): a failure on one rank, a parameter missing its
gradient on one rank, or parameters in another order on one rank fail **every** rank with the same message,
well within 30 s, before any collective of the step and with nothing changed; a good step then works."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import gefen
from tests.distributed.harness import run_world
from tests.distributed.test_fsdp2 import batch, build, model_fn
from tests.optim.determinism_job import digest

pytestmark = pytest.mark.timeout(300)


def _local(obj: object) -> object:
    """Replace DTensors by their local parts and drop the ``skipped_steps`` counters (for digests of what a step
    must leave unchanged; the counter is compared on its own)."""
    if hasattr(obj, "to_local"):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items() if k != "skipped_steps"}
    if isinstance(obj, (list, tuple)):
        return [_local(v) for v in obj]
    return obj


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    return digest([_local(model.state_dict()), _local(opt.state_dict())])


def _backward(model: torch.nn.Module, step: int) -> None:
    tokens = batch(step)
    loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.reshape(-1))
    loss.backward()


def _nan_on_one_rank(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, rank: int, bad_rank: int):
    """Step with a NaN in this rank's rows of ``name``'s gradient on ``bad_rank`` only (then restore it):
    ``nonfinite="skip"`` (the default) must skip the step on every rank. Returns ``(unchanged, skipped_steps,
    skip warnings)``."""
    local = dict(model.named_parameters())[name].grad.to_local().view(-1)
    kept = local[0].clone()
    if rank == bad_rank:
        local[0] = float("nan")
    before = _snapshot(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    local[0] = kept
    messages = [str(w.message) for w in caught if "skipped this step" in str(w.message)]
    return _snapshot(model, opt) == before, opt.skipped_steps, messages


def _hybrid_nan_job(rank: int, world: int, kind: str) -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    model = model_fn()
    fully_shard(model)
    opt = build(kind, model)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    _backward(model, 1)
    out = {
        "backup": _nan_on_one_rank(model, opt, "0.weight", rank, 1),  # the embedding: backup half
        "muon": _nan_on_one_rank(model, opt, "1.weight", rank, 0),
    }
    before = _snapshot(model, opt)
    opt.step()
    out["good_step_changed"] = _snapshot(model, opt) != before
    return out


@pytest.mark.parametrize("kind", ["hybrid_gefen", "hybrid_adamw"])
def test_a_nan_on_one_rank_skips_both_hybrid_halves_on_every_rank(kind):
    results = run_world(_hybrid_nan_job, 2, kind, timeout_s=120)
    for rank, r in enumerate(results):
        for half, bad_rank, count in (("backup", 1, 1), ("muon", 0, 2)):
            unchanged, skipped, messages = r[half]
            assert unchanged and skipped == count and len(messages) == 1, (rank, half, r[half])
            named = ("0.weight" if half == "backup" else "1.weight") in messages[0]
            assert named == (rank == bad_rank), messages[0]
        assert r["good_step_changed"]


def _failures_job(rank: int, world: int, kind: str) -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    model = model_fn()
    fully_shard(model)
    opt = build(kind, model)
    _backward(model, 0)
    opt.step()  # state exists: the failures below hit initialized steps
    opt.zero_grad()
    out: dict[str, object] = {}

    def attempt(label: str, optimizer: torch.optim.Optimizer, closure=None) -> None:
        before = _snapshot(model, opt)
        started = time.monotonic()
        try:
            optimizer.step(closure)
            out[label] = ("no error", 0.0, True)
        except gefen.StepError as exc:
            out[label] = (str(exc), time.monotonic() - started, _snapshot(model, opt) == before)

    _backward(model, 1)
    if rank == 1:  # this rank lost one gradient (e.g. a frozen layer on one rank only)
        model[1].weight.grad = None
    attempt("presence", opt)
    opt.zero_grad()

    _backward(model, 2)
    named = list(model.named_parameters())
    order = named if rank == 0 else named[::-1]
    if kind == "gefen":
        other = gefen.Gefen(order, lr=1e-2, fused=False, factored_v_2d=False)
    else:
        hidden = [(n, p) for n, p in order if p.dim() == 2 and not n.startswith("0.")]
        other = gefen.GefenMuon(hidden, lr=1e-2, sharded_mode=kind[5:], fused=False)
    attempt("order", other)

    def closure() -> float:  # no collectives inside: the failure is purely local
        if rank == 1:
            raise RuntimeError("data loader exhausted on this rank")
        return 1.0

    attempt("closure", opt, closure)
    out["nan_skip"] = _nan_on_one_rank(model, opt, "1.weight", rank, 1)
    before = _snapshot(model, opt)
    opt.step()  # gradients of step 2 are still there: a good step goes through on every rank
    out["good_step_changed"] = _snapshot(model, opt) != before
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "muon_exact", "muon_distributed"])
def test_one_rank_failures_fail_every_rank_with_one_message(kind):
    results = run_world(_failures_job, 2, kind, timeout_s=120)
    expected = {
        "presence": "gradient presence differs across ranks: 1.weight (1/2 ranks have a gradient)",
        "order": "the sharded parameters differ across ranks at position 0",
        "closure": "failed on rank 1 of 2",
    }
    for label, text in expected.items():
        messages = [r[label][0] for r in results]
        assert text in messages[0], (label, messages[0])
        assert messages[0] == messages[1], label
        assert all(r[label][1] < 30.0 for r in results)
        assert all(r[label][2] for r in results), f"{label}: something changed"
    assert "data loader exhausted on this rank" in results[0]["closure"][0]
    assert all(r["good_step_changed"] for r in results)
    for rank, r in enumerate(results):
        unchanged, skipped, messages = r["nan_skip"]
        assert unchanged and skipped == 1 and len(messages) == 1, (rank, r["nan_skip"])
        assert ("1.weight" in messages[0]) == (rank == 1), messages[0]
        assert rank == 1 or "a gradient on another rank" in messages[0]
