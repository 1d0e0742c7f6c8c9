"""The README's examples run as written on the default model and print what the README shows:
the quick start's `quire generate`, and each ```python block (those that talk to `quire serve`
at 127.0.0.1:8000 against a server of the default model started here as the README starts it
for tool calling), whose output is the ```text block right after it, where there is one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from server_utils import serve_engine

import quire
from quire.config import EngineConfig
from quire.entrypoints.api_server import DEFAULT_MODEL_NAME
from quire.entrypoints.chat_template import load_chat_template
from quire.entrypoints.cli import main
from quire.kernels.cpu import qmatmul

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"
# A python block, and the text block that shows its output when one follows it at once
EXAMPLE = re.compile(r"```python\n(.*?)```(?:\s*```text\n(.*?)```)?", re.S)
# Each engine's KV cache, instead of the default 4 GiB (the pool's size changes no token here)
KV_CACHE_MEMORY = 64 << 20


def readme_examples() -> list[tuple[str, str, str | None]]:
    """(the section's heading, the code, the output shown or None) of each python block."""
    examples = []
    for match in EXAMPLE.finditer(README):
        heading = re.findall(r"^#+ (.*)$", README[: match.start()], re.M)[-1]
        examples.append((heading, match.group(1), match.group(2)))
    return examples


EXAMPLES = readme_examples()


@pytest.fixture(scope="module")
def server_url(default_model):
    """`quire serve --chat-template examples/tool_chat_template_hermes.jinja
    --enable-auto-tool-choice --tool-call-parser hermes` (without tools, that template renders a
    conversation as SmolLM2's own does)."""
    config = EngineConfig(model=default_model, kv_cache_memory=KV_CACHE_MEMORY)
    template = load_chat_template(str(ROOT / "examples" / "tool_chat_template_hermes.jinja"))
    with serve_engine(
        config, DEFAULT_MODEL_NAME, chat_template=template, tool_call_parser="hermes"
    ) as (server, _):
        yield server.url


def test_the_quick_start_generate_prints_what_the_readme_shows(capsys):
    command = re.search(r'quire generate --chat "(.*?)"', README)
    shown = re.search(r"```text\n(.*?)```", README[command.end() :], re.S).group(1)
    argv = ["generate", "--chat", command.group(1), "--kv-cache-memory", str(KV_CACHE_MEMORY)]
    assert main(argv) == 0
    assert capsys.readouterr().out == shown


def test_the_readme_has_examples_for_the_server_tools_structured_outputs_and_offline():
    headings = [heading for heading, _, output in EXAMPLES if output is not None]
    assert headings == [
        "Talking to the server",
        "Chat templates and tool calling",
        "Structured outputs",
        "Offline API",
        "Speculative decoding",
    ]


@pytest.mark.parametrize(
    "code, output", [example[1:] for example in EXAMPLES], ids=[e[0] for e in EXAMPLES]
)
def test_a_readme_example_prints_what_the_readme_shows(code, output, request, monkeypatch, capsys):
    if README_URL in code:
        code = code.replace(README_URL, request.getfixturevalue("server_url"))
    monkeypatch.setattr(quire, "LLM", _with_a_small_kv_cache(quire.LLM))
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    if output is None:
        return
    if printed != output and not kernels_as_for_the_readme():
        # Another word at a near-tie (the README says so beside the example): the same lines,
        # each starting as the README's does (a list's "2."), the last (a seeded sample) any text.
        lines, shown = printed.splitlines(), output.splitlines()
        assert len(lines) == len(shown) and lines[-1].strip(), printed
        assert [x.split(" ")[0] for x in lines[:-1]] == [x.split(" ")[0] for x in shown[:-1]]
        return
    assert printed == output


def kernels_as_for_the_readme() -> bool:
    """The README's outputs were printed where the C kernels run their AVX-512 loops (AMD Zen 4,
    Intel Xeon with AMX). An AVX2-only CPU sums a few things in another order (the mean square
    of RMSNorm, prefill and decode attention), which moves some logits' last bits: a seeded
    sample can draw another word, and a greedy one where two tokens nearly tie (an AMD EPYC Zen 1
    here lists other fruits: 0.06 apart in logprob there, 0.32 in float32)."""
    return qmatmul.path() == "avx512-vnni"


def _with_a_small_kv_cache(llm_class: type) -> type:
    class LLM(llm_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{"kv_cache_memory": KV_CACHE_MEMORY, **kwargs})

    return LLM
