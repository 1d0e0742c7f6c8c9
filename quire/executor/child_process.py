"""Waiting on a child process's pipe without hanging on a child that died.

Both the worker processes (executor/multiproc.py) and the engine-core process
(engine/core_client.py) answer with ("kind", payload) messages; "error" carries a traceback.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

POLL_S = 1.0  # how often a wait checks that the child is still alive


def receive(
    pipe: Connection, process: multiprocessing.Process, name: str, died: type[Exception]
) -> Any:
    """The payload of the child's next message. Raises `died` within POLL_S of the child's
    death, and RuntimeError with the child's traceback when it reports an error."""
    while not pipe.poll(POLL_S):
        if not process.is_alive():
            raise died(f"The {name} process died (exit code {process.exitcode}).")
    try:
        kind, payload = pipe.recv()
    except (EOFError, ConnectionError) as error:
        raise died(f"The {name} process died: {error!r}") from error
    if kind == "error":
        raise RuntimeError(f"The {name} failed:\n{payload}")
    return payload
