"""All-reduce micro-benchmark: the shared-memory all-reduce against gloo over loopback, two ranks
on one host, each pinned to its share of the cores as the engine's ranks are.

    python scripts/bench_all_reduce.py [--ranks 2] [--rounds 7] [--iters 200] [--dtype bfloat16]

For each tensor size (rows x 576, SmolLM2's hidden size; one row is a batch-1 decode step's
all-reduce) the two transports alternate in rounds inside one run; rank 0 prints the median
and the spread of the per-call time over the rounds, and the ratio gloo / shm. Then the same
for the all-gather of a decode step's logits (rows x the vocabulary share of a rank). With
`--dtype bfloat16`, also the C all-reduce the decode step runs over the same file
(quire/kernels/cpu/shm_all_reduce.c) against gloo.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quire.distributed import parallel_state
from quire.executor.multiproc import free_port, rank_cores
from quire.kernels import cpu as cpu_kernels
from quire.worker.worker import pin_rank

HIDDEN = 576
VOCAB = 49152
ROWS = (1, 8, 32, 256, 2048)
LOGIT_ROWS = (1, 8)


def _time(fn, x: torch.Tensor, iters: int) -> float:
    """Seconds per call, after a warm-up; a barrier first so both ranks start together."""
    for _ in range(10):
        fn(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - start) / iters


def _gloo_gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def _main(rank: int, ranks: int, port: int, rounds: int, iters: int, dtype: str) -> None:
    pin_rank(parallel_state.RankPlacement(rank, ranks, port, rank_cores(rank, ranks)))
    dtype_ = getattr(torch, dtype)
    slot = max(ROWS) * HIDDEN * 4
    parallel_state.init_tensor_parallel(rank, ranks, port, "cpu", shm_bytes=slot)
    shm = parallel_state._group.shm
    cases = [("all_reduce", rows, HIDDEN, shm.all_reduce, dist.all_reduce) for rows in ROWS]
    cases += [
        ("all_gather", rows, VOCAB // ranks, shm.all_gather_last_dim, _gloo_gather)
        for rows in LOGIT_ROWS
    ]
    if dtype_ == torch.bfloat16 and cpu_kernels.load_library() is not None:
        group = cpu_kernels.ShmGroup(shm.address, shm.slot_bytes, shm.rank, shm.world_size)

        def c_all_reduce(x: torch.Tensor) -> None:
            cpu_kernels.shm_all_reduce_bf16(group, x)

        cases += [("c_all_reduce", rows, HIDDEN, c_all_reduce, dist.all_reduce) for rows in ROWS]
    for op, rows, cols, shm_op, gloo_op in cases:
        x = torch.randn(rows, cols).to(torch.float32 if op == "all_gather" else dtype_)
        times = {"shm": [], "gloo": []}
        for _ in range(rounds):
            times["shm"].append(_time(shm_op, x, iters))
            times["gloo"].append(_time(gloo_op, x, iters))
        if rank == 0:
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            spread = {k: (min(v) * 1e6, max(v) * 1e6) for k, v in times.items()}
            ratios = sorted(g / s for g, s in zip(times["gloo"], times["shm"]))
            print(
                f"{op} {rows:5d} x {cols:5d} {x.dtype} {x.nbytes / 1024:8.1f} KiB | "
                f"shm {med['shm']:8.1f} us ({spread['shm'][0]:.1f}-{spread['shm'][1]:.1f}) | "
                f"gloo {med['gloo']:8.1f} us ({spread['gloo'][0]:.1f}-{spread['gloo'][1]:.1f}) "
                f"| gloo/shm {statistics.median(ratios):5.2f}x "
                f"({ratios[0]:.2f}-{ratios[-1]:.2f})",
                flush=True,
            )
    parallel_state.destroy_tensor_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    mp.spawn(
        _main,
        args=(args.ranks, free_port(), args.rounds, args.iters, args.dtype),
        nprocs=args.ranks,
    )


if __name__ == "__main__":
    main()
