"""KV transfer time against prefill time: a prefill engine and a decode engine of one model in
this process, the KV moved over the TCP transport on loopback.

    python scripts/bench_kv_transfer.py [--model PATH] [--prompt-lens 128 512 2048] [--rounds 3]

For each prompt length and round: the prefill engine computes a fresh prompt (no prefix hit)
and samples its first token, timed; the decode engine pulls its blocks, timed by the connector
(request to blocks received, the blocks written into the cache not included). Prints the median
of the rounds, the bytes moved (blocks x block bytes), the bandwidth and transfer / prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    blocks = 2 * (max(args.prompt_lens) // 16 + 2)
    common = dict(model=args.model, num_kv_blocks=blocks, max_model_len=max(args.prompt_lens) + 8)
    prefill = LLMEngine(EngineConfig(**common, disaggregation_mode="prefill"))
    decode = LLMEngine(EngineConfig(**common, disaggregation_mode="decode"))
    print(f"model {prefill.config.model}, {prefill.dtype}, block size {prefill.config.block_size}")
    print("prompt  prefill ms  transfer ms  MiB moved  MiB/s  transfer/prefill")
    salt = 0
    for length in args.prompt_lens:
        prefill_s, transfer_s, moved = [], [], 0
        for round_index in range(args.rounds + 1):  # round 0 warms up
            salt += 1
            prompt = {
                "prompt_token_ids": [(31 * j + 7919 * salt) % 40000 + 10 for j in range(length)]
            }
            transfer_id = f"bench-{salt}"
            first = SamplingParams(temperature=0.0, max_tokens=1)
            first.kv_transfer_params = {"do_remote_decode": True, "transfer_id": transfer_id}
            start = time.perf_counter()
            prefill.add_request(f"p{salt}", prompt, first)
            while prefill.has_unfinished_requests():
                prefill.step()
            elapsed = time.perf_counter() - start
            rest = SamplingParams(temperature=0.0, max_tokens=1)
            rest.kv_transfer_params = {
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_host": prefill.config.kv_host,
                "remote_port": prefill.config.kv_port,
            }
            before = decode.core_stats().kv_transfer
            decode.add_request(f"d{salt}", prompt, rest)
            while decode.has_unfinished_requests() or prefill.has_kv_transfers():
                decode.step()
                prefill.step()
            after = decode.core_stats().kv_transfer
            if round_index > 0:
                prefill_s.append(elapsed)
                transfer_s.append(after.seconds - before.seconds)
                moved = after.num_bytes - before.num_bytes
        p, t = statistics.median(prefill_s), statistics.median(transfer_s)
        mib = moved / 2**20
        print(
            f"{length:6d}  {p * 1e3:10.1f}  {t * 1e3:11.2f}  {mib:9.2f}  {mib / t:5.0f}  {t / p:16.3f}"
        )
    prefill.shutdown()
    decode.shutdown()


if __name__ == "__main__":
    main()
