"""Soak test: `quire serve` under a long stream of mixed clients; afterwards it must be idle, with
every KV block free, and its memory must have stopped growing.

Starts the server as a subprocess on loopback and sends requests that arrive as a Poisson process
at `--rate` per second for `--duration` seconds. Each request is one kind of client, drawn at
random:
  stream    a streaming completion, read to its end
  complete  a non-streaming completion or chat completion
  cancel    a streaming completion closed after its first chunk (the server aborts it)
  deadline  a completion with a `timeout` far shorter than its generation (504)
  invalid   malformed JSON, an unknown field, a token id out of range, a prompt over the context
            (400), or a body over --max-request-bytes (413)
Any kind may also get 503 (the server's --max-queued-requests is small, so bursts hit it); any
other status, a stream without its end, or a transport error counts as unexpected.

The server's RSS is sampled throughout. glibc keeps freed memory, so the start says little; what
matters is the peak of the last third of the run against the peak of the second third.

    .venv/bin/python scripts/soak.py --duration 600 --rate 4          # SmolLM2, the docs' run
    .venv/bin/python scripts/soak.py --model path/to/tiny --duration 60 --rate 10 \
        --num-kv-blocks 1024                                # other options go to `quire serve`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

KINDS = ("stream", "complete", "cancel", "deadline", "invalid")
_WORDS = "the a quick brown fox jumps over lazy dog river stone light paper song".split()
_RSS_INTERVAL_S = 0.25
# A small batch and queue, so that bursts of arrivals reach the 503 path too.
SERVER_ARGS = ("--max-num-seqs", "16", "--max-queued-requests", "16")


@dataclass
class SoakResult:
    num_requests: int
    seconds: float  # arrivals and the drain after them
    statuses: dict[str, dict[int, int]]  # kind -> status -> count
    unexpected: list[str]  # one line per unexpected outcome
    rss_peaks_mib: list[float]  # peak RSS in each third of the run
    final_gauges: dict[str, float]  # running, waiting, KV usage once the server is idle

    @property
    def rss_growth(self) -> float:
        """Growth of the last third's peak RSS over the second third's, as a fraction."""
        return self.rss_peaks_mib[2] / self.rss_peaks_mib[1] - 1.0

    def report(self) -> str:
        lines = [
            f"{self.num_requests} requests in {self.seconds:.1f} s",
            "statuses: "
            + json.dumps({k: dict(sorted(v.items())) for k, v in self.statuses.items()}),
            "peak RSS per third (MiB): " + " / ".join(f"{p:.1f}" for p in self.rss_peaks_mib),
            f"growth, third 2 -> 3: {100 * self.rss_growth:+.2f}%",
            "after: " + json.dumps(self.final_gauges),
            f"unexpected: {len(self.unexpected)}",
        ]
        lines += [f"  {line}" for line in self.unexpected[:20]]
        return "\n".join(lines)


# ---- the server --------------------------------------------------------------------------------
class Server:
    """`quire serve` in a subprocess on a free loopback port; its output goes to `log_path`."""

    def __init__(self, model: str | None, log_path: str, extra_args: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--port", str(port)]
        command += ["--disable-log-requests", "--disable-log-stats"]
        if model is not None:
            command += ["--model", model, "--served-model-name", "soak"]
        command += extra_args
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {open(self.log_path).read()}")
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy after {timeout} s")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line")

    def gauges(self) -> dict[str, float]:
        """running, waiting and KV usage from /metrics."""
        wanted = {
            "quire:num_requests_running": "running",
            "quire:num_requests_waiting": "waiting",
            "quire:kv_cache_usage_perc": "kv_usage",
        }
        values = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            name = line.split("{", 1)[0]
            if name in wanted:
                values[wanted[name]] = float(line.rsplit(" ", 1)[1])
        return values

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


# ---- the clients -------------------------------------------------------------------------------
class Clients:
    """One request per call of `run(kind)`; outcomes are tallied here."""

    def __init__(self, client: httpx.AsyncClient, rng: random.Random, max_request_bytes: int):
        self.client = client
        self.rng = rng
        self.max_request_bytes = max_request_bytes
        self.statuses: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
        self.unexpected: list[str] = []

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(4, 40)))

    def _completion(self, **extra) -> dict:
        body = {"prompt": self._prompt(), "max_tokens": self.rng.randint(1, 32)}
        body.update(extra)
        return body

    async def run(self, kind: str) -> None:
        try:
            status = await getattr(self, "_" + kind)()
        except (httpx.TransportError, AssertionError, ValueError) as error:
            self.unexpected.append(f"{kind}: {error!r}")
            return
        self.statuses[kind][status] += 1

    def _expect(self, kind: str, status: int, allowed: tuple[int, ...], text: str = "") -> int:
        if status not in allowed + (503,):
            self.unexpected.append(f"{kind}: status {status} {text[:200]}")
        return status

    async def _stream(self) -> int:
        body = self._completion(stream=True)
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode()
                return self._expect("stream", response.status_code, (), text)
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        finish = json.loads(events[-2][6:])["choices"][0]["finish_reason"]
        assert events[-1] == "data: [DONE]" and finish in ("length", "stop"), events[-3:]
        return 200

    async def _complete(self) -> int:
        if self.rng.random() < 0.5:
            path, body = "/v1/completions", self._completion()
        else:
            message = {"role": "user", "content": self._prompt()}
            path = "/v1/chat/completions"
            body = {"messages": [message], "max_tokens": self.rng.randint(1, 32)}
        response = await self.client.post(path, json=body)
        if response.status_code == 200:
            assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        return self._expect("complete", response.status_code, (200,), response.text)

    async def _cancel(self) -> int:
        body = self._completion(stream=True, max_tokens=200, ignore_eos=True)
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 200:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # leaving the block closes the connection
            return self._expect("cancel", response.status_code, (200,))

    async def _deadline(self) -> int:
        body = self._completion(max_tokens=500, ignore_eos=True, timeout=0.05)
        response = await self.client.post("/v1/completions", json=body)
        if response.status_code == 504:
            assert response.json()["error"]["code"] == "request_timeout", response.text
        return self._expect("deadline", response.status_code, (504,), response.text)

    async def _invalid(self) -> int:
        choice = self.rng.randrange(5)
        if choice == 0:
            response = await self.client.post(
                "/v1/completions",
                content=b'{"prompt": "hi", "max_tokens": ',
                headers={"Content-Type": "application/json"},
            )
        elif choice == 1:
            response = await self.client.post("/v1/completions", json={"prompt": "hi", "tmp": 1})
        elif choice == 2:
            response = await self.client.post("/v1/completions", json={"prompt": [1, 10**9]})
        elif choice == 3:  # far over any context, under the body limit
            prompt = "hi " * (self.max_request_bytes // 8)
            response = await self.client.post("/v1/completions", json={"prompt": prompt})
        else:
            prompt = "x" * self.max_request_bytes
            response = await self.client.post("/v1/completions", json={"prompt": prompt})
            return self._expect("invalid", response.status_code, (413,), response.text)
        return self._expect("invalid", response.status_code, (400,), response.text)


async def _send_all(
    url: str, duration: float, rate: float, seed: int, max_request_bytes: int
) -> Clients:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        clients = Clients(client, rng, max_request_bytes)
        tasks = []
        start = time.monotonic()
        arrival = rng.expovariate(rate)
        while arrival < duration:
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            kind = rng.choices(KINDS, weights=(3, 3, 2, 1, 2))[0]
            tasks.append(asyncio.create_task(clients.run(kind)))
            arrival += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return clients


def run_soak(
    model: str | None,
    duration: float,
    rate: float,
    log_path: str,
    seed: int = 0,
    max_request_bytes: int = 2**20,
    server_args: tuple[str, ...] = SERVER_ARGS,
) -> SoakResult:
    """Serves `model`, soaks it, and returns what happened once the server is idle again."""
    server = Server(model, log_path, ["--max-request-bytes", str(max_request_bytes), *server_args])
    try:
        server.wait_healthy(timeout=120)
        samples: list[tuple[float, float]] = []  # (seconds since start, RSS MiB)
        stop = threading.Event()
        start = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - start, server.rss_mib()))
                stop.wait(_RSS_INTERVAL_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = asyncio.run(_send_all(server.url, duration, rate, seed, max_request_bytes))
        gauges = server.gauges()
        idle_by = time.monotonic() + 10
        while (gauges["running"] or gauges["waiting"]) and time.monotonic() < idle_by:
            time.sleep(0.1)
            gauges = server.gauges()
        seconds = time.monotonic() - start
        stop.set()
        sampler.join()
    finally:
        server.stop()
    thirds = [
        [rss for t, rss in samples if i * seconds / 3 <= t < (i + 1) * seconds / 3]
        for i in range(3)
    ]
    return SoakResult(
        num_requests=sum(sum(c.values()) for c in clients.statuses.values())
        + len(clients.unexpected),
        seconds=seconds,
        statuses={k: dict(v) for k, v in clients.statuses.items()},
        unexpected=clients.unexpected,
        rss_peaks_mib=[max(third) for third in thirds],
        final_gauges=gauges,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the server's default model")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="soak-server.log", help="the server's output")
    args, server_args = parser.parse_known_args()  # the rest goes to `quire serve`
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_soak(
        args.model,
        args.duration,
        args.rate,
        args.log,
        args.seed,
        server_args=SERVER_ARGS + tuple(server_args),
    )
    print(result.report())
    return 1 if result.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
