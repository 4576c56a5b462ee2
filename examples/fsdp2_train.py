"""Train a small model sharded with FSDP2 (``fully_shard``) and a Gefen optimizer, save a full checkpoint, and
resume it (CPU/gloo or CUDA/nccl).

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --optimizer gefen --steps 40 --save ckpt.pt
    torchrun --nproc-per-node 3 examples/fsdp2_train.py --optimizer gefen --steps 20 --resume ckpt.pt

Every parameter is a ``Shard(0)`` DTensor; the optimizer keeps its state sharded the same way (about 1 byte per
parameter on each rank for its own rows). Checkpoints go through ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True``: the state is
independent of the world size, so a checkpoint saved on N ranks resumes on M.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _exit import leave  # examples/_exit.py, beside this script
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import gefen

VOCAB = 256


def build(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer (the hybrid, like Gefen, goes to the DCP helpers as itself)."""
    if name == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=lr, weight_decay=0.01)
    if name == "muon":
        return gefen.GefenMuonHybrid(model, lr=lr, backup_optimizer="gefen", sharded_mode="distributed")
    raise SystemExit(f"unknown --optimizer {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=["gefen", "muon"], default="gefen")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default=None, help="write a full checkpoint here at the end (rank 0)")
    parser.add_argument("--resume", default=None, help="resume from a full checkpoint (any world size)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, VOCAB)
    ).to(device)
    for layer in (model[1], model[3]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = build(args.optimizer, model, args.lr)
    full = StateDictOptions(full_state_dict=True)
    first = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        set_model_state_dict(model, ckpt["model"], options=full)
        set_optimizer_state_dict(model, optimizer, ckpt["optim"], options=full)
        first = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {first} on {world} ranks", flush=True)
    for step in range(first, first + args.steps):
        gen = torch.Generator().manual_seed(step)  # the same batch on every rank: FSDP averages the gradients
        tokens = torch.randint(0, VOCAB, (8, 32), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == first + args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    if args.save:
        offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=offload)  # collective: every rank calls it
        osd = get_optimizer_state_dict(model, optimizer, options=offload)
        if rank == 0:
            torch.save({"model": msd, "optim": osd, "step": first + args.steps}, args.save)
            print(f"saved {args.save}")
    dist.barrier()  # free everything that talks to the process group before destroying it
    del optimizer, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
