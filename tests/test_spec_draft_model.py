"""Speculative decoding with a draft model, end to end: greedy requests get the tokens of plain
decoding whatever the draft proposes (in every batch shape the scheduler makes), the target as
its own draft has every proposal accepted, seeded sampling is reproducible, and a draft of
another vocabulary is refused.

Drafts are tiny random checkpoints: the target's weights perturbed (so some proposals are
accepted and some rejected), or a model of another architecture (nearly all rejected).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from conftest import assert_idle, in_process_runner
from safetensors.torch import load_file, save_file

from quire import LLM, SamplingParams

# Repetitive prompts of several lengths; the last two share a 32-token prefix (prefix hits).
PROMPTS = [
    [5, 9, 200, 17, 3] * 4,
    [44, 45, 46, 47] * 9,
    [300 + i % 11 for i in range(40)] + [7, 8, 9],
    [300 + i % 11 for i in range(40)] + [1, 2],
]
K = 3
POOL = dict(num_kv_blocks=128)  # 2048 tokens: a default-sized pool takes seconds to allocate


def draft_config(path: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def perturbed_copy(src: str, dst: str, scale: float, seed: int = 7) -> str:
    """The checkpoint at `src` with every weight multiplied by (1 + scale * noise)."""
    if os.path.exists(dst):
        return dst
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(path)
    for name, w in weights.items():
        noise = torch.randn(w.shape, generator=generator, dtype=torch.float32)
        weights[name] = (w.float() * (1 + scale * noise)).to(w.dtype)
    save_file(weights, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    """Per target architecture: a draft close to it (its weights perturbed)."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: perturbed_copy(path, str(root / arch), scale=0.05)
        for arch, path in tiny_models.items()
    }


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_float32_tokens_equal_plain_decoding(tiny_models, drafts, arch):
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, **POOL)  # chunked prefill
    reference = generate(LLM(tiny_models[arch], **kwargs), GREEDY)
    llm = LLM(tiny_models[arch], speculative_config=draft_config(drafts[arch]), **kwargs)
    for _ in range(2):  # the second pass hits the prefix cache
        assert generate(llm, GREEDY) == reference
    stats = llm.engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected
    assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm)


def test_greedy_with_an_unrelated_draft_under_preemption(tiny_models):
    """A draft of another architecture (its proposals nearly all wrong), a pool so small that
    requests are preempted and replayed, n = 2 forks: still the tokens of plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, logprobs=2)
    kwargs = dict(dtype="bfloat16", max_num_batched_tokens=64, num_kv_blocks=12, block_size=8)
    reference = generate(LLM(tiny_models["llama"], **kwargs), params)
    llm = LLM(tiny_models["llama"], speculative_config=draft_config(tiny_models["qwen3"]), **kwargs)
    assert generate(llm, params) == reference  # tokens and logprobs, bit for bit
    assert llm.stats().num_preemptions > 0
    assert llm.engine.spec_decoding_stats.num_drafts > 0
    assert_idle(llm)


BF16 = dict(dtype="bfloat16", max_num_batched_tokens=512, **POOL)


@pytest.fixture(scope="module")
def plain_llama(tiny_llama) -> LLM:
    """tiny_llama in bf16 without speculation (its tokens do not depend on the batch)."""
    return LLM(tiny_llama, **BF16)


@pytest.fixture(scope="module")
def own_draft_llm(tiny_llama) -> LLM:
    """tiny_llama in bf16 as its own draft, k = 3."""
    return LLM(tiny_llama, speculative_config=draft_config(tiny_llama), **BF16)


@pytest.fixture(scope="module")
def own_draft_run(plain_llama, own_draft_llm):
    """Greedy requests with the target as its own draft, batched, on a new engine: (outputs,
    plain outputs, the engine, the engine's steps, the rows of each draft forward). 1 + 5 (k + 1)
    tokens each: every step after the first token verifies a full draft of k."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + 5 * (K + 1), ignore_eos=True)
    reference = generate(plain_llama, params)
    llm = own_draft_llm
    drafter = in_process_runner(llm).proposer.draft  # its ModelForward
    rows = []

    def counted(run):
        def counting(input_ids, *args):
            rows.append(input_ids.shape[0])
            return run(input_ids, *args)

        return counting

    forward, cpu_step = drafter.forward, drafter.cpu_step
    drafter.forward = counted(forward)
    if cpu_step is not None:  # greedy proposals take the C argmax step
        cpu_step.argmax_tokens = counted(cpu_step.argmax_tokens)
    steps_before = llm.engine.num_steps
    outputs = generate(llm, params)
    drafter.forward = forward
    if cpu_step is not None:
        del cpu_step.argmax_tokens  # the class's again
    stats = copy.deepcopy(llm.engine.spec_decoding_stats)
    return outputs, reference, stats, llm.engine.num_steps - steps_before, rows


def test_the_target_as_its_own_draft_has_every_proposal_accepted(own_draft_run):
    outputs, reference, stats, num_steps, _ = own_draft_run
    assert outputs == reference
    assert stats.num_drafts == 5 * len(PROMPTS)
    assert stats.acceptance_rate == 1.0
    assert stats.mean_acceptance_length == K + 1
    assert stats.num_accepted_tokens_per_pos == [5 * len(PROMPTS)] * K
    assert num_steps == 1 + 5  # the prompts' step, then 5 of k + 1


def test_the_draft_runs_k_forwards_a_step_and_skips_the_positions_it_wrote(own_draft_run):
    """After the prompts' step (the draft over the prompts, then k proposing forwards), each
    step's k + 1 accepted positions need the draft's K/V of the last proposal only: the others
    its proposing wrote. That one rides along in the first of the step's k forwards."""
    *_, rows = own_draft_run
    n = len(PROMPTS)
    prompt_tokens = sum(map(len, PROMPTS)) - 32  # the last prompt's first 32 tokens are hits
    prompts_step = [prompt_tokens] + [n] * K
    verifying_step = [n + n] + [n] * (K - 1)
    assert rows == prompts_step + verifying_step * 5


def test_the_target_as_its_own_draft_accepts_every_sampled_proposal(own_draft_run, own_draft_llm):
    """q equals p bit for bit (the draft's decode and the verification of a position are the
    same computation in bf16, with the same penalties, bans and filters), so min(1, p/q) = 1:
    any misaligned position, penalty history or filter would show as a rejection."""
    params = SamplingParams(
        temperature=1.0,
        top_k=30,
        top_p=0.95,
        min_p=0.01,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        repetition_penalty=1.5,
        min_tokens=10,
        seed=4,
        max_tokens=25,
    )
    llm = own_draft_llm  # after own_draft_run: its counters start from that run's
    before = llm.engine.spec_decoding_stats.num_draft_tokens
    generate(llm, params)
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > before
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_idle(llm)


def test_stops_inside_an_accepted_run_cut_it_as_plain_decoding_does(
    own_draft_run, plain_llama, own_draft_llm
):
    """Every proposal of the target as its own draft is accepted, so a stop token id, min_tokens
    and max_tokens fall inside accepted runs: the tokens after them are dropped."""
    plain, llm = plain_llama, own_draft_llm
    (tokens, _), *_ = generate(plain, GREEDY, PROMPTS[:1])[0]
    stop = tokens[6]
    first_stop = tokens.index(stop)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop], min_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ):
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
        expected = plain.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert out.outputs[0].finish_reason == expected.outputs[0].finish_reason
    assert first_stop <= 6
    assert llm.engine.spec_decoding_stats.acceptance_rate == 1.0
    assert_idle(llm)


SEEDED = {
    "top-p": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    "top-k-penalties-n2": SamplingParams(
        temperature=1.2,
        top_k=20,
        seed=5,
        n=2,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        max_tokens=20,
        ignore_eos=True,
        logprobs=1,
    ),
}


@pytest.fixture(scope="module")
def small_vocab(build_model, tmp_path_factory) -> tuple[str, str]:
    """A target of 1024 tokens and a draft close to it: sampling over SmolLM2's 49152 tokens
    (top-p sorts them) would take most of these tests' time."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = build_model(str(root / "target"), "llama", dtype=torch.bfloat16, vocab_size=1024)
    return target, perturbed_copy(target, str(root / "draft"), scale=0.05)


@pytest.mark.parametrize("name", SEEDED)
def test_seeded_sampling_gives_the_same_tokens_across_runs_and_batches(small_vocab, name):
    params, (target, draft) = SEEDED[name], small_vocab
    kwargs = dict(dtype="bfloat16", speculative_config=draft_config(draft), **POOL)
    llm = LLM(target, max_num_batched_tokens=512, **kwargs)
    together = generate(llm, params)
    assert generate(llm, params) == together
    stats = llm.engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both branches ran
    # One at a time, prompts in chunks of 16 tokens: other batches and step structures.
    other = LLM(target, max_num_batched_tokens=16, **kwargs)
    alone = [generate(other, params, [p])[0] for p in reversed(PROMPTS)][::-1]
    assert alone == together
    for completions in together:  # logprobs, where asked, include the emitted tokens
        for token_ids, logprobs in completions:
            if params.logprobs is not None:
                assert all(t in lp for t, lp in zip(token_ids, logprobs))
    assert_idle(llm)


def test_a_draft_of_another_vocabulary_size_is_a_value_error(tiny_llama, build_model, tmp_path):
    draft = build_model(str(tmp_path / "small-vocab"), "llama", vocab_size=1000)
    with pytest.raises(ValueError, match="draft model's vocabulary"):
        LLM(tiny_llama, speculative_config=draft_config(draft))


def test_a_draft_whose_tokenizer_maps_other_ids_is_a_value_error(tiny_llama, tmp_path):
    draft = shutil.copytree(tiny_llama, tmp_path / "other-tokenizer")
    path = draft / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="maps tokens to other ids"):
        LLM(tiny_llama, speculative_config=draft_config(str(draft)))


def test_the_cli_takes_a_draft_model_and_prints_the_plain_greedy_text(tiny_llama, drafts, capsys):
    from quire.entrypoints.cli import main

    argv = ["generate", "Hello there", "--model", tiny_llama, "--max-tokens", "12"]
    argv += ["--num-kv-blocks", "64"]

    assert main(argv) == 0
    plain = capsys.readouterr().out  # the prompt and its completion (the summary is on stderr)
    spec = json.dumps(draft_config(drafts["llama"]))
    assert main([*argv, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain


# ---- "auto": adaptive k with a draft model -----------------------------------------------
AUTO_PARAMS = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)


def test_auto_with_the_target_as_its_own_draft_keeps_the_greedy_tokens(tiny_llama, plain_llama):
    """Every verified proposal is accepted; how many are verified is the cost model's call (a
    draft as costly as the target hardly pays: tests/test_spec_decode_units.py has the choice)."""
    reference = generate(plain_llama, AUTO_PARAMS, PROMPTS[:1])
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": "auto"}
    llm = LLM(tiny_llama, speculative_config=spec, **BF16)
    assert generate(llm, AUTO_PARAMS, PROMPTS[:1]) == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_idle(llm)


def test_auto_with_a_useless_draft_backs_off_to_no_draft(tiny_models, plain_llama):
    """A draft of another architecture: its first verified proposal is rejected, and the
    draft then runs only for the rare probe (one token after 32 steps at k = 0, then 64)."""
    reference = generate(plain_llama, AUTO_PARAMS, PROMPTS[:1])
    spec = {
        "method": "draft_model",
        "model": tiny_models["qwen3"],
        "num_speculative_tokens": "auto",
    }
    llm = LLM(tiny_models["llama"], speculative_config=spec, **BF16)
    drafter = in_process_runner(llm).proposer
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda *args: proposed.append(propose(*args)) or proposed[-1]
    assert generate(llm, AUTO_PARAMS, PROMPTS[:1]) == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_accepted_tokens == 0
    assert 1 <= stats.num_drafts <= 4
    drafted_steps = [p for p in proposed if any(p.values())]
    assert 1 <= len(drafted_steps) <= 4  # of ~80 steps
    assert_idle(llm)


def test_smollm2_bf16_greedy_bits_equal_with_ngram_and_with_itself_as_draft(default_model):
    """The default model in bfloat16 (its GGUF dequantized): greedy tokens and logprobs bit for
    bit with n-gram proposals and with the model as its own draft, in one batch with a chunked
    prompt beside the decodes; as its own draft every proposal is accepted."""
    prompts = [
        "Repeat this exactly: the cat sat on the mat, the cat sat on the mat, the cat sat.",
        "Count: one two three four five six seven eight nine ten one two three four five",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    kwargs = dict(dtype="bfloat16", quantization="none", max_num_batched_tokens=32, **POOL)

    def run(**spec) -> list:
        llm = LLM(default_model, **kwargs, **spec)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm

    reference, _ = run()
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    outputs, llm = run(speculative_config=ngram)
    assert outputs == reference
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    outputs, llm = run(speculative_config=draft_config(default_model))
    assert outputs == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
