"""Stop rules on a tiny model that almost always says EOS: EOS ends a completion, min_tokens bans
EOS and the stop token ids until it is met, ignore_eos and stop_token_ids, max_tokens.

The random tiny models never pick EOS, so on them these rules go untested. Here the checkpoint is
edited so that EOS takes all but ~1e-8 of the probability at every position: one embedding
dimension is a large constant, which survives the two random layers and the final norm as a
positive feature, and only EOS's LM-head row reads it. Every expected output below follows from
"EOS is always the most likely token, by far".
"""

from __future__ import annotations

import pytest
from conftest import make_llm
from safetensors.torch import load_file, save_file

from quire import LLM, SamplingParams

EOS = 2  # the tiny checkpoints' eos_token_id (SmolLM2's <|im_end|>)
PROMPT = {"prompt_token_ids": [100, 200, 300, 400, 500]}


@pytest.fixture(scope="module")
def eos_model(build_model, tmp_path_factory) -> str:
    path = build_model(str(tmp_path_factory.mktemp("eos_llama")), "llama")
    weights_file = f"{path}/model.safetensors"
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"][:, 0] = 10.0  # every token: a large constant feature
    weights["lm_head.weight"][:, 0] = 0.0
    weights["lm_head.weight"][EOS, 0] = 4.0  # that only EOS reads: a bias of ~30 logits
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def llm(eos_model) -> LLM:
    return make_llm(eos_model, dtype="float32")


def generate(llm: LLM, **params):
    (output,) = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    return output.outputs[0]


GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, seed=3)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_eos_ends_the_completion_at_its_first_token(llm, sampling):
    completion = generate(llm, max_tokens=8, **sampling)
    assert completion.token_ids == [EOS]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert completion.text == ""


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("min_tokens", [1, 5])
def test_min_tokens_bans_eos_until_that_many_tokens_are_out(llm, sampling, min_tokens):
    completion = generate(llm, max_tokens=8, min_tokens=min_tokens, **sampling)
    assert len(completion.token_ids) == min_tokens + 1
    assert EOS not in completion.token_ids[:min_tokens]
    assert completion.token_ids[min_tokens] == EOS
    assert completion.finish_reason == "stop"


def test_min_tokens_equal_to_max_tokens_ends_by_length_without_eos(llm):
    completion = generate(llm, max_tokens=4, min_tokens=4, **GREEDY)
    assert len(completion.token_ids) == 4 and EOS not in completion.token_ids
    assert completion.finish_reason == "length"


def test_eos_on_the_last_allowed_token_finishes_by_stop(llm):
    completion = generate(llm, max_tokens=1, **GREEDY)
    assert completion.token_ids == [EOS]
    assert completion.finish_reason == "stop"


def test_ignore_eos_generates_eos_up_to_max_tokens(llm):
    completion = generate(llm, max_tokens=6, ignore_eos=True, **GREEDY)
    assert completion.token_ids == [EOS] * 6
    assert completion.finish_reason == "length"


def test_stop_token_ids_stop_even_when_eos_is_ignored(llm):
    completion = generate(llm, max_tokens=6, ignore_eos=True, stop_token_ids=[EOS], **GREEDY)
    assert completion.token_ids == [EOS]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", EOS)


def test_min_tokens_bans_the_stop_token_ids_too(llm):
    """The token the model picks first once EOS is banned is made a stop token: below min_tokens
    it is banned as well, so it cannot end the completion early (nor appear at all)."""
    first = generate(llm, max_tokens=8, min_tokens=3, **GREEDY).token_ids[0]
    completion = generate(llm, max_tokens=8, min_tokens=3, stop_token_ids=[first], **GREEDY)
    assert len(completion.token_ids) == 4
    assert not {first, EOS} & set(completion.token_ids[:3])
    assert completion.token_ids[3] == EOS
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_min_tokens_bans_the_stop_token_ids_even_when_eos_is_ignored(llm):
    """EOS as a stop token id: ignore_eos lifts the EOS ban, not the stop-token ban below
    min_tokens, so EOS first comes, and stops the completion, at min_tokens."""
    completion = generate(
        llm, max_tokens=8, min_tokens=3, ignore_eos=True, stop_token_ids=[EOS], **GREEDY
    )
    assert len(completion.token_ids) == 4
    assert EOS not in completion.token_ids[:3]
    assert completion.token_ids[3] == EOS
    assert (completion.finish_reason, completion.stop_reason) == ("stop", EOS)
