"""vLLM's sampling extras sent to the server change what it samples: top_k, min_p and the
presence, frequency and repetition penalties each show in the completion, so a field dropped
on the way from the request body to SamplingParams fails here.

- top_k 1 and min_p 1 keep only the most likely token, so at temperature 2 they give the greedy
  completion, which plain sampling at temperature 2 does not.
- A penalty of 2 on a seen token outweighs the spread of the tiny model's top logits (well under
  1), so greedy decoding under any of the penalties never repeats a token; without one it does.
"""

from __future__ import annotations

import pytest

# The server and the `openai` client on it, from the API tests' fixtures.
from test_api_server import IGNORE_EOS, MODEL, client, server, tiny_server  # noqa: F401

PROMPT = "Roses are red"
MAX_TOKENS = 8


def completion(client, **kwargs) -> tuple[str, list[str]]:  # noqa: F811
    """The completion's text and its tokens (as text), with EOS ignored."""
    extra_body = {**IGNORE_EOS, **kwargs.pop("extra_body", {})}
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        logprobs=0,
        extra_body=extra_body,
        **kwargs,
    )
    (choice,) = response.choices
    return choice.text, choice.logprobs.tokens


@pytest.fixture(scope="module")
def greedy(client) -> tuple[str, list[str]]:  # noqa: F811
    return completion(client, temperature=0.0)


@pytest.mark.parametrize("field, value", [("top_k", 1), ("min_p", 1.0)])
def test_a_filter_that_keeps_only_the_top_token_gives_the_greedy_completion(
    client,  # noqa: F811
    greedy,
    field,
    value,
):
    filtered, _ = completion(client, temperature=2.0, seed=1, extra_body={field: value})
    assert filtered == greedy[0]


def test_sampling_at_temperature_two_without_a_filter_is_not_greedy(client, greedy):  # noqa: F811
    unfiltered, _ = completion(client, temperature=2.0, seed=1)
    assert unfiltered != greedy[0]


def test_greedy_decoding_without_a_penalty_repeats_tokens(greedy):
    assert len(set(greedy[1])) < MAX_TOKENS


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 10.0}},
    ],
    ids=["presence", "frequency", "repetition"],
)
def test_a_large_penalty_forbids_repeated_tokens(client, penalty):  # noqa: F811
    _, tokens = completion(client, temperature=0.0, **penalty)
    assert len(tokens) == len(set(tokens)) == MAX_TOKENS


def test_logit_bias_of_100_forces_its_token_on_both_endpoints(client, server):  # noqa: F811
    forced = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.0,
        logit_bias={"1234": 100},
        extra_body=IGNORE_EOS,
    )
    token = (
        client.completions.create(model=MODEL, prompt=[1234], max_tokens=1, echo=True, logprobs=0)
        .choices[0]
        .logprobs.tokens[0]
    )
    assert forced.choices[0].text == token * 3
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        temperature=0.0,
        logit_bias={"1234": 100},
        extra_body=IGNORE_EOS,
    )
    assert chat.choices[0].message.content == token * 3
