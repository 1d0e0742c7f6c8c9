"""Bad input is refused at the boundary with a message that says what to change, and leaves the
engine serving: bad model folders, bad prompts, bad SamplingParams, one bad prompt in a batch."""

from __future__ import annotations

import json
import os

import pytest
from conftest import assert_idle, greedy

from quire import LLM, SamplingParams

MAX_MODEL_LEN = 32
VOCAB_SIZE = 49152  # the tiny checkpoints use SmolLM2's tokenizer
SUPPORTED = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(
        model=tiny_llama,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=16,
        max_num_seqs=4,
    )


def model_folder(tiny_llama: str, path, without: tuple[str, ...] = ()) -> str:
    """A model folder linking the tiny Llama's files, less `without`."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tiny_llama):
        if name not in without:
            os.symlink(os.path.join(tiny_llama, name), os.path.join(path, name))
    return str(path)


# ---- bad model folders -------------------------------------------------------------------


def test_missing_model_path_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "no-such-model"))


def test_missing_config_json_is_a_file_not_found_error(tiny_llama, tmp_path):
    folder = model_folder(tiny_llama, tmp_path / "m", without=("config.json",))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(model=folder, dtype="float32")


def test_missing_safetensors_is_a_file_not_found_error(tiny_llama, tmp_path):
    folder = model_folder(tiny_llama, tmp_path / "m", without=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors weight files"):
        LLM(model=folder, dtype="float32", num_kv_blocks=4)


def test_missing_tokenizer_is_a_file_not_found_error(tiny_llama, tmp_path):
    folder = model_folder(
        tiny_llama, tmp_path / "m", without=("tokenizer.json", "tokenizer_config.json")
    )
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        LLM(model=folder, dtype="float32")


def test_unknown_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    folder = model_folder(tiny_llama, tmp_path / "m", without=("config.json",))
    with open(os.path.join(tiny_llama, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel'.*{SUPPORTED}"):
        LLM(model=folder, dtype="float32", num_kv_blocks=4)


def test_a_real_gpt2_config_names_the_supported_architectures(tiny_llama, tmp_path):
    from transformers import GPT2Config

    folder = model_folder(tiny_llama, tmp_path / "m", without=("config.json",))
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4).to_dict()
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel'.*{SUPPORTED}"):
        LLM(model=folder, dtype="float32", num_kv_blocks=4)


def test_max_model_len_beyond_the_model_positions_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len 2048 exceeds .*max_position_embeddings"):
        LLM(model=tiny_llama, dtype="float32", max_model_len=2048)


# ---- bad prompts -------------------------------------------------------------------------


def test_a_prompt_as_long_as_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=f"32 tokens, but max_model_len is {MAX_MODEL_LEN}"):
        llm.generate([[5] * MAX_MODEL_LEN], greedy(4), use_tqdm=False)
    assert_idle(llm)


def test_the_engine_serves_the_next_request_after_a_refused_one(llm):
    with pytest.raises(ValueError):
        llm.generate([[5] * (MAX_MODEL_LEN + 10)], greedy(4), use_tqdm=False)
    # The longest prompt allowed leaves room for exactly one token.
    (out,) = llm.generate([[5] * (MAX_MODEL_LEN - 1)], greedy(16), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    assert_idle(llm)


@pytest.mark.parametrize(
    "prompt",
    ["", {"prompt_token_ids": []}, {"prompt": ""}],
    ids=["empty-text", "empty-token-ids", "empty-text-in-dict"],
)
def test_an_empty_prompt_is_refused(llm, prompt):
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.engine.add_request("empty", prompt, greedy(4))
    assert_idle(llm)


@pytest.mark.parametrize(
    "token_ids", [[-1], [VOCAB_SIZE], [1, 2, VOCAB_SIZE + 7]], ids=["negative", "vocab", "late"]
)
def test_token_ids_out_of_the_vocabulary_are_refused(llm, token_ids):
    with pytest.raises(ValueError, match=rf"Prompt token ids must be in \[0, {VOCAB_SIZE}\)"):
        llm.engine.add_request("oov", token_ids, greedy(4))
    assert_idle(llm)


def test_the_edges_of_the_vocabulary_are_accepted(llm):
    (out,) = llm.generate([[0, VOCAB_SIZE - 1]], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("token_ids", [[1.0, 2.5], ["a", "b"]], ids=["floats", "strings"])
def test_token_ids_that_are_not_integers_are_refused(llm, token_ids):
    with pytest.raises(ValueError, match="Prompt token ids must be integers"):
        llm.engine.add_request("nonint", {"prompt_token_ids": token_ids}, greedy(4))
    assert_idle(llm)


@pytest.mark.parametrize("prompt", [3.5, None, {"text": "hi"}, [1, "2"]])
def test_a_prompt_of_the_wrong_shape_is_refused(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.engine.add_request("shape", prompt, greedy(4))
    assert_idle(llm)


def test_a_request_id_in_use_is_refused(llm):
    llm.engine.add_request("same", [5, 6], greedy(4))
    with pytest.raises(ValueError, match="'same' is already in use"):
        llm.engine.add_request("same", [7, 8], greedy(4))
    llm.engine.abort_request("same")
    assert_idle(llm)


def test_n_above_max_num_seqs_is_refused(llm):
    # Admission waits until all n sequences fit in max_num_seqs: it would wait forever.
    with pytest.raises(ValueError, match=r"^n \(5\) must be <= max_num_seqs \(4\)"):
        llm.engine.add_request("wide", [5, 6], SamplingParams(n=5))
    assert_idle(llm)


# ---- bad SamplingParams ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", dict(n=0)),
        ("temperature", dict(temperature=-1)),
        ("top_p", dict(top_p=0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-2)),
        ("min_p", dict(min_p=2)),
        ("min_p", dict(min_p=-0.1)),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("presence_penalty", dict(presence_penalty=-2.5)),
        ("frequency_penalty", dict(frequency_penalty=3)),
        ("frequency_penalty", dict(frequency_penalty=-3)),
        ("repetition_penalty", dict(repetition_penalty=0)),
        ("max_tokens", dict(max_tokens=0)),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(min_tokens=5, max_tokens=2)),
        ("logprobs", dict(logprobs=-1)),
        ("prompt_logprobs", dict(prompt_logprobs=-1)),
        ("seed", dict(seed=1.5)),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_invalid_sampling_params_are_refused_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=-1), dict(top_k=0), dict(top_p=1.0), dict(min_p=1.0), dict(temperature=0)],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


# ---- one bad prompt in a batch -----------------------------------------------------------


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_one_bad_prompt_in_a_batch_queues_nothing_and_the_llm_still_generates(llm, bad_index):
    prompts: list = ["Hello there", {"prompt_token_ids": [5, 6, 7]}, "The quick brown fox"]
    prompts[bad_index] = [5] * (MAX_MODEL_LEN + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompts, greedy(4), use_tqdm=False)
    assert_idle(llm)
    prompts[bad_index] = "fine now"
    outputs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert_idle(llm)


def test_one_bad_sampling_params_in_a_batch_queues_nothing(llm):
    params = [greedy(4), SamplingParams(n=5), greedy(4)]
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert_idle(llm)


def test_a_params_list_of_the_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match="Got 2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(4), greedy(4)], use_tqdm=False)
    assert_idle(llm)


# ---- bookkeeping under preemption ----------------------------------------------------------


def test_prompt_logprobs_of_a_request_preempted_mid_prompt_are_returned_once(tiny_llama):
    """A request preempted while its prompt is half computed recomputes it from the start; the
    prompt positions it had already returned must not be returned again."""
    prompts = [list(range(100, 115)), list(range(200, 240))]
    params = [greedy(40), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)]
    small = LLM(
        model=tiny_llama,
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=4,
        max_num_batched_tokens=8,
    )
    _, preempted = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    (alone,) = small.generate(prompts[1:], params[1:], use_tqdm=False)
    assert len(preempted.prompt_logprobs) == len(alone.prompt_logprobs) == 40
    assert [p and sorted(p) for p in preempted.prompt_logprobs] == [
        p and sorted(p) for p in alone.prompt_logprobs
    ]
    assert_idle(small)
