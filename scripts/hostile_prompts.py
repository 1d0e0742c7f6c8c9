"""Hostile prompts against a running server: while they are in flight, how long do /health and a
5-token completion take? Prints each case's answers and the probes' latencies.

Cases: one 12 MB prompt; three 3.9 MB prompts (over any context's character bound); one prompt
just under the default model's character bound (8192 tokens x 81 characters), which is really
tokenized.

    quire serve --port 8000 &
    .venv/bin/python scripts/hostile_prompts.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import httpx

_MAX_PROMPT_CHARS = 8192 * 81  # SmolLM2: max_model_len x its longest token string


def _summary(latencies: list[float]) -> str:
    median, worst = statistics.median(latencies) * 1e3, max(latencies) * 1e3
    return f"median {median:.1f} ms, max {worst:.1f} ms (n={len(latencies)})"


def _send(url: str, body: bytes, answers: list[tuple[int, str, float]]) -> None:
    """Posts `body`; appends (status, error code, seconds) to `answers`."""
    start = time.perf_counter()
    response = httpx.post(
        url + "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=300,
    )
    code = response.json().get("error", {}).get("code")
    answers.append((response.status_code, code, round(time.perf_counter() - start, 2)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    url = args.base_url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    prober = httpx.Client(timeout=300)

    def probe(keep_going: Callable[[int], bool]) -> tuple[list[float], list[float]]:
        """/health every 10 ms on a thread of its own, completions one after another here."""
        health: list[float] = []
        completion: list[float] = []

        def probe_health() -> None:
            with httpx.Client(timeout=300) as client:
                while keep_going(len(completion)):
                    start = time.perf_counter()
                    assert client.get(url + "/health").status_code == 200
                    health.append(time.perf_counter() - start)
                    time.sleep(0.01)

        health_prober = threading.Thread(target=probe_health)
        health_prober.start()
        while keep_going(len(completion)):
            start = time.perf_counter()
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 5}
            assert prober.post(url + "/v1/completions", json=body).status_code == 200
            completion.append(time.perf_counter() - start)
        health_prober.join()
        return health, completion

    health, completion = probe(lambda n: n < 10)
    print(f"quiet: /health {_summary(health)}; completion {_summary(completion)}")
    cases = {
        "one 12 MB prompt": [4_000_000],
        "three 3.9 MB prompts": [1_300_000] * 3,
        "one prompt just under the character bound": [_MAX_PROMPT_CHARS // 3 - 1000],
    }
    for name, repeats in cases.items():
        bodies = [json.dumps({"model": model, "prompt": "hi " * n}).encode() for n in repeats]
        answers: list[tuple[int, str, float]] = []
        senders = [threading.Thread(target=_send, args=(url, b, answers)) for b in bodies]
        for sender in senders:
            sender.start()
        health, completion = probe(lambda _, senders=senders: any(s.is_alive() for s in senders))
        print(f"{name}: answered {answers} (status, code, s)")
        print(f"  meanwhile /health {_summary(health)}; completion {_summary(completion)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
