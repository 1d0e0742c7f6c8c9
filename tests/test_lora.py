"""quire/lora: adapters made with peft on tiny random models give quire's model modules peft's
logits (float32), one request or several adapters in one batch; GGUF LoRA files read as the
PEFT folder they came from; every bad adapter is refused naming what is wrong; adapters stay
loaded and take slots by LRU; a row's bf16 delta does not depend on the rows beside it."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quire.attention.backend import AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.attention.torch_backend import TorchAttentionBackend
from quire.config import EngineConfig
from quire.kernels.cpu import gemv, qmatmul
from quire.kernels.cpu import lora as lora_kernel
from quire.layers.linear import PackedLinear, packed_linear_supported
from quire.layers.lora_linear import LoRAMapping, lora_context
from quire.layers.quantized_linear import QuantizedLinear
from quire.lora import LoRAAdapterError, LoRAConfig, LoRAManager, LoRARequest, load_adapter
from quire.lora.ops import CpuLoRAOps, TorchLoRAOps, lora_ops
from quire.model.loader import load_model
from quire.model.model_config import load_model_config

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 512
BLOCK = 16  # KV block size of the forwards below; prompts fit one block each

# two adapters per base: every module at one rank, and rslora with per-module ranks and alphas
PLAIN = dict(r=8, lora_alpha=16, target_modules=MODULES)
PATTERNED = dict(
    r=8,
    lora_alpha=8,
    use_rslora=True,
    target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
    rank_pattern={"v_proj": 4, "down_proj": 16},
    alpha_pattern={"o_proj": 3},
)
# prompt chunks (SGMV rows) and a one-token request (a BGMV row, as a decode's)
PROMPTS = [[5, 17, 300, 42, 7, 99], [11, 12, 13, 14, 15, 200, 201, 3, 9], [88, 400, 2], [77]]
ADAPTERS = ["plain", None, "patterned", "plain"]


def make_adapter(base: str, path: str, seed: int, **lora) -> str:
    """A peft adapter with random (non-zero) A and B on `base`, saved at `path`."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    get_peft_model(model, LoraConfig(init_lora_weights=False, **lora)).save_pretrained(path)
    return path


def peft_logits(base: str, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def adapted(request, build_model, tmp_path_factory) -> dict[str, str]:
    """A tiny base model of each architecture and two adapters on it."""
    root = tmp_path_factory.mktemp(request.param)
    base = build_model(str(root / "base"), request.param, vocab_size=VOCAB)
    return {
        "arch": request.param,
        "base": base,
        "plain": make_adapter(base, str(root / "plain"), 1, **PLAIN),
        "patterned": make_adapter(base, str(root / "patterned"), 2, **PATTERNED),
    }


def quire_model(base: str, dtype: str = "float32", max_loras: int = 2, quantization: str = "auto"):
    config = EngineConfig(model=base, dtype=dtype, quantization=quantization)
    model_config = load_model_config(config)
    model = load_model(
        config,
        model_config,
        getattr(torch, dtype),
        64,
        max_loras=max_loras,
        max_lora_rank=16,
    )
    return model, model_config


def forward(model, model_config, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
    """One prefill step of `prompts` (each its own sequence and KV block), each row adding its
    request's adapter slot (-1: none); the hidden states [tokens, hidden]."""
    lens = [len(p) for p in prompts]
    starts = np.cumsum([0, *lens]).tolist()
    shape = (len(prompts), BLOCK, model_config.num_key_value_heads, model_config.head_dim)
    dtype = model.embed_tokens.weight.dtype
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(model_config.num_hidden_layers)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.cat([i * BLOCK + torch.arange(n) for i, n in enumerate(lens)]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.arange(len(prompts), dtype=torch.int32)[:, None],
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        num_decodes=0,
        num_decode_tokens=0,
    )
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    mapping = LoRAMapping.from_requests(slots, lens)
    with torch.no_grad(), forward_context(metadata, caches, TorchAttentionBackend()):
        with lora_context(mapping, lora_ops("cpu", dtype)):
            return model(input_ids, positions)


def test_a_batch_of_the_base_and_two_adapters_gives_each_request_peft_logits(adapted):
    model, model_config = quire_model(adapted["base"])
    manager = LoRAManager(LoRAConfig(max_loras=2), model_config, model)
    for i, name in enumerate(["plain", "patterned"]):
        manager.add(LoRARequest(name, i + 1, adapted[name]))
    slots = manager.activate(["plain", "patterned"])
    hidden = forward(model, model_config, PROMPTS, [slots.get(a, -1) for a in ADAPTERS])
    logits = model.compute_logits(hidden).split([len(p) for p in PROMPTS])
    for prompt, adapter, got in zip(PROMPTS, ADAPTERS, logits):
        want = peft_logits(adapted["base"], adapted.get(adapter), prompt)
        base = peft_logits(adapted["base"], None, prompt)
        assert adapter is None or (want - base).abs().max() > 0.1  # the adapter changes them
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_rslora_and_patterns_set_each_modules_rank_and_scale(adapted):
    adapter = load_adapter(
        "patterned",
        adapted["patterned"],
        load_model_config(EngineConfig(model=adapted["base"])),
        max_lora_rank=16,
    )
    layer = adapter.layers[0]
    assert sorted(layer) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    # rslora: alpha / sqrt(rank); alpha_pattern gives o_proj 3, rank_pattern v 4 and down 16
    assert {m: (w.rank, w.scale) for m, w in layer.items()} == {
        "q_proj": (8, 8 / 8**0.5),
        "v_proj": (4, 8 / 4**0.5),
        "o_proj": (8, 3 / 8**0.5),
        "down_proj": (16, 8 / 16**0.5),
    }
    assert adapter.rank == 16


# --- GGUF LoRA files ---------------------------------------------------------------------

GGUF_KINDS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def write_gguf_lora(peft_dir: str, path: str, arch: str, heads: dict[str, int], **metadata):
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: llama.cpp's tensor
    names, q and k rows of B permuted for llama, adapter.lora.alpha."""
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        alpha = json.load(f)["lora_alpha"]
    writer = GGUFWriter(path, arch)
    writer.add_type(metadata.pop("general_type", "adapter"))
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for name, tensor in sorted(
        load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()
    ):
        parts = name.split(".")  # base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
        layer, module, which = parts[4], parts[6], parts[7][-1].lower()
        values = tensor.float().numpy()
        if which == "b" and arch == "llama" and module in ("q_proj", "k_proj"):
            n = heads[module]  # llama.cpp's LlamaModel.permute
            values = values.reshape(n, 2, values.shape[0] // n // 2, -1).swapaxes(1, 2)
            values = values.reshape(tensor.shape)
        writer.add_tensor(f"blk.{layer}.{GGUF_KINDS[module]}.weight.lora_{which}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_lora_reads_as_the_peft_folder_it_came_from(adapted, tmp_path):
    model_config = load_model_config(EngineConfig(model=adapted["base"]))
    heads = {"q_proj": model_config.num_attention_heads, "k_proj": model_config.num_key_value_heads}
    path = write_gguf_lora(adapted["plain"], str(tmp_path / "a.gguf"), adapted["arch"], heads)
    from_gguf = load_adapter("g", path, model_config, 16)
    from_peft = load_adapter("p", adapted["plain"], model_config, 16)
    for gguf_layer, peft_layer in zip(from_gguf.layers, from_peft.layers, strict=True):
        assert sorted(gguf_layer) == sorted(MODULES)
        for module, w in peft_layer.items():
            assert torch.equal(gguf_layer[module].lora_a, w.lora_a)
            assert torch.equal(gguf_layer[module].lora_b, w.lora_b)
            assert gguf_layer[module].scale == w.scale == 2.0


# --- adapters refused, naming what is wrong ----------------------------------------------


@pytest.fixture(scope="module")
def llama_adapter(build_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama_adapter")
    base = build_model(str(root / "base"), "llama", vocab_size=VOCAB)
    return {
        "base": base,
        "adapter": make_adapter(base, str(root / "adapter"), 3, **PLAIN),
        "config": load_model_config(EngineConfig(model=base)),
    }


def edited(llama_adapter, tmp_path, config=None, tensors=None) -> str:
    """A copy of the llama adapter with adapter_config.json fields replaced (`config`) or its
    tensors replaced (`tensors`: a function of the state dict)."""
    path = str(tmp_path / "edited")
    shutil.copytree(llama_adapter["adapter"], path)
    config_path = os.path.join(path, "adapter_config.json")
    if config is not None:
        with open(config_path) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(config_path, "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        weights = os.path.join(path, "adapter_model.safetensors")
        save_file(tensors(load_file(weights)), weights)
    return path


def refused(llama_adapter, path: str, max_lora_rank: int = 16) -> str:
    with pytest.raises(LoRAAdapterError) as error:
        load_adapter("x", path, llama_adapter["config"], max_lora_rank)
    return str(error.value).replace(path, "<path>")


def test_a_rank_above_max_lora_rank_is_refused(llama_adapter, tmp_path):
    assert load_adapter("x", llama_adapter["adapter"], llama_adapter["config"], 8).rank == 8

    def q_at_rank_16(tensors: dict) -> dict:
        a, b = (f"base_model.model.model.layers.0.self_attn.q_proj.lora_{x}.weight" for x in "AB")
        return {**tensors, a: torch.zeros(16, 64), b: torch.zeros(128, 16)}

    rank_pattern = {"rank_pattern": {"model.layers.0.self_attn.q_proj": 16}}
    path = edited(llama_adapter, tmp_path, config=rank_pattern, tensors=q_at_rank_16)
    assert load_adapter("x", path, llama_adapter["config"], 16).rank == 16
    assert refused(llama_adapter, path, max_lora_rank=8) == (
        "<path>: rank 16 is above max_lora_rank 8: pass a max_lora_rank of at least 16."
    )


def test_a_missing_adapter_is_refused(llama_adapter, tmp_path):
    path = str(tmp_path / "nothing")
    assert refused(llama_adapter, path) == (
        "<path>: no such adapter: lora_path names a PEFT folder (adapter_config.json + "
        "adapter_model.safetensors) or a GGUF LoRA file."
    )
    os.mkdir(path)
    assert refused(llama_adapter, path) == (
        "<path>/adapter_config.json: not found: a PEFT adapter folder holds adapter_config.json and "
        "adapter_model.safetensors."
    )


def test_a_folder_without_weights_is_refused(llama_adapter, tmp_path):
    path = edited(llama_adapter, tmp_path)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    assert refused(llama_adapter, path) == (
        "<path>: has no adapter_model.safetensors (PEFT's save_pretrained writes it; an "
        "adapter_model.bin is not read)."
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("r", "8", "r must be a positive integer, not '8'."),
        ("lora_alpha", 0, "lora_alpha must be a positive number, not 0."),
        ("use_dora", True, "use_dora must be false (DoRA adapters are not supported), not True."),
        ("bias", "all", "bias must be none (quire adds no adapter biases), not 'all'."),
        ("peft_type", "IA3", "peft_type must be LORA (quire runs LoRA adapters), not 'IA3'."),
    ],
)
def test_a_malformed_adapter_config_names_the_field(llama_adapter, tmp_path, field, value, message):
    path = edited(llama_adapter, tmp_path, config={field: value})
    assert refused(llama_adapter, path) == f"<path>/adapter_config.json: {message}"


def test_an_adapter_config_that_is_not_json_is_refused(llama_adapter, tmp_path):
    path = edited(llama_adapter, tmp_path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{r: 8")
    assert refused(llama_adapter, path).startswith("<path>/adapter_config.json: not valid JSON (")


def test_a_target_module_the_base_lacks_is_refused(llama_adapter, tmp_path):
    path = edited(llama_adapter, tmp_path, config={"target_modules": ["q_proj", "c_attn"]})
    assert refused(llama_adapter, path) == (
        "<path>/adapter_config.json: target_modules targets 'c_attn', a module the base model lacks; "
        "adapters may target q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."
    )


@pytest.mark.parametrize(
    "config",
    [{"modules_to_save": ["lm_head"]}, {"target_modules": ["q_proj", "embed_tokens"]}],
)
def test_an_adapter_that_changes_the_vocabulary_is_refused(llama_adapter, tmp_path, config):
    path = edited(llama_adapter, tmp_path, config=config)
    what = (
        "modules_to_save lists lm_head"
        if "modules_to_save" in config
        else ("target_modules targets embed_tokens")
    )
    assert refused(llama_adapter, path) == (
        f"<path>/adapter_config.json: {what}: an adapter that changes the vocabulary (embeddings or "
        "LM head) is not supported; train it without embed_tokens / lm_head."
    )


def test_an_adapter_with_vocabulary_tensors_is_refused(llama_adapter, tmp_path):
    path = edited(
        llama_adapter,
        tmp_path,
        tensors=lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
    )
    assert refused(llama_adapter, path) == (
        "<path>/adapter_model.safetensors: tensor 'base_model.model.lm_head.lora_A.weight': an adapter "
        "that changes the vocabulary (embeddings or LM head) is not supported; train it without "
        "embed_tokens / lm_head."
    )


def test_an_adapter_for_another_hidden_size_is_refused(llama_adapter, tmp_path):
    path = edited(
        llama_adapter,
        tmp_path,
        tensors=lambda t: {k: torch.zeros(8, 128) if "lora_A" in k else v for k, v in t.items()},
    )
    assert refused(llama_adapter, path) == (
        "<path>/adapter_model.safetensors: layer 0 gate_proj maps 128 features to 128, the base "
        "model's 64 to 128 (hidden_size 64): an adapter for another model."
    )


def test_an_adapter_for_more_layers_is_refused(llama_adapter, tmp_path):
    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    path = edited(
        llama_adapter,
        tmp_path,
        tensors=lambda t: {
            **t,
            name.format(5, "A"): torch.zeros(8, 64),
            name.format(5, "B"): torch.zeros(128, 8),
        },
    )
    assert refused(llama_adapter, path) == (
        "<path>/adapter_model.safetensors: the adapter has layer 5, and the base model 2 layers: an "
        "adapter for another model."
    )


def test_a_gguf_lora_for_another_architecture_is_refused(llama_adapter, tmp_path):
    heads = {"q_proj": 4, "k_proj": 2}
    path = write_gguf_lora(llama_adapter["adapter"], str(tmp_path / "q.gguf"), "qwen2", heads)
    assert refused(llama_adapter, path) == (
        "<path>: general.architecture is 'qwen2': an adapter for another model than the base "
        "(LlamaForCausalLM)."
    )


def test_a_gguf_model_file_is_no_adapter(llama_adapter, tmp_path):
    heads = {"q_proj": 4, "k_proj": 2}
    path = write_gguf_lora(
        llama_adapter["adapter"], str(tmp_path / "m.gguf"), "llama", heads, general_type="model"
    )
    assert refused(llama_adapter, path) == (
        "<path>: general.type is 'model', not 'adapter': this GGUF file is not a LoRA adapter."
    )


# --- configuration ------------------------------------------------------------------------


def test_lora_config_defaults_are_vllms():
    assert LoRAConfig() == LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=8)
    assert LoRAConfig(max_loras=12).max_cpu_loras == 12


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_loras": 0}, "max_loras must be a positive integer, not 0."),
        (
            {"max_lora_rank": 12},
            "max_lora_rank must be one of 8, 16, 32, 64, 128, 256, not 12: pass the smallest "
            "that holds your adapters' ranks.",
        ),
        (
            {"max_loras": 4, "max_cpu_loras": 2},
            "max_cpu_loras (2) must be an integer of at least max_loras (4): every adapter in a "
            "step is kept loaded.",
        ),
    ],
)
def test_a_bad_lora_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        LoRAConfig(**kwargs)
    assert str(error.value) == message


def test_a_lora_request_needs_a_positive_id():
    assert LoRARequest("sql", 1, "/adapters/sql").lora_int_id == 1
    with pytest.raises(ValueError, match=r"^lora_int_id must be a positive integer, not 0\.$"):
        LoRARequest("sql", 0, "/adapters/sql")


# --- the manager: loaded adapters (LRU) and slots -----------------------------------------


@pytest.fixture
def manager(llama_adapter, tmp_path) -> LoRAManager:
    """Two slots, three adapters kept loaded; adapters a..d are copies of the llama adapter."""
    for name in "abcd":
        shutil.copytree(llama_adapter["adapter"], tmp_path / name)
    model, model_config = quire_model(llama_adapter["base"], max_loras=2)
    return LoRAManager(LoRAConfig(max_loras=2, max_cpu_loras=3), model_config, model)


def request(tmp_path, name: str) -> LoRARequest:
    return LoRARequest(name, ord(name), str(tmp_path / name))


def test_loading_past_max_cpu_loras_evicts_the_least_recently_used(manager, tmp_path):
    for name in "abc":
        manager.add(request(tmp_path, name))
    manager.add(request(tmp_path, "a"))  # used again: b is now the least recently used
    manager.add(request(tmp_path, "d"))
    assert manager.loaded() == ["c", "a", "d"]


def test_an_adapter_a_request_holds_is_not_evicted(manager, tmp_path):
    for name in "abc":
        manager.add(request(tmp_path, name))
    manager.acquire("a")
    manager.add(request(tmp_path, "b"))
    manager.add(request(tmp_path, "c"))  # a, held, is now the least recently used
    manager.add(request(tmp_path, "d"))
    assert manager.loaded() == ["a", "c", "d"]


def test_each_load_is_a_new_identity(manager, tmp_path):
    first = manager.add(request(tmp_path, "a"))
    assert manager.add(request(tmp_path, "a")) == first  # loaded: the same
    manager.remove("a")
    again = manager.add(request(tmp_path, "a"))
    assert (again.name, again.path) == (first.name, first.path)
    assert again != first
    with pytest.raises(LoRAAdapterError, match="adapter 'a' is loaded from .*/a, not .*/b: "):
        manager.add(LoRARequest("a", 1, str(tmp_path / "b")))


def test_unloading_an_adapter_in_use_waits_for_its_last_release(manager, tmp_path):
    manager.add(request(tmp_path, "a"))
    manager.acquire("a")
    manager.remove("a")
    assert manager.loaded() == ["a"]
    with pytest.raises(LoRAAdapterError, match="adapter 'a' is being unloaded"):
        manager.add(request(tmp_path, "a"))
    manager.release("a")
    assert manager.loaded() == []


def test_a_steps_adapters_keep_their_slots_and_reuse_the_least_recently_active(manager, tmp_path):
    for name in "abc":
        manager.add(request(tmp_path, name))
    assert manager.activate(["a"]) == {"a": 0}
    assert manager.activate(["b"]) == {"b": 1}  # an empty slot first
    assert manager.activate(["b", "a"]) == {"b": 1, "a": 0}
    assert manager.activate(["c", "a"]) == {"c": 1, "a": 0}  # b was active least recently
    with pytest.raises(ValueError, match="^3 adapters in one step, and max_loras is 2.$"):
        manager.activate(["a", "b", "c"])


# --- batch invariance ---------------------------------------------------------------------


OPS = [
    TorchLoRAOps,
    pytest.param(
        CpuLoRAOps,
        marks=pytest.mark.skipif(
            not lora_kernel.supported(torch.empty(0)), reason="the C kernels are off here"
        ),
    ),
]


def add_lora_rows(
    ops, requests: list[tuple[int, torch.Tensor, torch.Tensor]], slot_of: dict[int, int]
) -> list[torch.Tensor]:
    """`ops` over one step of `requests` (adapter, x rows, base output rows; adapter -1: none),
    adapter i in slot `slot_of[i]` of a q|k|v-like layer (4 slots, rank 16, stacks in the rows'
    dtype); each request's output rows."""
    generator = torch.Generator().manual_seed(0)
    dtype = requests[0][1].dtype
    adapters_a = (torch.randn(4, 3 * 16, 576, generator=generator) / 10).to(dtype)
    adapters_b = (torch.randn(4, 16, 80, generator=generator) / 10).to(dtype)
    lora_a, lora_b = torch.zeros_like(adapters_a), torch.zeros_like(adapters_b)
    for adapter, slot in slot_of.items():
        lora_a[slot], lora_b[slot] = adapters_a[adapter], adapters_b[adapter]
    x = torch.cat([rows for _, rows, _ in requests])
    out = torch.cat([rows for _, _, rows in requests])
    sizes = [rows.shape[0] for _, rows, _ in requests]
    slots = [slot_of.get(adapter, -1) for adapter, _, _ in requests]
    mapping = LoRAMapping.from_requests(slots, sizes)
    ops().add_lora(out, x, lora_a, lora_b, [(0, 48), (48, 16), (64, 16)], mapping)
    return list(out.split(sizes))


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, dtype):
    def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return (
            torch.randn(n, 576, generator=generator).to(dtype),
            torch.randn(n, 80, generator=generator).to(dtype),
        )

    # The C kernel splits a group of many rows (here adapter 3's 150, and adapter 1's 31 decode
    # rows) by rows between its threads, a tile at a time, and a small one by ranks: a row's
    # bits must not tell which.
    prompt, decode, long_prompt = rows(7, 1), rows(1, 2), rows(150, 5)
    alone = add_lora_rows(ops, [(2, *prompt), (1, *decode)], {2: 0, 1: 1})
    mixed = add_lora_rows(
        ops,
        [(0, *rows(1, 3)), (1, *decode), (-1, *rows(5, 4)), (2, *prompt), (3, *long_prompt)]
        + [(1, *rows(1, 6 + i)) for i in range(30)],
        {0: 0, 1: 1, 2: 2, 3: 3},  # adapter 2 in another slot than alone
    )
    assert torch.equal(mixed[3], alone[0])  # the prompt chunk (SGMV)
    assert torch.equal(mixed[1], alone[1])  # the decode row (BGMV)
    in_fives = [
        add_lora_rows(ops, [(3, x, out)], {3: 0})[0]
        for x, out in zip(*(t.split(5) for t in long_prompt))
    ]
    assert torch.equal(torch.cat(in_fives), mixed[4])
    chunks = [
        add_lora_rows(ops, [(2, x, out)], {2: 3})[0]
        for x, out in zip(*(t.split([3, 4]) for t in prompt))
    ]
    assert torch.equal(torch.cat(chunks), alone[0])  # chunked otherwise
    assert not torch.equal(alone[0], prompt[1])  # the adapter adds something


@pytest.mark.skipif(not lora_kernel.supported(torch.empty(0)), reason="the C kernels are off")
@pytest.mark.parametrize(
    "dtype, tolerance",
    [(torch.float32, dict(atol=1e-4, rtol=1e-5)), (torch.bfloat16, dict(atol=0, rtol=2**-7))],
)
def test_the_c_kernel_adds_what_the_torch_ops_add(dtype, tolerance):
    def step(ops) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(30, 576, generator=generator).to(dtype)
        out = torch.randn(30, 80, generator=generator).to(dtype)
        requests = [(a, x[i : i + n], out[i : i + n]) for a, i, n in [(0, 0, 9), (-1, 9, 4)]]
        requests += [(i % 4 - 1, x[i : i + 1], out[i : i + 1]) for i in range(13, 30)]
        return torch.cat(add_lora_rows(ops, requests, {0: 2, 1: 0, 2: 1}))

    torch.testing.assert_close(step(CpuLoRAOps), step(TorchLoRAOps), **tolerance)


def quantized_weight(qtype: str, weight: np.ndarray) -> torch.Tensor:
    """`weight` [N, K] float32 in GGUF blocks of `qtype` (or row parts "A+B": rows 0-135 in A,
    the rest in B), packed for qmatmul."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from quire.bench.kquants import quantize_k

    def blocks(rows: np.ndarray, qtype: str) -> np.ndarray:
        if qtype.endswith("_K"):
            return quantize_k(rows, qtype)
        return quantize(rows, GGMLQuantizationType[qtype])

    if "+" in qtype:
        first, second = qtype.split("+")
        parts = [(blocks(weight[:136], first), first), (blocks(weight[136:], second), second)]
        return qmatmul.pack_parts(parts, weight.shape[1])
    return qmatmul.pack(blocks(weight, qtype), qtype, weight.shape[1])


@pytest.mark.skipif(not qmatmul.available(), reason="the C kernels are off")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q4_K+Q6_K"])
@pytest.mark.parametrize("slots", [[0], [1, -1, 0], [2, 2, -1, 1, 0], [-1, 3] + [1] * 14])
def test_a_quantized_projection_with_adapters_gives_lora_adds_bits(qtype, slots):
    """qmatmul_lora (the C decode step's projection with adapters) is qmatmul then lora_add, bit
    for bit, whatever its threads: 1 to 5 split 5 panels of 32 columns so that a thread's
    columns start inside a module, inside one of lora_add's pieces of 64 columns and inside a
    vector of 16 (module widths 96, 40 and 24: pieces of 64 + 32, and 40 = 16 + 16 + 8); a
    weight in parts runs the shrink with its first part and each part's columns after it."""
    generator = torch.Generator().manual_seed(1)
    out_slices = torch.tensor([[0, 96], [96, 40], [136, 24]], dtype=torch.int32)
    out_features, in_features, rank = 160, 256 if "_K" in qtype else 96, 8
    weight = torch.randn(out_features, in_features, generator=generator).numpy()
    packed = quantized_weight(qtype, weight)
    bias = torch.randn(out_features, generator=generator).bfloat16()
    lora_a = (torch.randn(4, 3 * rank, in_features, generator=generator) / 4).bfloat16()
    lora_b = (torch.randn(4, rank, out_features, generator=generator) / 4).bfloat16()
    x = torch.randn(len(slots), in_features, generator=generator).bfloat16()
    token_slots = torch.tensor(slots, dtype=torch.int32)
    expected = qmatmul.qmatmul(x, packed, qtype, bias, out_features)
    base = expected.clone()
    lora_kernel.lora_add(expected, x, lora_a, lora_b, token_slots, out_slices)
    assert not torch.equal(expected[token_slots >= 0], base[token_slots >= 0])
    assert torch.equal(expected[token_slots < 0], base[token_slots < 0])
    for threads in range(1, 6):
        fused = lora_kernel.qmatmul_lora(
            x, packed, qtype, bias, out_features, lora_a, lora_b, token_slots, out_slices, threads
        )
        assert torch.equal(fused, expected), threads


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_adapter_stacks_are_in_the_models_dtype(adapted, dtype):
    model, model_config = quire_model(adapted["base"], dtype)
    manager = LoRAManager(LoRAConfig(max_loras=2), model_config, model)
    manager.add(LoRARequest("plain", 1, adapted["plain"]))
    slot = manager.activate(["plain"])["plain"]
    o_proj = model.layers[0].self_attn.o_proj
    want = load_adapter("plain", adapted["plain"], model_config, 16).layers[0]["o_proj"]
    rank = want.rank
    assert o_proj.lora_a.dtype == o_proj.lora_b.dtype == getattr(torch, dtype)
    assert torch.equal(
        o_proj.lora_a[slot, :rank], (want.lora_a * want.scale).to(o_proj.lora_a.dtype)
    )
    assert torch.equal(o_proj.lora_b[slot, :rank], want.lora_b.t().to(o_proj.lora_b.dtype))


@pytest.mark.skipif(
    not (gemv.available() and packed_linear_supported("cpu", torch.bfloat16)),
    reason="bf16 batch invariance of the base model needs the GEMV kernel (AVX-512 BF16)",
)
@pytest.mark.parametrize(
    "quantization",
    [
        "auto",
        pytest.param(
            "int8",
            marks=pytest.mark.skipif(not qmatmul.available(), reason="the C kernels are off here"),
        ),
    ],
)
def test_a_requests_bf16_hidden_states_do_not_depend_on_the_adapters_beside_it(
    adapted, quantization
):
    model, model_config = quire_model(adapted["base"], "bfloat16", quantization=quantization)
    base_type = QuantizedLinear if quantization == "int8" else PackedLinear
    assert isinstance(model.layers[0].mlp.down_proj.base, base_type)  # adapters beside any base
    manager = LoRAManager(LoRAConfig(max_loras=2), model_config, model)
    for i, name in enumerate(["plain", "patterned"]):
        manager.add(LoRARequest(name, i + 1, adapted[name]))
    slots = [manager.activate(["plain", "patterned"]).get(a, -1) for a in ADAPTERS]
    batch = forward(model, model_config, PROMPTS, slots).split([len(p) for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(forward(model, model_config, [prompt], slots[i : i + 1]), batch[i])
