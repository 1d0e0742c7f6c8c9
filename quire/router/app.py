"""`quire router`: one OpenAI endpoint in front of prefill, decode and collocated instances.

A completion or chat request goes either to one collocated instance as it is, or the
disaggregated way: to a prefill instance with `max_tokens` 1 and `kv_transfer_params`
{"do_remote_decode", "transfer_id"} (it computes the prompt, samples the first token and leases
the prompt's KV blocks), then, once that answered, to a decode instance with the same body and
{"do_remote_prefill", "transfer_id", "remote_host", "remote_port"} (it pulls the blocks, takes
the first token and generates the rest). The decode instance's answer, streamed or not, is the
client's. The policy picks among the collocated instances and the prefill instances (a prefill
instance standing for the disaggregated path), then among the decode instances.

Requests the disaggregated path does not carry yet (echo, prompt logprobs, several prompts in
one request) go to a decode instance as they are: it computes them itself; so do requests while
no prefill instance is reachable (one that refuses the connection is marked down until a poll of
its /load succeeds). An instance going down, coming back and each retry on another instance are
logged; the polls themselves are not.

The router polls each instance's /load every `poll_interval_s` for the load-aware policies, and
checks every instance when it starts: an unreachable URL, or an instance of the wrong role,
stops it with a message that names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from quire.router.cost_model import CostProfile, StreamTally, cost_model_policies, load_profile
from quire.router.policies import Instance, Policy, make_policy

logger = logging.getLogger(__name__)

_ROLES = {"prefill": ("prefill", "both"), "decode": ("decode", "both"), "collocated": None}


class RouterConfigError(ValueError):
    """The router cannot start: no instances, an unreachable URL, a role that does not fit."""


def check_instances(
    prefill: list[str], decode: list[str], collocated: list[str], timeout_s: float = 5.0
) -> list[Instance]:
    """Each URL's /load, checked against the role it was given; RouterConfigError if any is
    unreachable or of another role, or if the instances cannot serve a request."""
    if not (prefill or decode or collocated):
        raise RouterConfigError(
            "The router has no instances: give --prefill and --decode URLs, or --collocated ones."
        )
    if bool(prefill) != bool(decode):
        raise RouterConfigError(
            "Disaggregation needs both kinds: give at least one --prefill and one --decode URL "
            f"(got {len(prefill)} prefill, {len(decode)} decode)."
        )
    return [
        check_instance(role, url, timeout_s)
        for role, urls in (("prefill", prefill), ("decode", decode), ("collocated", collocated))
        for url in urls
    ]


def check_instance(role: str, url: str, timeout_s: float = 5.0) -> Instance:
    """The instance at `url` as the router knows it, from its /load; RouterConfigError if it is
    unreachable or was started for another role."""
    url = url.rstrip("/")
    try:
        response = httpx.get(f"{url}/load", timeout=timeout_s)
        response.raise_for_status()
        load = response.json()
    except (httpx.HTTPError, ValueError) as error:
        raise RouterConfigError(
            f"Cannot reach the {role} instance {url}: {error!r}. Is `quire serve` running there?"
        ) from error
    mode = load.get("disaggregation_mode")
    if _ROLES[role] is not None and mode not in _ROLES[role]:
        raise RouterConfigError(
            f"The {role} instance {url} was started with disaggregation_mode {mode!r}: "
            f"start it with `quire serve --disaggregation-mode {role}`."
        )
    instance = Instance(url, role, polled_load=load["num_running"] + load["num_waiting"])
    if role == "prefill":
        instance.kv_host = load["kv_endpoint"]["host"]
        instance.kv_port = load["kv_endpoint"]["port"]
    return instance


def prompt_text(body: dict[str, Any]) -> str:
    """The text the cache-aware policy matches: the prompt, or the chat messages' contents."""
    if "messages" in body:
        return "".join(
            m.get("content") if isinstance(m.get("content"), str) else json.dumps(m)
            for m in body["messages"]
        )
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def disaggregable(body: dict[str, Any]) -> bool:
    """Whether the disaggregated path carries this request (see the module docstring)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return not (several or body.get("echo") or body.get("prompt_logprobs"))


class Router:
    def __init__(
        self,
        instances: list[Instance],
        policy: str,
        poll_interval_s: float = 0.5,
        timeout_s: float = 600.0,
        cost_profile: CostProfile | None = None,
    ):
        self.instances = instances
        self.policy_name = policy
        self.first: Policy  # among collocated and prefill instances
        self.second: Policy  # among decode instances
        if policy == "cost_model" and cost_profile is not None:
            self.first, self.second = cost_model_policies(cost_profile, instances)
        else:
            self.first, self.second = make_policy(policy), make_policy(policy)
        self.poll_interval_s = poll_interval_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "quire_router_requests",
            "Requests forwarded, by path taken (collocated, disaggregated, decode_only).",
            ["route"],
            registry=self.registry,
        )
        self.errors = Counter(
            "quire_router_errors",
            "Requests that ended in an error from an instance or an unreachable instance.",
            ["role"],
            registry=self.registry,
        )
        self.retries = Counter(
            "quire_router_retries",
            "Requests sent again to another instance after one failed before any byte reached "
            "the client.",
            ["role"],
            registry=self.registry,
        )
        self._transfer_ids = itertools.count()

    def of_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def replace_instance(self, url: str, instance: Instance) -> None:
        """Routes to `instance` instead of the one at `url` (a dead one its supervisor
        replaced)."""
        self.instances = [instance if i.url == url else i for i in self.instances]

    # ---- load polling ----------------------------------------------------------------------
    async def poll_loads(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(i) for i in self.instances))
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, instance: Instance) -> None:
        try:
            response = await self.client.get(f"{instance.url}/load", timeout=2.0)
            response.raise_for_status()
            load = response.json()
            polled_load = load["num_running"] + load["num_waiting"]
        except (httpx.HTTPError, ValueError, KeyError) as error:
            self._mark_down(instance, error)
            return
        instance.polled_load = polled_load
        instance.sent_since_poll = 0
        if not instance.healthy:
            logger.info("The %s instance %s is back up", instance.role, instance.url)
            instance.healthy = True

    def _mark_down(self, instance: Instance, error: Exception) -> None:
        """Leaves `instance` out of routing until a poll of its /load answers (logged once)."""
        if instance.healthy:
            reason = f"{type(error).__name__}: {error}"
            if isinstance(error, httpx.HTTPStatusError):
                reason = f"{error.request.url.path} answered {error.response.status_code}"
            logger.warning(
                "The %s instance %s is down (%s): routing around it until its /load answers",
                instance.role,
                instance.url,
                reason,
            )
        instance.healthy = False

    # ---- forwarding ------------------------------------------------------------------------
    async def forward(self, path: str, body: dict[str, Any]) -> Response:
        text = prompt_text(body)
        prefills = [i for i in self.of_role("prefill") if i.healthy]
        first_choices = self.of_role("collocated") + prefills
        if not disaggregable(body) or not first_choices:
            first_choices = self.of_role("collocated") or self.of_role("decode")
        first = self.first.choose(self._live(first_choices), text, body)
        if first.role != "prefill":
            self.requests.labels(
                "collocated" if first.role == "collocated" else "decode_only"
            ).inc()
            return await self._proxy(first, path, body)
        self.requests.labels("disaggregated").inc()
        decode = self.second.choose(self._live(self.of_role("decode")), text, body)
        transfer_id = f"{uuid.uuid4().hex}-{next(self._transfer_ids)}"
        prefill_body = dict(body)
        for name in ("stream", "stream_options", "max_completion_tokens"):
            prefill_body.pop(name, None)
        prefill_body["max_tokens"] = 1
        prefill_body["min_tokens"] = min(body.get("min_tokens", 0), 1)
        prefill_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        answered = await self._prefill(first, path, prefill_body, text, body)
        if answered is None:  # no prefill instance answered: the decode instance computes it
            return await self._proxy(decode, path, body)
        first, response = answered
        if response.status_code != 200:
            self.first.done(decode, body)
            self.errors.labels("prefill").inc()
            return Response(response.content, response.status_code, media_type="application/json")
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_host": first.kv_host,
            "remote_port": first.kv_port,
        }
        return await self._proxy(decode, path, decode_body, origin=body)

    def _live(self, instances: list[Instance]) -> list[Instance]:
        """The healthy ones (all of them when none is: the request then fails clearly)."""
        return [i for i in instances if i.healthy] or instances

    async def _prefill(
        self, first: Instance, path: str, body: dict[str, Any], text: str, origin: dict[str, Any]
    ) -> tuple[Instance, httpx.Response] | None:
        """The prefill instance that answered `body` (made from the client's `origin`), and its
        answer: an instance that fails (refused, dropped, timed out: the client has seen nothing
        yet) is marked down and another live prefill instance is asked. None when none is
        left."""
        instance: Instance | None = first
        tried = []
        while instance is not None:
            instance.sent_since_poll += 1
            try:
                response = await self.client.post(f"{instance.url}{path}", json=body)
            except httpx.HTTPError as error:
                self.first.done(instance, origin)
                self._unreachable(instance, error)
                tried.append(instance)
                instance = self._retry_on_another(instance, tried, text, origin)
                continue
            self.first.done(instance, origin)
            return instance, response
        return None

    async def _proxy(
        self,
        instance: Instance,
        path: str,
        body: dict[str, Any],
        origin: dict[str, Any] | None = None,
    ) -> Response:
        """The instance's answer to `body` (made from the client's `origin`, if not `body`
        itself), streamed through when the body asks to stream. An instance that fails before
        the client got a byte (it refuses the connection, or drops it before its first event)
        is marked down, and `origin` goes to another live instance of its role; a 502 names
        every instance tried when none is left."""
        origin = body if origin is None else origin
        text = prompt_text(origin)
        tried: list[Instance] = []
        while True:
            instance.sent_since_poll += 1
            try:
                return await self._send(instance, path, body, origin)
            except httpx.HTTPError as error:
                self.first.done(instance, origin)
                failure = self._unreachable(instance, error)
                tried.append(instance)
                retry = self._retry_on_another(instance, tried, text, origin)
                if retry is None:
                    if len(tried) == 1:
                        return failure
                    urls = ", ".join(i.url for i in tried)
                    return _error(502, f"No {instance.role} instance answered (tried {urls}).")
                instance, body = retry, origin

    async def _send(
        self, instance: Instance, path: str, body: dict[str, Any], origin: dict[str, Any]
    ) -> Response:
        """`body` posted to the instance; a stream is returned once its first chunk came (an
        httpx.HTTPError before then: nothing has reached the client)."""
        asked = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream") and not asked:  # the report counts tokens, the events may not
            options = {**(body.get("stream_options") or {}), "include_usage": True}
            body = {**body, "stream_options": options}
        request = self.client.build_request("POST", f"{instance.url}{path}", json=body)
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code != 200 or not body.get("stream"):
                content = await response.aread()
                await response.aclose()
                self.first.done(instance, origin, usage=_usage(content))
                if response.status_code != 200:
                    self.errors.labels(instance.role).inc()
                return Response(
                    content,
                    response.status_code,
                    media_type=response.headers.get("content-type", "application/json"),
                )
            tally = StreamTally(strip_usage=not asked)
            self.first.relaying(instance, origin, tally)
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
        except BaseException:
            await response.aclose()
            raise
        return StreamingResponse(
            _relay(
                response,
                tally.feed(first),
                chunks,
                tally,
                lambda: self.first.done(instance, origin, tally),
            ),
            media_type=response.headers.get("content-type"),
        )

    def _retry_on_another(
        self, failed: Instance, tried: list[Instance], text: str, origin: dict[str, Any]
    ) -> Instance | None:
        """A live instance of `failed`'s role not tried yet, by the policy, the retry counted
        and logged; None if none is left."""
        others = [i for i in self.of_role(failed.role) if i.healthy and i not in tried]
        if not others:
            return None
        policy = self.second if failed.role == "decode" else self.first
        retry = policy.choose(others, text, origin)
        logger.info(
            "Retrying a request on the %s instance %s (%s failed)",
            retry.role,
            retry.url,
            failed.url,
        )
        self.retries.labels(failed.role).inc()
        return retry

    def _unreachable(self, instance: Instance, error: Exception) -> JSONResponse:
        self.errors.labels(instance.role).inc()
        self._mark_down(instance, error)
        return _error(502, f"The {instance.role} instance {instance.url} is unreachable: {error!r}")


async def _relay(
    response: httpx.Response,
    first: bytes,
    chunks: AsyncIterator[bytes],
    tally: StreamTally,
    on_end: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The stream's first chunk (already read and tallied), then the rest as it comes."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            relayed = tally.feed(chunk)
            if relayed:
                yield relayed
    except httpx.HTTPError as error:  # the instance died mid-stream: say so in the stream
        body = {"error": {"message": f"The instance stopped mid-stream: {error!r}", "code": 502}}
        yield f"data: {json.dumps(body)}\n\n".encode()
    finally:
        await response.aclose()
        on_end()


def _usage(content: bytes) -> dict[str, Any] | None:
    """The usage report of a whole (not streamed) answer, if it has one."""
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "router_error", "code": status}}, status
    )


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.create_task(router.poll_loads())
        yield
        poller.cancel()
        await router.client.aclose()

    app = FastAPI(title="quire router", lifespan=lifespan)

    async def body_of(raw: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.")
        return body

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        body = await body_of(raw)
        return body if isinstance(body, Response) else await router.forward(raw.url.path, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        body = await body_of(raw)
        return body if isinstance(body, Response) else await router.forward(raw.url.path, body)

    @app.get("/v1/models")
    async def models() -> Response:
        instance = router.instances[0]
        try:
            response = await router.client.get(f"{instance.url}/v1/models")
        except httpx.HTTPError as error:
            return router._unreachable(instance, error)
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """200 when every instance answers its /health, else 503 naming those that do not."""

        async def down(instance: Instance) -> str | None:
            try:
                response = await router.client.get(f"{instance.url}/health", timeout=2.0)
            except httpx.HTTPError:
                return instance.url
            return None if response.status_code == 200 else instance.url

        failing = [url for url in await asyncio.gather(*map(down, router.instances)) if url]
        if failing:
            return _error(503, f"Instances not healthy: {', '.join(failing)}")
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return {
            "policy": router.policy_name,
            "instances": [
                {"url": i.url, "role": i.role, "load": i.load, "healthy": i.healthy}
                for i in router.instances
            ],
            **({"policy_state": state} if (state := router.first.describe()) else {}),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(
    prefill: list[str],
    decode: list[str],
    collocated: list[str],
    policy: str,
    host: str,
    port: int,
    cost_profile: str | None = None,
) -> None:
    import uvicorn

    profile = None
    if policy == "cost_model" and cost_profile is not None:
        profile = load_profile(cost_profile)  # a bad profile fails before any instance is
    elif cost_profile is not None:  # contacted, as a bad policy name does
        raise RouterConfigError(f"--cost-profile is for --policy cost_model, not {policy}.")
    else:
        make_policy(policy)
    instances = check_instances(prefill, decode, collocated)
    logger.info(
        "Routing at http://%s:%d with %s over %s",
        host,
        port,
        policy,
        ", ".join(f"{i.role} {i.url}" for i in instances),
    )
    # quire's log format (the root logger's), no access log line per request nor per health
    # check, and none of httpx's line per /load poll
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_router_app(Router(instances, policy, cost_profile=profile))
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False)
