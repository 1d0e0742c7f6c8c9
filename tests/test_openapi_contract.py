"""The API contract: /openapi.json tells the truth. schemathesis generates requests from the
document (valid and invalid ones) against a live server and runs every check: no 5xx, only
documented status codes, content types and headers, schema-valid requests accepted and invalid
ones rejected, 405 with Allow. Rules no schema can state are declared in tests/schemathesis/
(hooks.py), which the repository root's schemathesis.toml names."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from conftest import make_adapter
from server_utils import ServerThread

from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app
from quire.entrypoints.chat_template import load_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERMES_TEMPLATE = os.path.join(ROOT, "examples", "tool_chat_template_hermes.jinja")
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def contract_adapter(tiny_llama, tmp_path_factory) -> str:
    return make_adapter(tiny_llama, str(tmp_path_factory.mktemp("lora")), 1, r=4)


@pytest.fixture(scope="module")
def contract_server(tiny_llama, contract_adapter):
    """A multi-LoRA server with an adapter loaded and the routes that load and unload them, so
    that every route is in the document and under schemathesis."""
    config = EngineConfig(
        model=tiny_llama,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules=[f"adapter={contract_adapter}"],
    )
    engine = AsyncLLM.from_engine_config(config, EngineMetrics("tiny"))
    app = build_app(
        engine,
        "tiny",
        chat_template=load_chat_template(HERMES_TEMPLATE),
        tool_call_parser="hermes",
        allow_runtime_lora_updating=True,
    )
    server = ServerThread(app)
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()


def test_error_responses_are_documented_with_openais_error_body(contract_server):
    schema = httpx.get(contract_server.url + "/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert sorted(chat) == ["200", "400", "404", "408", "413", "500", "503", "504"]
    assert chat["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_documented_limits_match_the_model(contract_server):
    schemas = httpx.get(contract_server.url + "/openapi.json").json()["components"]["schemas"]
    max_tokens = schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (1, MAX_MODEL_LEN - 1)
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    token = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (token["minimum"], token["maximum"]) == (0, 49151)


def test_lists_the_server_needs_non_empty_say_min_items_1(contract_server):
    schemas = httpx.get(contract_server.url + "/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        (choices, _) = schemas[request]["properties"]["guided_choice"]["anyOf"]
        assert (choices["minItems"], choices["items"]["minLength"]) == (1, 1)
    (choices, _) = schemas["StructuredOutputsRequest"]["properties"]["choice"]["anyOf"]
    assert (choices["minItems"], choices["items"]["minLength"]) == (1, 1)


def test_a_405_names_the_allowed_methods(contract_server):
    response = httpx.delete(contract_server.url + "/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_lora_routes_are_in_the_document(contract_server):
    paths = httpx.get(contract_server.url + "/openapi.json").json()["paths"]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)


def test_schemathesis_finds_no_failure_with_every_check(
    contract_server, contract_adapter, tiny_llama
):
    st = shutil.which("st", path=os.path.dirname(sys.executable))
    assert st, "schemathesis is in the test extra: pip install -e '.[test]'"
    env = {
        **os.environ,
        "QUIRE_CONTRACT_MODEL": tiny_llama,
        "QUIRE_CONTRACT_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "QUIRE_CONTRACT_CHAT_TEMPLATE": HERMES_TEMPLATE,
        "QUIRE_CONTRACT_LORA_PATH": contract_adapter,
        "NO_COLOR": "1",
    }
    # As a user runs it from the repository root: schemathesis finds ./schemathesis.toml.
    command = [st, "run", contract_server.url + "/openapi.json"]
    command += ["--checks", "all", "--output-sanitize", "false"]
    with contextlib.chdir(ROOT):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    # valid load requests really loaded the adapter (under names the hooks made unique)
    models = httpx.get(contract_server.url + "/v1/models").json()["data"]
    assert len([m for m in models if m["root"] == contract_adapter]) > 1


def test_structured_output_fields_are_documented(contract_server):
    schemas = httpx.get(contract_server.url + "/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[request]["properties"]
        assert {"response_format", "structured_outputs"} <= set(properties)
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            assert properties[name]["deprecated"] is True
    assert set(schemas["StructuredOutputsRequest"]["properties"]) == {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
    }
    assert "schema" in schemas["JsonSchemaFormat"]["required"]


def test_a_collocated_instance_documents_no_kv_transfer_params(contract_server):
    """It answers them 400 (they need --disaggregation-mode): the document must not offer them
    as valid."""
    schemas = httpx.get(contract_server.url + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert "kv_transfer_params" not in schemas[name]["properties"]
