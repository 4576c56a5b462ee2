"""FSDP2 with ``CPUOffloadPolicy`` (issue 37): Gefen and GefenMuon step offloaded ``Shard(0)`` DTensor shards on
2 gloo ranks (CPU; ``pin_memory=False``, as there is no CUDA).

Each rank trains the same model twice, fully sharded with and without the offload policy, on the same batches:
the parameters, the losses and every rank's optimizer state (codes, magnitudes, second moments, NorMuon's rows,
counters, codebook) are equal bit for bit, since the step does the same math on the same local shards. Every
parameter's shard is stepped by the native backend (``state_report()``'s ``backend``), never by the eager one.
The cases: Gefen with its default factored second moment and with the block one, and GefenMuon (``exact``, NorMuon)
on the hidden matrices; the model has uneven row splits (45 rows: 23/22) and 1-D tensors whose blocks span rows
(sharded by blocks, stepped through the block gathers). A full-state checkpoint through
``torch.distributed.checkpoint``'s helpers resumes under offload bit for bit.

One world runs every case (a module fixture), so the file spawns two processes once. On a GPU machine
(``scripts/gpu_check.sh``) one more test runs FSDP2's usual offload, a CUDA mesh with CPU shards, on a process group
without a CPU backend (NCCL only), against the same run with gloo for the CPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gefen
from gefen.sharding import SHARDED_KEYS
from tests.distributed.harness import run_world

pytestmark = pytest.mark.timeout(300)

VOCAB = 64
KINDS = ("gefen", "gefen_block", "muon_exact")
STEPS = 6
#: the checkpoint case: steps before the save, then after it (compared with the same run uninterrupted)
BEFORE, AFTER = 3, 3


def _model(offload: bool, mesh: Any = None) -> torch.nn.Module:
    """A tiny LM, fully sharded (with ``CPUOffloadPolicy`` when ``offload``: ``pin_memory`` on a CUDA mesh): 45
    hidden rows split 23/22, a LayerNorm and a bias (1-D: blocks span rows). ``mesh``: a CPU mesh over every rank
    when ``None`` (FSDP's default would be a CUDA one wherever a GPU is visible)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32),
        torch.nn.Linear(32, 45, bias=True),
        torch.nn.LayerNorm(45),
        torch.nn.GELU(),
        torch.nn.Linear(45, VOCAB, bias=False),
    )
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    pinned = mesh.device_type == "cuda"  # pinned host memory needs CUDA
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pinned) if offload else OffloadPolicy())
    return model


def _build(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "gefen":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.01)  # defaults: factored 2-D moment, backend="auto"
    if kind == "gefen_block":
        return gefen.Gefen(named, lr=1e-2, weight_decay=0.01, factored_v_2d=False)
    hidden = [(n, p) for n, p in named if p.dim() == 2 and not n.startswith("0.")]  # not the embedding
    return gefen.GefenMuon(hidden, lr=5e-2, normuon=True, sharded_mode=kind.split("_")[1])


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, device: str = "cpu") -> list[float]:
    """Steps on fixed batches (on ``device``, where the mesh computes); the target is the token itself (learnable:
    the loss must fall)."""
    losses = []
    for s in steps:
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(s)).to(device)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a codebook from few values warns
            opt.step()
        losses.append(loss.item())
    return losses


def _facts(model: torch.nn.Module, opt: torch.optim.Optimizer, losses: list[float]) -> dict[str, Any]:
    """What the comparisons read: this rank's shards of the parameters and of the state (local tensors: every rank
    compares its own), backends and devices."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        names[id(p)]: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
        for p, st in opt.state.items()
    }
    return {
        "losses": losses,
        "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
        "state": state,
        "codebook": opt.codebook.clone(),
        "global_step": opt.global_step,
        "backends": {row["name"]: row["backend"] for row in opt.state_report()},
        "devices": sorted({str(p.to_local().device) for p in model.parameters()}),
        # the state sharded like the parameter (gefen.sharding): DTensors whose local tensors are on the CPU
        "sharded_state": all(
            type(v).__name__ == "DTensor" and v.to_local().device.type == "cpu"
            for st in opt.state.values()
            for k, v in st.items()
            if k in SHARDED_KEYS
        ),
    }


def _resume(path: str) -> dict[str, Any]:
    """Train ``BEFORE`` steps offloaded, save the full model and optimizer state (rank 0, to ``path``), train
    ``AFTER`` more; a fresh offloaded model and optimizer load the checkpoint and train the same ``AFTER`` steps."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = _model(offload=True)
    opt = _build("gefen", model)
    _train(model, opt, range(BEFORE))
    saved = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
    }
    if dist.get_rank() == 0:
        torch.save(saved, path)
    dist.barrier()
    straight = _facts(model, opt, _train(model, opt, range(BEFORE, BEFORE + AFTER)))

    model = _model(offload=True)
    opt = _build("gefen", model)
    ckpt = torch.load(path, weights_only=True)
    load = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, ckpt["model"], options=load)
    set_optimizer_state_dict(model, opt, ckpt["optim"], options=load)
    resumed = _facts(model, opt, _train(model, opt, range(BEFORE, BEFORE + AFTER)))
    return {"straight": straight, "resumed": resumed}


def _world_job(rank: int, world: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        out[kind] = {}
        for offload in (False, True):
            model = _model(offload)
            opt = _build(kind, model)
            out[kind][offload] = _facts(model, opt, _train(model, opt, range(STEPS)))
    out["resume"] = _resume(path)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = Path(tmp_path_factory.mktemp("offload"), "ckpt.pt")
    return run_world(_world_job, 2, str(path), timeout_s=240)


def _assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"]
    assert torch.equal(got["codebook"], want["codebook"])
    assert got["global_step"] == want["global_step"]
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), (name, (got["params"][name] - value).abs().max())
    assert got["state"].keys() == want["state"].keys()
    for name, state in want["state"].items():
        assert got["state"][name].keys() == state.keys(), name
        for key, value in state.items():
            mine = got["state"][name][key]
            assert mine.dtype == value.dtype and torch.equal(mine, value), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_step_equals_the_step_without_offload_bit_for_bit(world, kind):
    for rank, result in enumerate(world):
        plain, offloaded = result[kind][False], result[kind][True]
        assert offloaded["devices"] == ["cpu"] and offloaded["sharded_state"], rank
        assert len(offloaded["state"]) == (2 if kind.startswith("muon") else 6)  # every parameter it steps
        _assert_same_run(offloaded, plain)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_shards_step_on_the_native_backend(world, kind):
    for result in world:
        backends = result[kind][True]["backends"]
        assert backends and set(backends.values()) == {"native"}, backends


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_training_lowers_the_loss(world, kind):
    losses = world[0][kind][True]["losses"]
    assert all(r[kind][True]["losses"] == losses for r in world)  # every rank sees the same (averaged) loss
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow
def test_offloaded_checkpoint_resumes_bit_for_bit(world):
    for result in world:
        resumed, straight = result["resume"]["resumed"], result["resume"]["straight"]
        assert resumed["global_step"] == BEFORE + AFTER
        assert set(resumed["backends"].values()) == {"native"}
        _assert_same_run(resumed, straight)


def _cuda_mesh_job(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's usual offload: a CUDA mesh computing on the GPU, the shards, their gradients and the optimizer on the
    CPU (pinned)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    out = {}
    for kind in ("gefen", "muon_exact"):
        model = _model(offload=True, mesh=mesh)
        opt = _build(kind, model)
        out[kind] = _facts(model, opt, _train(model, opt, range(STEPS), device="cuda"))
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
def test_cuda_mesh_with_offloaded_shards_steps_natively_on_an_nccl_only_group():
    """The optimizer's collectives travel on the mesh's device (``gefen.sharding.collective_device``), so a process
    group without a CPU backend (``init_process_group("nccl")``) steps the CPU shards as one with gloo for the CPU
    does, bit for bit, on the native backend."""
    nccl = run_world(_cuda_mesh_job, 1, timeout_s=240, backend="nccl")[0]
    with_gloo = run_world(_cuda_mesh_job, 1, timeout_s=240, backend="cpu:gloo,cuda:nccl")[0]
    for kind, facts in nccl.items():
        assert facts["devices"] == ["cpu"] and facts["sharded_state"], kind
        assert set(facts["backends"].values()) == {"native"}, facts["backends"]
        assert facts["losses"][-1] < 0.9 * facts["losses"][0], facts["losses"]
        _assert_same_run(facts, with_gloo[kind])


@pytest.mark.slow
def test_offload_benchmark_prints_its_json_object():
    """``benchmarks/fsdp2_offload_step.py`` on the tiny set (2 pairs): one JSON object with both rows, every shard
    stepped natively, AdamW's 8 bytes/param (its two fp32 moments) and Gefen's ~1; no assertion on the times."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp2_offload_step.py"
    args = [sys.executable, str(script), "--size", "tiny", "--steps", "2", "--warmup", "1", "--timeout", "200"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["world_size"] == 2 and report["local_shard_device"] == "cpu"
    assert report["offload_policy"] == "CPUOffloadPolicy(pin_memory=False)"
    gefen_row, adamw_row = report["results"]["gefen"], report["results"]["adamw_fused"]
    assert gefen_row["backends"] == {"native": 20}  # tiny: embedding + 2 layers x 9 + the final norm
    assert 8.0 <= adamw_row["state_bytes_per_param"] < 8.01
    assert 1.0 <= gefen_row["state_bytes_per_param"] < 1.2
    assert report["ratio_gefen_vs_adamw_fused"] > 0 and gefen_row["opt_step_time_s"] > 0
