"""Multi-LoRA through the server and the CLI: the OpenAI `model` field chooses the adapter (its
tokens are LLM.generate's with that adapter), /v1/models lists adapters with their parent,
adapters load and unload at run time with --allow-runtime-lora-updating (a request running
an unloaded adapter finishes), every bad input gets its status and OpenAI's error body, the
metrics name the adapters; `quire generate --lora` and `quire bench throughput --lora-mix`."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import assert_idle, greedy, make_adapter
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerThread, serve_engine

from quire import LLM, LoRARequest
from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.entrypoints.api_server import build_app
from quire.entrypoints.chat_cli import ChatSession
from quire.entrypoints.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

MODEL = "tiny"
PROMPT = [5, 17, 300, 42, 7, 99, 3]
MAX_TOKENS = 8
LONG = 500  # tokens: a stream that outlasts a few HTTP round trips
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    ranks = {"a": 8, "b": 4, "c": 8, "big": 16}  # big: above MAX_LORA_RANK
    return {
        name: make_adapter(tiny_llama, str(root / name), seed, r=r, lora_alpha=16)
        for seed, (name, r) in enumerate(ranks.items(), 1)
    }


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapters):
    config = EngineConfig(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=128,
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
        lora_modules=[f"a={adapters['a']}"],
    )
    with serve_engine(config, MODEL, allow_runtime_lora_updating=True) as server_and_engine:
        yield server_and_engine


@pytest.fixture(scope="module")
def server(lora_server) -> ServerThread:
    return lora_server[0]


@pytest.fixture(scope="module")
def reference_llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=64, enable_lora=True)


@pytest.fixture(scope="module")
def reference(reference_llm, adapters):
    """An adapter's (or the base model's, None) greedy text of a prompt (default PROMPT)
    through LLM.generate."""
    ids = {name: i for i, name in enumerate(adapters, 1)}

    def text(name: str | None, max_tokens: int = MAX_TOKENS, prompt=PROMPT) -> str:
        lora = None if name is None else LoRARequest(name, ids[name], adapters[name])
        (output,) = reference_llm.generate(
            prompt, greedy(max_tokens), use_tqdm=False, lora_request=lora
        )
        return output.outputs[0].text

    return text


def complete(server: ServerThread, model: str | None, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return server.post("/v1/completions", json=body | fields)


def load(server: ServerThread, name: str, path: str) -> httpx.Response:
    return server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def unload(server: ServerThread, name: str) -> httpx.Response:
    return server.post("/v1/unload_lora_adapter", json={"lora_name": name})


def error(response: httpx.Response) -> tuple[int, str | None, str | None]:
    body = response.json()["error"]
    assert body["type"] == "invalid_request_error"
    return response.status_code, body["param"], body["code"]


def samples(server: ServerThread, name: str) -> list:
    text = httpx.get(server.url + "/metrics").text
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def lora_requests(server: ServerThread, adapter: str) -> float:
    counts = samples(server, "quire:lora_requests_total")
    return sum(s.value for s in counts if s.labels["lora_name"] == adapter)


# ---- the model field -------------------------------------------------------------------------
def test_the_model_field_chooses_the_adapter(server, reference):
    response = complete(server, "a")
    assert response.status_code == 200
    assert response.json()["model"] == "a"
    assert response.json()["choices"][0]["text"] == reference("a")
    assert reference("a") != reference(None)  # the adapter changes the output


def test_chat_completions_choose_the_adapter_too(server, reference_llm, adapters):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": "a", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = server.post("/v1/chat/completions", json=body | {"ignore_eos": True})
    lora = LoRARequest("a", 1, adapters["a"])
    (expected,) = reference_llm.chat(
        messages, greedy(MAX_TOKENS), use_tqdm=False, lora_request=lora
    )
    assert response.json()["model"] == "a"
    assert response.json()["choices"][0]["message"]["content"] == expected.outputs[0].text


def test_tokenize_takes_an_adapters_name(server):
    response = server.post("/tokenize", json={"model": "a", "prompt": "Hello"})
    assert response.json()["tokens"] == [19556]
    assert error(server.post("/tokenize", json={"model": "x", "prompt": "Hi"}))[0] == 404


def test_the_base_models_name_or_none_runs_no_adapter(server, reference):
    for model in (MODEL, None):
        response = complete(server, model)
        assert response.json()["choices"][0]["text"] == reference(None)
        assert response.json()["model"] == MODEL


def test_an_unknown_model_is_404_model_not_found(server):
    response = complete(server, "nope")
    assert error(response) == (404, "model", "model_not_found")
    assert response.json()["error"]["message"] == (
        "The model `nope` does not exist. This server serves `tiny`, `a`."
    )


def test_models_lists_each_adapter_with_the_base_model_as_parent(server, tiny_llama, adapters):
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (MODEL, tiny_llama, None),
        ("a", adapters["a"], MODEL),
    ]


# ---- load and unload at run time -------------------------------------------------------------
def test_an_adapter_loaded_at_run_time_serves_until_unloaded(server, reference, adapters):
    response = load(server, "b", adapters["b"])
    assert (response.status_code, response.text) == (
        200,
        "Success: LoRA adapter 'b' added successfully.",
    )
    assert [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]] == [
        MODEL,
        "a",
        "b",
    ]
    assert complete(server, "b").json()["choices"][0]["text"] == reference("b")
    response = unload(server, "b")
    assert (response.status_code, response.text) == (
        200,
        "Success: LoRA adapter 'b' removed successfully.",
    )
    assert error(complete(server, "b")) == (404, "model", "model_not_found")
    assert [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL, "a"]


def running_adapters(server: ServerThread) -> tuple[str, str, str]:
    """quire:lora_requests_info's labels: running and waiting adapters, max_lora."""
    (info,) = samples(server, "quire:lora_requests_info")
    labels = info.labels
    return labels["running_lora_adapters"], labels["waiting_lora_adapters"], labels["max_lora"]


def test_unloading_an_adapter_lets_its_running_request_finish(lora_server, reference, adapters):
    server, engine = lora_server
    assert load(server, "c", adapters["c"]).status_code == 200
    body = {"model": "c", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    parts = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = (json.loads(line[6:]) for line in stream.iter_lines() if line[6:7] == "{")
        parts.append(next(lines)["choices"][0]["text"])
        assert running_adapters(server) == ("c", "", "4")
        assert unload(server, "c").status_code == 200
        assert running_adapters(server) == ("c", "", "4")  # unloaded while it runs
        for event in lines:
            assert "error" not in event, event
            parts.append(event["choices"][0]["text"])
    assert "".join(parts) == reference("c", LONG)
    assert error(complete(server, "c")) == (404, "model", "model_not_found")
    assert_idle(engine)
    assert running_adapters(server) == ("", "", "4")


def test_loading_a_name_taken_or_the_base_models_is_400(server, adapters):
    response = load(server, "a", adapters["b"])
    assert error(response) == (400, "lora_name", None)
    assert "already loaded" in response.json()["error"]["message"]
    response = load(server, MODEL, adapters["b"])
    assert error(response) == (400, "lora_name", None)
    assert response.json()["error"]["message"] == (
        "lora_name `tiny` is the base model's name: give the adapter another."
    )


def test_an_adapter_that_does_not_fit_is_400_naming_lora_path(server, adapters, tmp_path):
    response = load(server, "big", adapters["big"])
    assert error(response) == (400, "lora_path", None)
    assert "rank 16 is above max_lora_rank 8" in response.json()["error"]["message"]
    response = load(server, "gone", str(tmp_path / "missing"))
    assert error(response) == (400, "lora_path", None)
    assert "no such adapter" in response.json()["error"]["message"]
    assert error(load(server, "", adapters["b"])) == (400, "lora_name", None)
    names = [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]]
    assert names == [MODEL, "a"]  # nothing changed


def test_unloading_an_unknown_adapter_is_404(server):
    response = unload(server, "nope")
    assert error(response) == (404, "lora_name", "model_not_found")
    assert response.json()["error"]["message"] == (
        "No LoRA adapter named `nope` is loaded (loaded: `a`)."
    )


def test_without_the_flag_the_routes_are_absent(lora_server, adapters):
    server = ServerThread(build_app(lora_server[1], MODEL))
    try:
        assert load(server, "b", adapters["b"]).status_code == 404
        assert unload(server, "a").status_code == 404
        paths = httpx.get(server.url + "/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths
    finally:
        server.stop()


def test_the_routes_are_documented_with_their_errors(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    load_responses = paths["/v1/load_lora_adapter"]["post"]["responses"]
    unload_responses = paths["/v1/unload_lora_adapter"]["post"]["responses"]
    assert sorted(load_responses) == ["200", "400", "408", "413"]
    assert sorted(unload_responses) == ["200", "400", "404", "408", "413"]
    assert list(load_responses["200"]["content"]) == ["text/plain"]


def test_the_flag_needs_enable_lora(tiny_llama):
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=16)
    )
    try:
        with pytest.raises(ValueError, match="--allow-runtime-lora-updating needs --enable-lora"):
            build_app(engine, MODEL, allow_runtime_lora_updating=True)
    finally:
        engine.shutdown()


def test_quire_serve_refuses_the_flag_without_enable_lora_before_loading(tiny_llama, capsys):
    argv = ["serve", tiny_llama, "--port", "0", "--allow-runtime-lora-updating"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: --allow-runtime-lora-updating needs --enable-lora: adapters load into its slots.\n"
    )


# ---- metrics ---------------------------------------------------------------------------------
def test_requests_are_counted_by_adapter(server):
    before = lora_requests(server, "a")
    complete(server, "a")
    complete(server, "a", n=2)  # one request
    complete(server, MODEL)  # the base model's: not an adapter's
    assert lora_requests(server, "a") == before + 2
    assert lora_requests(server, MODEL) == 0


# ---- the CLI ---------------------------------------------------------------------------------
def test_generate_runs_the_adapter_lora_names(tiny_llama, adapters, reference, capsys):
    argv = ["generate", "--model", tiny_llama, "--dtype", "float32", "--num-kv-blocks", "16"]
    argv += ["--enable-lora", "--lora-modules", f"a={adapters['a']}", "--max-tokens"]
    assert main([*argv, str(MAX_TOKENS), "--lora", "a", "Hello there"]) == 0
    expected = reference("a", prompt="Hello there")
    assert capsys.readouterr().out == f"--- prompt: 'Hello there'  [length]\n{expected}\n"
    assert main([*argv, "4", "--lora", "b", "Hello"]) == 2
    assert capsys.readouterr().err == (
        "error: --lora b: no adapter of that name is loaded (loaded: a); load it with "
        "--enable-lora --lora-modules b=PATH.\n"
    )


def test_a_chat_session_runs_its_adapter(reference_llm, adapters):
    lora = LoRARequest("a", 1, adapters["a"])
    session = ChatSession(reference_llm.engine, greedy(MAX_TOKENS), lora_request=lora)
    messages = [{"role": "user", "content": "Hi"}]
    (expected,) = reference_llm.chat(
        messages, greedy(MAX_TOKENS), use_tqdm=False, lora_request=lora
    )
    (base,) = reference_llm.chat(messages, greedy(MAX_TOKENS), use_tqdm=False)
    assert session.reply("Hi") == expected.outputs[0].text != base.outputs[0].text


def test_bench_throughput_runs_a_lora_mix_beside_the_base_model(tiny_llama, adapters, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_llama, "--num-requests", "3"]
    argv += ["--input-len", "8", "16", "--output-len", "2", "4", "--output-json", str(out)]
    argv += ["--kv-cache-memory", str(8 << 20), "--seed", "0", "--enable-lora"]
    argv += ["--lora-modules", f"a={adapters['a']}", f"c={adapters['c']}", "--lora-mix", "a,c,base"]
    assert main(argv) == 0
    with open(out) as f:
        report = json.load(f)
    base, mix = report["results"]
    assert (base["engine"], mix["engine"]) == ("quire", "quire, LoRA mix a,c,base")
    assert mix["output_tokens"] == base["output_tokens"]
    assert report["workload"]["lora_mix"] == ["a", "c", "base"]
    assert report["ratio_lora_mix_over_base"] == pytest.approx(
        mix["output_tokens_per_s"] / base["output_tokens_per_s"]
    )


def test_bench_latency_times_the_decodes_with_a_lora_mix(tiny_llama, adapters, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_llama, "--prompt-len", "16", "--batch-size", "2"]
    argv += ["--decode-steps", "2", "--num-iters", "1", "--no-perplexity", "--output-json"]
    argv += [str(out), "--kv-cache-memory", str(8 << 20), "--enable-lora"]
    argv += ["--lora-modules", f"a={adapters['a']}", "--lora-mix", "a,base"]
    assert main(argv) == 0
    with open(out) as f:
        report = json.load(f)
    assert report["lora_mix"] == ["a", "base"]
    assert [d["batch_size"] for d in report["lora_decode"]] == [1, 2]
    assert all(d["steps"] == 2 and d["step_seconds"] > 0 for d in report["lora_decode"])


def test_bench_serve_sends_the_model_names_round_robin(server, tokenizer_dir, tmp_path):
    before = lora_requests(server, "a")
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, "--tokenizer", tokenizer_dir]
    argv += ["--num-prompts", "4", "--input-len", "5", "10", "--output-len", "3", "6"]
    argv += ["--models", "a,base", "--output-json", str(out)]
    assert main(argv) == 0
    with open(out) as f:
        report = json.load(f)
    assert report["models"] == ["a", MODEL]
    assert (report["runs"][0]["completed"], report["runs"][0]["failed"]) == (4, 0)
    assert lora_requests(server, "a") == before + 3  # the probe's one, then requests 0 and 2
