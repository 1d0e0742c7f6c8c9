"""The C decode step under tensor parallelism (bf16, two ranks over shared memory): each rank's
model runner takes it, and every step it runs gives the module path's bits on that rank (hidden
states, stored K/V, greedy tokens), with the all-reduces and the argmax across the ranks inside
the C call, and with adapters (each rank's shard of their slots) beside the base model.

Each rank is a process of this test that joins a two-rank group and builds an in-process engine
over it: the model splits by the group, and the two engines, given the same requests, schedule
the same steps, so their collectives pair up as a multiproc engine's ranks' do.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp
from conftest import in_process_model, make_adapter, make_llm, token_prompts
from test_quantized_gguf import TINY_LLAMA

from quire import LoRARequest, SamplingParams
from quire.bench import gguf_files
from quire.distributed.parallel_state import init_tensor_parallel
from quire.executor.multiproc import free_port
from quire.kernels.cpu import gemv
from quire.layers.linear import packed_linear_supported
from quire.layers.quantized_linear import QuantizedLinear

pytestmark = [
    pytest.mark.skipif(
        not (gemv.available() and packed_linear_supported("cpu", torch.bfloat16)),
        reason="the CPU decode path needs AVX-512 BF16 and torch with oneDNN",
    ),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),  # peft
]

WORLD = 2
# arch -> config overrides: a vocabulary that leaves a padding row on rank 1 and an untied LM
# head (llama); qkv bias, a tied LM head and one KV head, replicated on both ranks (qwen2);
# q/k norm (qwen3, three query heads per rank).
CASES = {
    "llama": dict(vocab_size=49153),
    "qwen2": dict(),
    "qwen3": dict(),
}
# and: a random Llama in Q4_1 blocks (TINY_LLAMA: per rank, 2 query heads, so o_proj has 128
# input features, 4 blocks; one KV head; 544 of the MLP's 1,088, so down_proj 17 blocks); the
# tiny Llama above quantized to int8 at load, each rank its shard; the tiny Llama with two
# adapters beside a base request (row-parallel o and down add their partial deltas before the
# all-reduce)
ARCHS = [*CASES, "gguf_q4_1", "llama_int8", "llama_lora"]
ENGINE_ARGS = {
    "llama_int8": dict(quantization="int8"),
    "llama_lora": dict(enable_lora=True, max_loras=2),
}
LENGTHS = [3, 17, 40]
MAX_TOKENS = 8


def _run_rank(
    model: str, tokenizer: str, loras: list[LoRARequest | None] | None, **engine_args
) -> dict:
    """This rank's engine over `model`: whether it has the C step, the request count of every
    step the C step ran (each checked against the module path), and the tokens of a greedy
    batch and of a seeded sampled one (each request with its adapter of `loras`)."""
    from test_cpu_decode import check_each_fused_step

    llm = make_llm(model, dtype="bfloat16", tokenizer=tokenizer, **engine_args)
    runner = in_process_model(llm)
    kept = {m.qtype for m in runner.model.modules() if isinstance(m, QuantizedLinear)}
    cpu_step = llm.stats().c_decode_step
    result = {"cpu_step": cpu_step, "steps": [], "tokens": [], "kept": kept}
    if not cpu_step:
        return result
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    # no autograd in the checks' module path: the Python all-reduce sums with out=
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        result["steps"] = check_each_fused_step(runner, patch)
        for params in (greedy, sampled):
            outputs = llm.generate(
                token_prompts(LENGTHS), params, use_tqdm=False, lora_request=loras
            )
            result["tokens"].append([list(o.outputs[0].token_ids) for o in outputs])
    return result


def _rank_main(
    rank: int, port: int, models: dict[str, str], loras: dict, tokenizer: str, results
) -> None:
    init_tensor_parallel(rank, WORLD, port, "cpu", shm_bytes=1 << 16)
    torch.set_num_threads(1)
    for arch, model in models.items():
        try:
            results[(rank, arch)] = _run_rank(
                model, tokenizer, loras.get(arch), **ENGINE_ARGS.get(arch, {})
            )
        except Exception:  # the other rank may then wait in a collective: end both
            results[(rank, arch)] = {"error": traceback.format_exc()}
            raise


@pytest.fixture(scope="module")
def rank_results(build_model, tokenizer_dir, tmp_path_factory) -> dict[tuple[int, str], dict]:
    root = tmp_path_factory.mktemp("tp_cpu_step")
    models = {arch: build_model(str(root / arch), arch, **o) for arch, o in CASES.items()}
    path = str(root / "llama-q4_1.gguf")
    models["gguf_q4_1"] = gguf_files.write_random(path, "Q4_1", ("llama", TINY_LLAMA))
    models["llama_int8"] = models["llama_lora"] = models["llama"]
    every = make_adapter(models["llama"], str(root / "every"), 1, r=8, lora_alpha=16)
    q_down = make_adapter(
        models["llama"], str(root / "q_down"), 2, r=4, target_modules=["q_proj", "down_proj"]
    )
    loras = {"llama_lora": [LoRARequest("every", 1, every), None, LoRARequest("q", 2, q_down)]}
    with mp.Manager() as manager:
        results = manager.dict()
        args = (free_port(), models, loras, tokenizer_dir, results)
        mp.spawn(_rank_main, args=args, nprocs=WORLD)
        return dict(results)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rank_takes_the_c_step(rank_results, arch):
    for rank in range(WORLD):
        assert rank_results[(rank, arch)]["cpu_step"], rank_results[(rank, arch)]


def test_every_rank_keeps_the_gguf_blocks(rank_results):
    for rank in range(WORLD):
        assert rank_results[(rank, "gguf_q4_1")]["kept"] == {"Q4_1"}
        assert rank_results[(rank, "llama")]["kept"] == set()


def test_every_rank_quantizes_its_shard_to_int8(rank_results):
    for rank in range(WORLD):
        assert rank_results[(rank, "llama_int8")]["kept"] == {"Q8_0"}


@pytest.mark.parametrize("arch", ARCHS)
def test_c_steps_equal_the_module_path_on_every_rank(rank_results, arch):
    # Greedy, then sampled: after each batch's prefill step, every step decodes all requests
    # in one C call, checked bit for bit against the modules inside the rank.
    for rank in range(WORLD):
        assert rank_results[(rank, arch)]["steps"] == [len(LENGTHS)] * (2 * (MAX_TOKENS - 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_ranks_agree_on_every_token(rank_results, arch):
    tokens = [rank_results[(rank, arch)]["tokens"] for rank in range(WORLD)]
    assert tokens[0] == tokens[1]
    assert [len(t) for t in tokens[0][0]] == [MAX_TOKENS] * len(LENGTHS)


def test_adapters_change_their_requests_tokens_alone(rank_results):
    # the greedy batch: an adapter on every module, the base model, q and down alone
    with_loras, base = rank_results[(0, "llama_lora")]["tokens"][0], rank_results[(0, "llama")]
    assert with_loras[1] == base["tokens"][0][1]
    assert with_loras[0] != base["tokens"][0][0] and with_loras[2] != base["tokens"][0][2]
