"""The `quire` command: generate, serve, router, cluster, chat and bench. Every subcommand that runs a model takes
the engine's flags from EngineArgs (engine_args.py); its own options are declared here."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import time
import traceback

from quire import envs
from quire.engine_args import EngineArgs
from quire.entrypoints.chat_template import load_chat_template
from quire.entrypoints.tool_parsers import TOOL_PARSERS


class _ShowDefaults(argparse.HelpFormatter):
    """Ends each flag's help with its default, unless the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or action.default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class _ArgumentParser(argparse.ArgumentParser):
    """quire's parser and, through add_subparsers, every subcommand's: each flag's default in
    --help, whatever formatter the subcommand asks for (the benches keep their docstrings raw)."""

    def __init__(self, *args, formatter_class: type = argparse.HelpFormatter, **kwargs) -> None:
        formatter_class = type("HelpFormatter", (_ShowDefaults, formatter_class), {})
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts batch together)")
    sampling = p.add_argument_group("sampling arguments")
    sampling.add_argument(
        "--max-tokens", type=int, default=64, help="per completion (default: %(default)s)"
    )
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)"
    )
    sampling.add_argument("--top-p", type=float, default=1.0, help="1: off")
    sampling.add_argument("--top-k", type=int, default=0, help="0: off (default: %(default)s)")
    sampling.add_argument(
        "--n", type=int, default=1, help="completions per prompt (default: %(default)s)"
    )
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    _add_lora_arg(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        default=None,
        metavar="NAME",
        help="the adapter of --lora-modules the prompts run (default: the base model)",
    )


def chosen_lora(engine, name: str | None):
    """The LoRARequest `--lora NAME` chooses among the engine's adapters (None: the base
    model); ValueError naming the adapters loaded otherwise."""
    if name is None:
        return None
    try:
        return engine.get_lora(name)
    except KeyError:
        loaded = ", ".join(r.lora_name for r in engine.list_loras()) or "none"
        raise ValueError(
            f"--lora {name}: no adapter of that name is loaded (loaded: {loaded}); load it with "
            f"--enable-lora --lora-modules {name}=PATH."
        ) from None


def _run_generate(args: argparse.Namespace) -> int:
    from quire.entrypoints.llm import LLM
    from quire.sampling_params import SamplingParams

    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed if args.temperature > 0 else None,
    )
    llm = LLM.from_engine_config(EngineArgs.from_cli_args(args).create_engine_config())
    lora = chosen_lora(llm.engine, args.lora)
    start = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, lora_request=lora)
    else:
        outputs = llm.generate(args.prompt, params, lora_request=lora)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            num_tokens += len(completion.token_ids)
            print(f"--- prompt: {prompt!r}  [{completion.finish_reason}]")
            print(completion.text)
    print(
        f"--- {len(outputs)} prompts, {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from quire.bench import (
        latency,
        overhead,
        pd_profile,
        serve,
        speculative,
        startup,
        throughput,
    )

    p = subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, latency, serve, speculative, pd-profile, startup, overhead",
    )
    benches = p.add_subparsers(dest="bench_command", required=True)
    for module in (throughput, latency, serve, speculative, pd_profile, startup, overhead):
        module.add_parser(benches)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from quire.entrypoints.admission import (
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_REQUEST_BODY_TIMEOUT_S,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
    )

    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve MODEL over the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models).",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model (give it one way, not both)",
    )
    server = p.add_argument_group("server arguments")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    server.add_argument("--port", type=int, default=8000, help="port to bind")
    server.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (default: $QUIRE_API_KEY if set, else open)",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model as given)",
    )
    server.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per request"
    )
    server.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    # Load limits (quire.entrypoints.admission): the server stays responsive under any load.
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests that may wait beyond --max-num-seqs; more get 503 with Retry-After "
        "(default: as many full-context prompts as the KV pool holds, at least --max-num-seqs)",
    )
    server.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds a request's JSON schema, regex or grammar may take to compile; longer "
        "gets 400 (default: %(default)s)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="after SIGTERM, seconds the requests in flight get to finish before they are "
        "ended with an error; a second SIGTERM or a SIGINT ends them at once "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds a client has to send its whole request body; slower ones get 408 and "
        "are disconnected (default: %(default)s)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds after arrival at which a request is aborted (default: none; a request's "
        "own `timeout` field can only shorten it)",
    )
    # Chat and tool calling (vLLM's flags).
    _add_chat_template_arg(server)
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls from the output for tool_choice "auto" (needs --tool-call-parser)',
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), llama3_json",
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)",
    )
    EngineArgs.add_cli_args(p, serving=True)
    p.set_defaults(func=_run_serve)


def _add_chat_template_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template file to use instead of the model's",
    )


def serve_model(args: argparse.Namespace) -> str | None:
    """The model `quire serve` was given: `quire serve MODEL` or `--model MODEL` (both only if
    they agree; ValueError otherwise), or None for the default model."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(
            f"The model is given twice, as {args.model_tag!r} and --model {args.model!r}: "
            "give it once, `quire serve MODEL`."
        )
    return args.model_tag or args.model


def check_address_free(host: str, port: int) -> None:
    """ValueError, saying what to change, when nothing could listen at host:port (another
    server holds the port, or the host is not this machine's)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as error:
        raise ValueError(
            f"Cannot listen at {host}:{port} ({error.strerror}): stop what holds the port or pass "
            "another --port (and as --host, an address of this machine)."
        ) from error


def _run_serve(args: argparse.Namespace) -> int:
    from quire.entrypoints.api_server import serve

    args.model = serve_model(args)
    # The per-request and stats lines are INFO: shown unless --disable-log-requests/-stats.
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("quire").setLevel(logging.INFO)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)."
        )
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    check_address_free(args.host, args.port)  # before the model loads, not after
    serve(
        EngineArgs.from_cli_args(args).create_engine_config(),
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.QUIRE_API_KEY,
        served_model_name=args.served_model_name or args.model,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
        request_body_timeout=args.request_body_timeout,
        shutdown_timeout=args.shutdown_timeout,
        grammar_compile_timeout=args.grammar_compile_timeout,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    return 0


def _add_router(subparsers: argparse._SubParsersAction) -> None:
    from quire.router.policies import POLICIES

    p = subparsers.add_parser(
        "router",
        help="serve the OpenAI API in front of prefill, decode and collocated instances",
        description="Forward each completion and chat request to the instances started with "
        "`quire serve` (with --disaggregation-mode prefill / decode, or collocated): a prefill "
        "instance computes the prompt, a decode instance pulls its KV and generates the rest.",
    )
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances")
    p.add_argument(
        "--collocated", nargs="+", default=[], metavar="URL", help="collocated instances"
    )
    p.add_argument(
        "--policy", default="round_robin", choices=POLICIES, help="(default: %(default)s)"
    )
    p.add_argument(
        "--cost-profile",
        default=None,
        metavar="JSON",
        help="the instances' measured parameters for --policy cost_model, written by "
        "`quire bench pd-profile`",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from quire.router.app import run_router

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("quire").setLevel(logging.INFO)
    run_router(
        args.prefill,
        args.decode,
        args.collocated,
        args.policy,
        args.host,
        args.port,
        cost_profile=args.cost_profile,
    )
    return 0


def _add_cluster(subparsers: argparse._SubParsersAction) -> None:
    from quire.router.policies import POLICIES

    p = subparsers.add_parser(
        "cluster",
        help="run prefill, decode (and collocated) instances and the router on a Ray cluster",
        description="Start or join a Ray cluster and place each instance as a Ray actor on a "
        "node offering its role's resource (quire_prefill, quire_decode, quire_collocated: "
        "`ray start --resources '{\"quire_decode\": 1}'`), and the router on this node. "
        "Without --ray-address, a one-node cluster is started here. Runs until interrupted, "
        "replacing instances that die.",
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model"
    )
    placement = p.add_argument_group("cluster arguments")
    for role in ("prefill", "decode", "collocated"):
        placement.add_argument(
            f"--num-{role}", type=int, default=0, metavar="N", help=f"{role} instances"
        )
    placement.add_argument(
        "--cpus-per-instance", type=float, default=1.0, help="Ray CPUs (default: %(default)s)"
    )
    placement.add_argument(
        "--gpus-per-instance", type=float, default=0.0, help="Ray GPUs (default: %(default)s)"
    )
    placement.add_argument(
        "--policy", default="round_robin", choices=POLICIES, help="(default: %(default)s)"
    )
    placement.add_argument(
        "--host", default="127.0.0.1", help="address the router binds (default: loopback)"
    )
    placement.add_argument("--port", type=int, default=8000, help="port the router binds")
    placement.add_argument("--served-model-name", default=None, help="(default: the model)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_cluster)


def _run_cluster(args: argparse.Namespace) -> int:
    from quire.cluster.placement import PlacementError, QuireCluster, check_arguments, connect

    args.model = serve_model(args)
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("quire").setLevel(logging.INFO)
    counts = {"prefill": args.num_prefill, "decode": args.num_decode}
    counts["collocated"] = args.num_collocated
    # --ray-address (an engine argument) is the cluster's; the instances inside it join none
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), ray_address=None)
    check_arguments(engine_args, counts)  # before Ray starts
    connect(args.ray_address, counts)
    try:
        cluster = QuireCluster(
            engine_args,
            counts,
            policy=args.policy,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            cpus_per_instance=args.cpus_per_instance,
            gpus_per_instance=args.gpus_per_instance,
        )
        print(f"quire cluster: serving at {cluster.url}/v1 (Ctrl-C stops it)", flush=True)
    except PlacementError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    # SIGTERM (a service manager's stop) ends the instances as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.supervise()
    except KeyboardInterrupt:
        pass
    except PlacementError as error:  # the router died: nothing serves any more
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        cluster.shutdown()
    return 0


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with the model in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling, 1: off")
    _add_chat_template_arg(p)
    _add_lora_arg(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from quire.entrypoints.chat_cli import run_chat_from_args

    return run_chat_from_args(args, EngineArgs.from_cli_args(args).create_engine_config())


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="quire", description="quire: LLM inference and serving")
    parser.add_argument(
        "--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR, before the command"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_router(subparsers)
    _add_cluster(subparsers)
    _add_chat(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # one line (a broken model file names itself and what is wrong); the trace on debug
        if args.log_level.upper() == "DEBUG":
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
