"""Times the CPU matmul kernels side by side, interleaved in one process: bf16 on AMX tiles
(matmul_amx.c), the GEMV kernel's AVX-512 loop and oneDNN's packed linear (or, with --qtype, GGUF
blocks in the int8 kernel, against the same weights in bf16 on AMX or AVX-512). Each round times every side once at every
shape and row count, the order reversed every other round; reported per side: the median time,
GFLOP/s, and the fraction of this machine's measured bf16 matmul peak (quire.bench.roofline,
probed between rounds), plus each side's median ratio to the first side.

    python scripts/bench_cpu_matmul.py --rows 1 32 512 --rounds 5 [--threads 2] [--qtype Q4_1]

Shapes: SmolLM2-135M's gate_up (576 -> 3072) and down (1536 -> 576) projections, and
Qwen3-0.6B's gate_up (1024 -> 6144).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quire.bench import roofline  # noqa: E402
from quire.kernels import cpu as cpu_kernels  # noqa: E402
from quire.kernels.cpu import gemv, qmatmul  # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (6144, 1024)]  # (out_features, in_features)


def settings(amx: bool) -> cpu_kernels.KernelSettings:
    return cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=amx)


def sides(qtype: str | None, out_features: int, in_features: int, rows: int) -> dict:
    """name -> (kernel settings or None, a call) for one shape and row count."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    if qtype is not None:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        raw = quantize(weight.float().numpy(), GGMLQuantizationType[qtype])
        blocks = qmatmul.pack(np.ascontiguousarray(raw), qtype, in_features)
        found = {qtype: (None, lambda: qmatmul.qmatmul(x, blocks, qtype, None, out_features))}
    else:
        found = {}
    packed = gemv.pack(weight)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    found |= {
        "onednn": (
            None,
            lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
        ),
        "avx512": (
            settings(False),
            lambda: gemv.gemv(x, packed, None, out_features, gemv._usual_k_block(in_features)),
        ),
    }
    if gemv.amx_available():
        found["amx"] = (
            settings(True),
            lambda: gemv.gemv(x, packed, None, out_features, in_features),
        )
    return found


def timed(call, min_seconds: float = 0.05) -> float:
    call()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 3:
        call()
        calls += 1
    return elapsed / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--qtype", default=None, help="time GGUF blocks of this type (Q8_0, Q4_0, Q4_1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [(s, r) for s in SHAPES for r in args.rows]
    built = {case: sides(args.qtype, *case[0], case[1]) for case in cases}
    times: dict = {(case, name): [] for case in cases for name in built[case]}
    peaks = []
    for round_ in range(args.rounds):
        for case in cases:
            names = list(built[case])
            for name in names if round_ % 2 == 0 else reversed(names):
                kernel_settings, call = built[case][name]
                if kernel_settings is not None:
                    cpu_kernels.configure(kernel_settings)
                times[case, name].append(timed(call))
        peaks.append(roofline.measure_matmul_tflops(iters=2))
    peak = statistics.median(peaks)
    print(
        f"threads {args.threads}, measured bf16 matmul peak {peak:.3f} TFLOP/s (median of "
        f"{len(peaks)}), {args.qtype or 'bf16'} weights"
    )
    for case in cases:
        (out_features, in_features), rows = case
        flops = 2 * rows * out_features * in_features
        names = list(built[case])
        first = times[case, names[0]]
        line = [f"{in_features:5d}->{out_features:5d} x{rows:4d}:"]
        for name in names:
            t = statistics.median(times[case, name])
            ratio = statistics.median(a / b for a, b in zip(times[case, name], first, strict=True))
            line.append(
                f"{name} {t * 1e6:8.1f} us {flops / t / 1e9:7.1f} GF/s "
                f"{flops / t / 1e12 / peak:6.1%} (x{ratio:.2f})"
            )
        print("  ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
