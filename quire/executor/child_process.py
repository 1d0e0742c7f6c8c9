"""Waiting on a child process's pipe without hanging on a child that died.

Both the worker processes (executor/multiproc.py) and the engine-core process
(engine/core_client.py) answer with ("kind", payload) messages; "error" carries a traceback,
and for a child that could not start because of what it was given (a broken model file, an
adapter or a value that does not fit: a ValueError or FileNotFoundError) the error itself, which
the parent raises as it is, so the user gets its one line.
"""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.connection import Connection
from typing import Any

POLL_S = 1.0  # how often a wait checks that the child is still alive


def error_message(error: BaseException) -> tuple[str, BaseException | None]:
    """An "error" payload for `error`, raised in the child (call in its except block)."""
    told = error if isinstance(error, (ValueError, FileNotFoundError)) else None
    return traceback.format_exc(), told


def receive(
    pipe: Connection,
    process: multiprocessing.Process,
    name: str,
    died: type[Exception],
    noun: str = "process",
) -> Any:
    """The payload of the child's next message. Raises `died` within POLL_S of the child's
    death, and RuntimeError with the child's traceback when it reports an error. `process`:
    anything with is_alive() and exitcode (a Ray actor's stand-in, whose `noun` is "actor")."""
    while not pipe.poll(POLL_S):
        if not process.is_alive():
            raise died(f"The {name} {noun} died (exit code {process.exitcode}).")
    try:
        kind, payload = pipe.recv()
    except (EOFError, ConnectionError) as error:
        raise died(f"The {name} {noun} died: {error!r}") from error
    if kind == "error":
        trace, told = payload if isinstance(payload, tuple) else (payload, None)
        if told is not None:
            told.add_note(f"In the {name} process:\n{trace}")
            raise told
        raise RuntimeError(f"The {name} failed:\n{trace}")
    return payload
