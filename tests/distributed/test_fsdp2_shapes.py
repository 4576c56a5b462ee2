"""Degenerate shapes under FSDP2 (issue 36): columns, thin matrices, 1-D tensors and N-D tensors with unit dimensions
keep about one byte of state per element on every rank, and stay the single-process optimizer.

Their rows are too short to hold a block (``gefen.math.period.layout_period``), so their blocks span rows and their
block state is sharded by blocks, not rows (``gefen.sharding.BlockShard``): every rank holds ``ceil(B / world)``
blocks, whichever rows it holds. Checked on 2 gloo ranks (3 for the uneven split): the trajectory equals one process
bit for bit (FSDP's averaged gradient ``(g + g) / 2`` is ``g``), the ranks' state bytes add up to the single process's
(plus each rank's counters), and a checkpoint moves between 1, 2 and 3 ranks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gefen
from gefen.state import PERIOD
from tests.distributed.harness import run_world
from tests.distributed.test_fsdp2 import full_params

pytestmark = pytest.mark.timeout(300)

#: name -> shape: a column, a thin matrix, a 1-D vector whose blocks do not split evenly, N-D with unit dimensions,
#: and an ordinary matrix (row-sharded as before).
SHAPES = {"col": (64, 1), "thin": (40, 3), "vec": (50,), "conv": (12, 2, 1, 1), "w": (24, 40)}
STEPS = 4


class Params(torch.nn.Module):
    """The shapes above as parameters; the loss is a row-scaled quadratic, so every row has its own scale."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)))

    def forward(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 + step)
        loss = torch.zeros(())
        for p in self.parameters():
            target = torch.randn(p.shape, generator=gen).to(p.dtype)
            scale = torch.logspace(-1, 1, p.shape[0]).reshape(-1, *([1] * (p.dim() - 1))).to(p.dtype)
            loss = loss + ((p - target).square() * scale).sum()
        return loss


def build(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "gefen":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.01)  # defaults: factored where it applies
    if kind == "gefen_block":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.01, factored_v_2d=False)
    matrices = [(n, p) for n, p in named if p.dim() == 2]
    return gefen.GefenMuon(matrices, lr=1e-2, normuon=True, sharded_mode=kind[5:])


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        loss = model(s)
        opt.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a codebook from few values warns
            opt.step()
        losses.append(loss.item())
    return losses


def _facts(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, object]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "periods": {names[id(p)]: int(s[PERIOD]) for p, s in opt.state.items()},
        "layouts": {row["name"]: row["layout"] for row in opt.state_report()},
        "bytes": {row["name"]: row["state_bytes"] for row in opt.state_report()},
        "numel": {names[id(p)]: (p.to_local() if hasattr(p, "to_local") else p).numel() for p in opt.state},
        "codebook": opt.codebook.clone(),
    }


def _single(kind: str, steps: int, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    model = Params(dtype)
    opt = build(kind, model)
    losses = train(model, opt, range(steps))
    return {"losses": losses, "params": full_params(model), **_facts(opt, model)}


def _sharded_job(rank: int, world: int, kind: str, steps: int, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    model = Params(dtype)
    fully_shard(model)
    opt = build(kind, model)
    losses = train(model, opt, range(steps))
    return {"losses": losses, "params": full_params(model), **_facts(opt, model)}


def test_degenerate_shapes_take_the_flattened_layout():
    reference = _single("gefen", 1)
    flattened = "blocks (flattened: degenerate shape)"
    assert {n: reference["layouts"][n] for n in ("col", "thin", "vec", "conv")} == dict.fromkeys(
        ("col", "thin", "vec", "conv"), flattened
    )
    assert reference["layouts"]["w"] == "factored"
    for name, shape in SHAPES.items():
        numel = reference["numel"][name]
        assert reference["periods"][name] > 8 and numel % reference["periods"][name] == 0
        assert reference["bytes"][name] <= 1.1 * numel + 8 * numel // reference["periods"][name] + 4 * sum(shape) + 16


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen", "gefen_block", "muon_exact", "muon_distributed"])
def test_fsdp2_on_two_ranks_equals_one_process_bit_for_bit_with_degenerate_shapes(kind):
    reference = _single(kind, STEPS)
    results = run_world(_sharded_job, 2, kind, STEPS)
    for r in results:
        assert r["losses"] == reference["losses"]
        assert r["periods"] == reference["periods"] and r["layouts"] == reference["layouts"]
        assert torch.equal(r["codebook"], reference["codebook"])
        for name, value in reference["params"].items():
            assert torch.equal(r["params"][name], value), (name, (r["params"][name] - value).abs().max())
    # the state is split, not copied: the ranks' bytes add up to one process's, plus each rank's int64 counters
    # (the ordinary matrix aside: its factored column moment is whole on every rank)
    counters = 24 if kind.startswith("muon") else 16
    for name in ("col", "thin", "vec", "conv") if kind.startswith("gefen") else ("col", "thin"):
        sharded = sum(r["bytes"][name] for r in results)
        assert reference["bytes"][name] <= sharded <= reference["bytes"][name] + counters, name


@pytest.mark.slow
def test_bf16_degenerate_shapes_on_two_ranks_equal_one_process_bit_for_bit():
    """bf16 parameters and gradients: the gathers of a block-sharded step carry them as float32 (exact both ways)."""
    reference = _single("gefen", STEPS, torch.bfloat16)
    for r in run_world(_sharded_job, 2, "gefen", STEPS, torch.bfloat16):
        assert r["losses"] == reference["losses"] and r["periods"] == reference["periods"]
        for name, value in reference["params"].items():
            assert value.dtype == torch.bfloat16 and torch.equal(r["params"][name], value), name


@pytest.mark.slow
def test_fsdp2_on_three_uneven_ranks_holds_about_a_byte_per_element_on_each_rank():
    """The column's 64 rows go 22, 22, 20 over 3 ranks, its blocks ``ceil(B / 3)`` per rank whichever rows a rank
    holds: each rank's bytes stay within that share of blocks, and the ranks' bytes add up to one process's."""
    reference = _single("gefen_block", STEPS)
    results = run_world(_sharded_job, 3, "gefen_block", STEPS)
    for r in results:
        assert r["periods"] == reference["periods"]
    for name in ("col", "thin", "vec", "conv"):
        period = reference["periods"][name]
        blocks = reference["numel"][name] // period
        share = -(-blocks // 3)  # ceil(B / 3) blocks at most per rank
        for r in results:
            assert r["bytes"][name] <= share * (period + 8) + 16, (name, r["bytes"][name])
        assert sum(r["bytes"][name] for r in results) <= reference["bytes"][name] + 2 * 16


def _save_job(rank: int, world: int, kind: str) -> dict[str, object]:
    """Train sharded, save the full state (DCP helpers), train on; return the checkpoint and the continuation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = Params()
    fully_shard(model)
    opt = build(kind, model)
    train(model, opt, range(STEPS))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))  # CPU: it shares the live tensors
    params = full_params(model)
    train(model, opt, range(STEPS, STEPS + 2))
    return {"saved": saved, "params": params, "after": full_params(model)}


def _resume_job(rank: int, world: int, kind: str, saved: dict, params: dict) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = Params()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    fully_shard(model)
    opt = build(kind, model)
    set_optimizer_state_dict(model, opt, saved, options=StateDictOptions(full_state_dict=True))
    train(model, opt, range(STEPS, STEPS + 2))
    return {"after": full_params(model), **_facts(opt, model)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gefen_block", "muon_exact"])
def test_degenerate_state_checkpoint_moves_from_two_ranks_to_three_and_to_one_process(kind):
    first = run_world(_save_job, 2, kind)[0]
    resumed = run_world(_resume_job, 3, kind, first["saved"], first["params"])
    for r in resumed:  # 3 ranks average (g + g + g) / 3: the rounding bound of test_one_optimizer
        for name, value in first["after"].items():
            moved = (value - first["params"][name]).abs().max()
            assert (r["after"][name] - value).abs().max() <= 0.02 * moved + 1e-7, name
    model = Params()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(first["params"][name])
    opt = build(kind, model)
    opt.load_state_dict(first["saved"])
    train(model, opt, range(STEPS, STEPS + 2))
    for name, value in first["after"].items():  # one process: the 2-rank run's continuation bit for bit
        assert torch.equal(dict(model.named_parameters())[name].detach(), value), name
