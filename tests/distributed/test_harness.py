"""The multi-process harness fails fast: a rank's exception or a deadlock fails the test within its deadline."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import WorldFailed, run_world


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _deadlock(rank: int, world_size: int) -> None:
    if rank == 0:  # rank 1 never joins this collective
        dist.all_reduce(torch.ones(1))
    time.sleep(3600)


def _sum(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def test_world_returns_results_by_rank():
    assert run_world(_sum, 2) == [3.0, 3.0]


def test_a_rank_exception_fails_the_test():
    with pytest.raises(WorldFailed, match="rank 1: ValueError: boom on rank 1"):
        run_world(_raise_on_rank1, 2)


@pytest.mark.slow
def test_a_deadlock_fails_within_the_deadline():
    started = time.monotonic()
    with pytest.raises(WorldFailed, match="deadline"):
        run_world(_deadlock, 2, timeout_s=15)
    assert time.monotonic() - started < 30
