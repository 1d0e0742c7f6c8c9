"""The one-call-per-layer CPU decode path gives the module path's bits (hidden states and stored
K/V), takes every decode-only step (of any number of requests, AMX or not) and no other, with
or without adapters (multi-LoRA) in the step, and its bf16 logprobs stay as close to float32 as
transformers' own bf16."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import greedy, in_process_model, make_adapter, make_llm, token_prompts

from quire import LLM, LoRARequest, SamplingParams
from quire.attention.forward_context import forward_context
from quire.kernels.cpu import gemv
from quire.layers.linear import packed_linear_supported
from quire.worker.model_forward import ModelForward

pytestmark = [
    pytest.mark.skipif(
        not (gemv.available() and packed_linear_supported("cpu", torch.bfloat16)),
        reason="the CPU decode path needs AVX-512 BF16 and torch with oneDNN",
    ),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),  # peft
]

ARCHS = ["llama", "qwen2", "qwen3"]


def bf16_llm(model_dir: str, **kwargs) -> LLM:
    return make_llm(model_dir, **{"dtype": "bfloat16", **kwargs})


def stored_kv(runner: ModelForward, slots: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's K and V at `slots`, copied."""
    kv = []
    for layer in runner.kv_cache.layers:
        for cache in layer:
            kv.append(cache.flatten(0, 1)[slots].clone())  # [num_slots, num_kv_heads, head_dim]
    return kv


def check_each_fused_step(runner: ModelForward, monkeypatch) -> list[int]:
    """Wraps `runner.cpu_step.forward` and `argmax_tokens` so that each step they run is run
    again through the module path on the same inputs: the hidden states, the K/V the fused step
    stored, and (argmax_tokens) the tokens, the argmax of the module path's logits, must be equal
    bit for bit. Returns the list each checked step's request count is appended to."""
    path, model = runner.cpu_step, runner.model
    fused_forward, fused_argmax = path.forward, path.argmax_tokens
    steps: list[int] = []

    def module_path(input_ids, positions, metadata) -> torch.Tensor:
        with forward_context(metadata, runner.kv_cache.layers, runner.backend):
            return model(input_ids, positions)

    def check(input_ids, positions, metadata, run) -> tuple:
        num_seqs = input_ids.shape[0]  # a decode-only step
        assert metadata.num_decodes == metadata.num_seqs == num_seqs
        result = run()
        fused_kv = stored_kv(runner, metadata.slot_mapping)
        expected = module_path(input_ids, positions, metadata)
        for fused, module in zip(fused_kv, stored_kv(runner, metadata.slot_mapping), strict=True):
            assert torch.equal(fused, module)
        steps.append(num_seqs)
        return result, expected

    def forward(input_ids, positions, metadata):
        hidden, expected = check(
            input_ids,
            positions,
            metadata,
            lambda: fused_forward(input_ids, positions, metadata).clone(),
        )
        assert torch.equal(hidden, expected), (hidden - expected).abs().max()
        return hidden

    def argmax_tokens(input_ids, positions, metadata):
        tokens, expected = check(
            input_ids, positions, metadata, lambda: fused_argmax(input_ids, positions, metadata)
        )
        hidden = path._hidden_out[: len(tokens)]
        assert torch.equal(hidden, expected), (hidden - expected).abs().max()
        assert tokens == model.compute_logits(expected).argmax(dim=-1).tolist()
        return tokens

    monkeypatch.setattr(path, "forward", forward)
    monkeypatch.setattr(path, "argmax_tokens", argmax_tokens)
    return steps


def record_takes(runner: ModelForward, monkeypatch) -> list[tuple[int, int, int, bool]]:
    """Wraps `runner.cpu_step.takes`: (num_tokens, num_decodes, num_seqs, taken) of every step.
    A step is taken exactly when it is decode only (asserted before the fused path would run a
    step it cannot)."""
    path = runner.cpu_step
    takes = path.takes
    seen: list[tuple[int, int, int, bool]] = []

    def spy(metadata, num_tokens):
        taken = takes(metadata, num_tokens)
        decode_only = metadata.num_decodes == metadata.num_seqs == num_tokens
        assert taken == decode_only, (
            metadata.num_decodes,
            metadata.num_seqs,
            num_tokens,
        )
        seen.append((num_tokens, metadata.num_decodes, metadata.num_seqs, taken))
        return taken

    monkeypatch.setattr(path, "takes", spy)
    return seen


@pytest.fixture(scope="module")
def bf16_llms(tiny_models) -> dict[str, LLM]:
    return {arch: bf16_llm(tiny_models[arch]) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_models_get_the_decode_path(bf16_llms, arch) -> None:
    assert bf16_llms[arch].stats().c_decode_step


# Prompt lengths: within one block, across block boundaries (block_size 16), a 1-token prompt.
BATCHES = {
    "one request": ([20], 20),
    "three requests": ([3, 17, 40], 14),
    "eight requests": ([1, 2, 5, 9, 16, 17, 31, 48], 10),
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_equal_the_module_path_bit_for_bit(
    bf16_llms, arch, batch, monkeypatch
) -> None:
    llm = bf16_llms[arch]
    lengths, max_tokens = BATCHES[batch]
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    outputs = llm.generate(token_prompts(lengths), greedy(max_tokens), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [max_tokens] * len(lengths)
    # The prefill step samples the first token; every later step is a decode of all requests.
    assert steps == [len(lengths)] * (max_tokens - 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_finishing_at_different_steps_shrink_the_fused_batch(
    bf16_llms, arch, monkeypatch
) -> None:
    steps = check_each_fused_step(in_process_model(bf16_llms[arch]), monkeypatch)
    params = [greedy(4), greedy(9), greedy(14)]
    bf16_llms[arch].generate(token_prompts([6, 18, 33]), params, use_tqdm=False)
    assert steps == [3] * 3 + [2] * 5 + [1] * 5


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_of_more_than_eight_requests_are_fused_bit_for_bit(
    bf16_llms, arch, monkeypatch
) -> None:
    # 20 requests (GEMV passes of 6 + 7 + 7 rows), then the 12 (6 + 6) that run longer.
    steps = check_each_fused_step(in_process_model(bf16_llms[arch]), monkeypatch)
    params = [greedy(4)] * 8 + [greedy(7)] * 12
    lengths = [1 + 2 * i for i in range(20)]  # 1 to 39 tokens: one to three KV blocks
    outputs = bf16_llms[arch].generate(token_prompts(lengths), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4] * 8 + [7] * 12
    assert steps == [20] * 3 + [12] * 3


def test_decode_only_steps_of_hundreds_of_requests_are_fused(tiny_llama, monkeypatch) -> None:
    llm = bf16_llm(tiny_llama, num_kv_blocks=310, max_num_seqs=300)
    model = in_process_model(llm)
    steps = check_each_fused_step(model, monkeypatch)
    seen = record_takes(model, monkeypatch)
    params = [greedy(2)] * 100 + [greedy(3)] * 200  # 100 requests finish after one decode step
    llm.generate(token_prompts([1] * 300), params, use_tqdm=False)
    assert seen == [(300, 0, 300, False), (300, 300, 300, True), (200, 200, 200, True)]
    assert steps == [300, 200]


def test_mixed_prefill_and_decode_steps_take_the_module_path(tiny_llama, monkeypatch) -> None:
    llm = bf16_llm(tiny_llama, max_num_batched_tokens=16)  # prompts prefill in 16-token chunks
    model = in_process_model(llm)
    steps = check_each_fused_step(model, monkeypatch)
    seen = record_takes(model, monkeypatch)
    llm.generate(token_prompts([4, 30, 30]), greedy(8), use_tqdm=False)
    # Mixed steps, one of them no wider than a fused step could be (2 decodes + 4 prefill tokens).
    assert any(0 < decodes < seqs and tokens <= 8 for tokens, decodes, seqs, _ in seen)
    taken = [seqs for _, _, seqs, was_taken in seen if was_taken]
    assert taken and steps == taken  # each fused step checked against the module path


def check_each_lm_head_argmax(runner: ModelForward, monkeypatch) -> list[int]:
    """Wraps `runner.cpu_step.lm_head_argmax` so that each call's tokens must be the argmax of
    the module path's logits of its rows. Returns the list each call's row count is appended
    to."""
    path, model = runner.cpu_step, runner.model
    fused = path.lm_head_argmax
    calls: list[int] = []

    def lm_head_argmax(hidden):
        tokens = fused(hidden)
        assert tokens == model.compute_logits(hidden).argmax(dim=-1).tolist()
        calls.append(hidden.shape[0])
        return tokens

    monkeypatch.setattr(path, "lm_head_argmax", lm_head_argmax)
    return calls


def test_greedy_rows_of_mixed_steps_take_the_c_lm_head_and_argmax(tiny_llama, monkeypatch):
    llm = bf16_llm(tiny_llama, max_num_batched_tokens=16)  # prompts prefill in 16-token chunks
    calls = check_each_lm_head_argmax(in_process_model(llm), monkeypatch)
    llm.generate(token_prompts([4, 30, 30]), greedy(8), use_tqdm=False)
    # A step's rows: the decodes and the prompt whose last chunk it computes (4 | 12; 1 | 15;
    # 1 + 3 | 12; 2 | 14; 2 + 4), then decode-only steps through argmax_tokens.
    assert calls == [1, 1, 2, 2, 3]


def test_greedy_and_sampled_requests_in_mixed_steps_get_their_tokens_alone(tiny_llama, monkeypatch):
    llm = bf16_llm(tiny_llama, max_num_batched_tokens=16)
    prompts = token_prompts([4, 30, 30])
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
        greedy(8),
        greedy(8, min_tokens=4, stop_token_ids=[0]),  # token 0 banned below 4 outputs
    ]
    calls = check_each_lm_head_argmax(in_process_model(llm), monkeypatch)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # Only greedy rows take the LM head's argmax, beside the sampled first request: the second
    # request's from its prompt's last chunk (step 3) to its 8th token (step 10), the third's
    # from its 5th token (step 9) to its 8th (step 12).
    assert calls == [1] * 6 + [2] * 2 + [1] * 2
    alone = [
        llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
        for p, q in zip(prompts, params)
    ]
    assert together == alone


def lm_head_checkpoint(src: str, dst: str, rows: dict[int, float]) -> str:
    """A copy of checkpoint `src` whose LM head rows are all row 0 of its own, except the
    rows `rows` names, filled with the value given."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weight = model.lm_head.weight.data
    weight[:] = weight[0].clone()
    for row, value in rows.items():
        weight[row] = value
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize(
    "rows,expected",
    [
        ({}, 0),  # every logit equal: the first
        ({41000: float("nan"), 45000: float("nan")}, 41000),  # NaN first, the first NaN
    ],
    ids=["equal logits", "two NaN logits"],
)
@pytest.mark.parametrize("num_rows", [1, 3, 300])
def test_greedy_tokens_break_ties_and_nans_as_torch_argmax(
    tiny_llama, tmp_path, rows, expected, num_rows
):
    # 300 rows: the LM head's 49152 columns in blocks of 192 per thread
    llm = bf16_llm(lm_head_checkpoint(tiny_llama, str(tmp_path / "model"), rows))
    model = in_process_model(llm)
    hidden = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    tokens = model.greedy_tokens(hidden)
    assert tokens == [expected] * num_rows
    assert tokens == model.compute_logits(hidden).argmax(dim=-1).tolist()


@pytest.mark.parametrize("num_rows", [1, 300])
@pytest.mark.parametrize("vocab_size", [49152, 49170], ids=["panels", "a part panel"])
def test_greedy_tokens_are_the_argmax_of_a_random_lm_head(
    tiny_llama, build_model, tmp_path, num_rows, vocab_size
):
    # each row's maximum lies in any block (panel, on AMX) and either thread's columns; most
    # cannot beat the row's best so far and are not searched; 49170 columns end in a part panel
    if vocab_size != 49152:
        from transformers import AutoModelForCausalLM

        path = build_model(str(tmp_path / "model"), "llama", vocab_size=vocab_size)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        head = hf.lm_head.weight.data
        head[-1] = 3 * head[0]  # the last column wins the rows where column 0 is well above 0
        hf.save_pretrained(path)
        tiny_llama = path
    model = in_process_model(bf16_llm(tiny_llama))
    hidden = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(1)) * 4
    hidden = hidden.to(torch.bfloat16)
    expected = model.compute_logits(hidden).argmax(dim=-1).tolist()
    assert model.greedy_tokens(hidden) == expected
    if vocab_size != 49152 and num_rows > 1:
        assert vocab_size - 1 in expected
    assert len(set(expected)) > num_rows // 2  # the rows' maxima are spread over the vocabulary


@pytest.mark.parametrize(
    "dtype,switches",
    [("float32", {}), ("bfloat16", {"gemv": False}), ("bfloat16", {"pack_weights": False})],
)
def test_no_decode_path_without_gemv_packed_bf16_weights(tiny_llama, dtype, switches) -> None:
    assert not bf16_llm(tiny_llama, dtype=dtype, **switches).stats().c_decode_step


@pytest.fixture(scope="module")
def lora_llms(tiny_models, tmp_path_factory) -> dict[str, tuple[LLM, list[LoRARequest]]]:
    """Per architecture: a bf16 engine with two adapter slots, and two peft adapters on its
    model: every module at rank 8, and q and down alone at rank 4 (o and gate|up add nothing)."""
    root = tmp_path_factory.mktemp("cpu_decode_lora")
    result = {}
    for arch in ARCHS:
        paths = [
            make_adapter(tiny_models[arch], str(root / f"{arch}-all"), 1, r=8, lora_alpha=16),
            make_adapter(
                tiny_models[arch],
                str(root / f"{arch}-q-down"),
                2,
                r=4,
                lora_alpha=32,
                target_modules=["q_proj", "down_proj"],
            ),
        ]
        loras = [LoRARequest(f"{arch}-{i}", i + 1, path) for i, path in enumerate(paths)]
        result[arch] = (bf16_llm(tiny_models[arch], enable_lora=True, max_loras=2), loras)
    return result


def lora_outputs(llm: LLM, prompts: list[dict], loras: list, **params) -> list[tuple]:
    """Each request's tokens, and the logprob of each (when `params` asks for logprobs)."""
    outputs = llm.generate(prompts, greedy(10, **params), use_tqdm=False, lora_request=loras)
    return [
        (c.token_ids, c.logprobs and [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for c in (o.outputs[0] for o in outputs)
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_enabled_engines_get_the_decode_path(lora_llms, arch) -> None:
    assert lora_llms[arch][0].stats().c_decode_step


@pytest.mark.parametrize("arch", ARCHS)
def test_base_decode_steps_of_a_lora_enabled_engine_are_fused_bit_for_bit(
    lora_llms, bf16_llms, arch, monkeypatch
) -> None:
    llm, _ = lora_llms[arch]
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    prompts = token_prompts([3, 17, 40])
    got = lora_outputs(llm, prompts, [None] * 3, logprobs=0)
    assert steps == [3] * 9
    assert got == lora_outputs(bf16_llms[arch], prompts, [None] * 3, logprobs=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_with_adapter_rows_are_fused_bit_for_bit(lora_llms, arch, monkeypatch):
    llm, (every, q_down) = lora_llms[arch]
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    loras = [None, every, q_down, every]  # two slots and a base row in each step
    prompts = token_prompts([3, 17, 40, 9])
    got = lora_outputs(llm, prompts, loras)  # greedy tokens: the fused argmax
    assert steps == [4] * 9
    assert got != lora_outputs(llm, prompts, [None] * 4)  # the adapters add something


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_steps_give_a_request_with_an_adapter_its_bits_alone(lora_llms, arch, monkeypatch):
    llm, (every, q_down) = lora_llms[arch]
    prompts, loras = token_prompts([5, 20, 33]), [q_down, every, None]
    alone = [lora_outputs(llm, [p], [lora], logprobs=0)[0] for p, lora in zip(prompts, loras)]
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    assert lora_outputs(llm, prompts, loras, logprobs=0) == alone
    assert steps == [3] * 9


def scaled_gate_checkpoint(src: str, dst: str, scale: float) -> str:
    """A copy of checkpoint `src` with every MLP gate projection scaled: wider SiLU inputs."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for layer in model.model.layers:
        layer.mlp.gate_proj.weight.data *= scale
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize(
    "gate_scale",
    [
        8,  # gates up to ~30: some are exactly 5.9375, whose SiLU a float32 formula rounds wrong
        100,  # gates down to the -100s, where exp(-gate) overflows
    ],
)
def test_wide_gate_activations_decode_like_the_module_path(
    tiny_llama, tmp_path, gate_scale, monkeypatch
) -> None:
    llm = bf16_llm(scaled_gate_checkpoint(tiny_llama, str(tmp_path / "model"), gate_scale))
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    prompts = token_prompts([4 * (i + 1) for i in range(12)])  # 12 requests: two 6-row passes
    llm.generate(prompts, greedy(12), use_tqdm=False)
    assert steps == [12] * 11


PROMPT = (
    "Once upon a time, in a land far away, there lived a dragon who def fibonacci(n): 1, 2, 3, "
    "The capital of France is A"
)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_decode_logprobs_are_as_close_to_float32_as_transformers_bf16(
    bf16_llms, tiny_models, arch, monkeypatch
) -> None:
    from transformers import AutoModelForCausalLM

    steps = check_each_fused_step(in_process_model(bf16_llms[arch]), monkeypatch)
    num_new = 24
    (output,) = bf16_llms[arch].generate(
        [PROMPT], greedy(num_new, min_tokens=num_new, logprobs=0), use_tqdm=False
    )
    assert steps == [1] * (num_new - 1)
    completion = output.outputs[0]
    tokens = completion.token_ids
    ours = torch.tensor([completion.logprobs[i][t].logprob for i, t in enumerate(tokens)])
    ids = output.prompt_token_ids + tokens
    num_prompt = len(output.prompt_token_ids)

    def teacher_forced(dtype: torch.dtype) -> torch.Tensor:  # logprobs of `tokens` [num_new]
        model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=dtype)
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return logprobs[num_prompt - 1 : -1].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)

    exact, hf_bf16 = teacher_forced(torch.float32), teacher_forced(torch.bfloat16)
    hf_error = (hf_bf16 - exact).abs().mean().item()
    our_error = (ours - exact).abs().mean().item()
    # Measured: quire's mean error is 0.7-1.03x transformers' (0.005-0.01).
    assert our_error <= 1.25 * hf_error + 1e-3, (our_error, hf_error)


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory, build_model) -> str:
    """A random 2-layer checkpoint of SmolLM2-135M's shapes: 9 query heads over 3 KV heads of
    64, hidden 576, MLP 1536, tied embeddings (the default GGUF model takes ~11 s to load)."""
    return build_model(
        str(tmp_path_factory.mktemp("smollm2_shaped")),
        "llama",
        dtype=torch.bfloat16,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        initializer_range=0.05,
    )


def test_smollm2_shapes_decode_like_the_module_path(smollm2_shaped, monkeypatch) -> None:
    llm = LLM(smollm2_shaped, num_kv_blocks=16)  # dtype auto: the checkpoint's bf16
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    (output,) = llm.generate(["The capital of France is"], greedy(16), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 16
    assert steps == [1] * 15


def test_a_token_id_or_position_outside_the_tables_is_a_value_error(bf16_llms, monkeypatch):
    """The C step checks every token id against the embedding table and every position against
    the rotary tables before computing anything, as the module path's indexing would."""
    llm = bf16_llms["llama"]
    runner = in_process_model(llm)
    model, path = runner.model, runner.cpu_step
    fused_forward = path.forward
    inputs = []

    def capture(input_ids, positions, metadata):
        inputs.append((input_ids.clone(), positions.clone(), metadata))
        return fused_forward(input_ids, positions, metadata)

    monkeypatch.setattr(path, "forward", capture)
    # logprobs: the step goes through forward, not argmax_tokens
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(2, logprobs=0), use_tqdm=False)
    input_ids, positions, metadata = inputs[-1]
    vocab, max_position = model.embed_tokens.weight.shape[0], model.rotary.cos_cache.shape[0]
    for run in (fused_forward, path.argmax_tokens):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            run(torch.full_like(input_ids, vocab), positions, metadata)
        with pytest.raises(ValueError, match="outside the rotary tables"):
            run(input_ids, torch.full_like(positions, max_position), metadata)
