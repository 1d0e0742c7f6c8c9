"""release_openmp_threads ends the calling thread's OpenMP workers, and the runtime builds them
again when the thread next runs a parallel region. Checked in a fresh interpreter, whose only
threads are the main thread and its OpenMP pool."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.get_num_threads() < 2,
    reason="counts threads in /proc; needs an OpenMP pool of 2 or more threads",
)

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    from quire.engine.host_threads import release_openmp_threads

    def num_threads():
        return len(os.listdir("/proc/self/task"))

    def run_parallel_region():
        x = torch.ones(1 << 22)
        for _ in range(4):
            x.mul_(1.0)

    run_parallel_region()
    with_pool = num_threads()
    released = release_openmp_threads()
    deadline = time.monotonic() + 5.0
    while num_threads() == with_pool and time.monotonic() < deadline:
        time.sleep(0.01)
    after_release = num_threads()
    run_parallel_region()
    print(with_pool, released, after_release, num_threads(), torch.get_num_threads())
    """
)


def test_release_ends_the_calling_threads_openmp_workers_until_the_next_region():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    with_pool, released, after_release, after_region, pool_size = result.stdout.split()
    workers = int(pool_size) - 1
    assert released == "True"
    assert int(after_release) == int(with_pool) - workers
    assert int(after_region) == int(with_pool)
