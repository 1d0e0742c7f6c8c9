"""The OpenMP worker threads of the process: torch's CPU ops and quire's C kernels share one
OpenMP runtime (libgomp, in torch's Linux wheels).

libgomp keeps a pool of worker threads for each thread that has started a parallel region. While
it manages more threads than there are CPUs, its workers spin only ~100 iterations after a
region instead of GOMP_SPINCOUNT's, so they fall asleep between the short parallel regions of a
decode step and every region pays a futex wake-up. That happens as soon as a second thread runs
parallel regions: a server whose main thread loaded the model while the engine thread runs the
steps. Measured on 2 cores (SmolLM2-135M, bf16, one 200-token request through AsyncLLM): 2.2-2.8 s
with the main thread's pool alive, 1.5 s once it was released, as offline. The C decode step
took 10.2-10.7 ms on the second thread against 6.6-6.9 ms on the first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing across the pause
_RUNTIMES = ("libgomp", "libomp", "libiomp")


def _loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    paths: dict[str, None] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if path.startswith("/") and os.path.basename(path).startswith(_RUNTIMES):
                paths[path] = None
    return list(paths)


def release_openmp_threads() -> bool:
    """Ends the OpenMP worker threads of the calling thread's pool (OpenMP 5.0
    `omp_pause_resource_all(omp_pause_soft)`), so that another thread's parallel regions are
    the only ones the runtime manages. The pool is built again if this thread starts another
    parallel region. Returns whether a loaded runtime took the call."""
    released = False
    for path in _loaded_openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        if pause(_OMP_PAUSE_SOFT) == 0:
            released = True
        else:
            logger.debug("%s did not release its OpenMP threads", path)
    return released
