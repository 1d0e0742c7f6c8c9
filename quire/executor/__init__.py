"""The executors (base.py: the interface the engine core sees) and the choice among them."""

from __future__ import annotations

from quire.config import QuireConfig
from quire.executor.base import Executor


def make_executor(config: QuireConfig) -> Executor:
    """The executor `distributed_executor_backend` names. Each is imported when chosen: `uni`
    loads the worker into this process, which with `mp` only the rank processes import; only
    `ray` imports Ray."""
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from quire.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from quire.executor.ray import RayExecutor

        return RayExecutor(config)
    from quire.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
