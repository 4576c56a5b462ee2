"""Train a small model with DistributedDataParallel and gefen.Gefen (CPU/gloo or CUDA/nccl).

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 50

Each rank builds the same model, DDP all-reduces the gradients, and every rank steps its own optimizer: Gefen adds
no collectives. With ``deterministic=True`` the replicas stay bit-identical; the script checks that at the end by
comparing a SHA-256 of the parameters and optimizer state across ranks, and rank 0 saves a checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import io

import torch
import torch.distributed as dist
from _exit import leave  # examples/_exit.py, beside this script
from torch.nn.parallel import DistributedDataParallel

import gefen


def _sha256(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default=None, help="optional path for rank 0's optimizer checkpoint")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    ).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = gefen.Gefen(model.named_parameters(), lr=args.lr, weight_decay=0.01, deterministic=True)
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step * world + rank)  # each rank its own batch
        tokens = torch.randint(0, 256, (8, 32), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(
            ddp(tokens).reshape(-1, 256), tokens.reshape(-1)
        )  # learn the identity: the loss must fall
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    digest = _sha256([model.state_dict(), optimizer.state_dict()])
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    same = len(set(digests)) == 1
    if rank == 0:
        print(f"replicas bit-identical across {world} ranks: {same}")
        if args.save:
            torch.save(optimizer.state_dict(), args.save)
    # Tear DDP down while the process group is alive: freeing its gradient reducer after destroy_process_group()
    # can hang a gloo rank at exit.
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    if rank == 0 and not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    leave()
