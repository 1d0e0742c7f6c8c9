#!/usr/bin/env bash
# Runs the checks of docs/GPU.md on a CUDA machine, section by section, and keeps the logs.
#
#   bash scripts/gpu_checks.sh [SECTION ...]     # sections: env tests kernel sweep model latency
#                                                  throughput overhead profile (profile needs model)
#
# Logs go to $OUT (or ./gpu-logs); each section has its own time limit, so one hang does not
# cost the others. Uses the python3 that holds a CUDA torch (QUIRE_GPU_PYTHON overrides it).
# The tests, the benches' checkpoints and `bench overhead`'s model take the default model's
# tokenizer: where its package is not installed, save that tokenizer here first and carry the
# folder (.tok, 3.4 MB):
#   .venv/bin/python -c "from quire.model.tokenizer import load_tokenizer as t; \
#       from quire.config import default_model_path as p; t(p()).save_pretrained('.tok')"
set -u
PY=${QUIRE_GPU_PYTHON:-python3}
LOGS=${OUT:-gpu-logs}
MODELS=${QUIRE_GPU_MODEL_DIR:-/tmp/quire-models}
mkdir -p "$LOGS"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
quire() { "$PY" -m quire.entrypoints.cli "$@"; }

section() {  # section NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" bash -c "$*" 2>&1 | tee "$LOGS/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
}

env_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())"
    "$PY" -c "from quire.bench import roofline; print(roofline.measure_hardware('cuda'))"
}

tests() {
    [ -d .tok ] && export QUIRE_TEST_TOKENIZER_DIR=$PWD/.tok
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 300 --durations 5 \
        ${QUIRE_GPU_TESTS:-tests/test_triton_kernels.py tests/test_triton_pointwise.py \
        tests/test_triton_e2e.py tests/test_cuda_graph.py}
}

kernel() {
    "$PY" -m quire.bench.kernel_bench --batch-size 64 --context-len 4096 --peak-gbps "$PEAK"
}

sweep() {
    for b in 1 8 64 256; do for n in 512 4096 32768; do
        "$PY" -m quire.bench.kernel_bench --batch-size "$b" --context-len "$n" --peak-gbps "$PEAK"
    done; done
}

model() {  # builds the random Qwen3-0.6B-shaped checkpoint the benches load
    "$PY" -c "from quire.bench.models import build_qwen3_random as b; \
b('$MODELS', tokenizer_source='.tok' if __import__('os').path.isdir('.tok') else None)"
}

latency() {
    for extra in "" "--enforce-eager" "--max-model-len 4096"; do
        echo "--- latency $extra"
        # shellcheck disable=SC2086
        quire --log-level INFO bench latency --model qwen3-0.6b-random --model-dir "$MODELS" \
            --device cuda --batch-size 32 --output-json "$LOGS/latency${extra// /_}.json" $extra
    done
}

throughput() {
    for extra in "" "--enforce-eager"; do
        echo "--- throughput $extra"
        # shellcheck disable=SC2086
        quire --log-level INFO bench throughput --model qwen3-0.6b-random --model-dir "$MODELS" \
            --num-requests 256 --input-len 100 1024 --output-len 100 1024 --device cuda \
            --output-json "$LOGS/throughput${extra// /_}.json" $extra \
            $([ -z "$extra" ] && echo --compare transformers --hf-mode generate --hf-batch-size 64)
    done
}

overhead() {  # host time per step by phase, on a model whose forward costs next to nothing
    # shellcheck disable=SC2046
    quire bench overhead --device cuda --batch-sizes 1 64 256 \
        --output-json "$LOGS/overhead.json" $([ -d .tok ] && echo --tokenizer .tok)
}

profile() {  # the GPU's idle fraction and kernels of steady decode steps (torch profiler)
    "$PY" scripts/gpu_step_profile.py --model "$MODELS" --batch-sizes 1 64 --steps 20
}

export PY LOGS MODELS
export -f quire env_info tests kernel sweep model latency throughput overhead profile
export PEAK=$("$PY" -c "import torch; n = torch.cuda.get_device_name(); print(4800 if 'H200' in n else 3350)")
for s in "${@:-env tests kernel latency throughput overhead}"; do
    for name in $s; do
        case $name in
            env) section env 120 env_info ;;
            tests) section tests 420 tests ;;
            kernel) section kernel 120 kernel ;;
            sweep) section sweep 300 sweep ;;
            model) section model 300 model ;;
            latency) section latency 420 latency ;;
            throughput) section throughput 560 throughput ;;
            overhead) section overhead 300 overhead ;;
            profile) section profile 240 profile ;;
            *) echo "unknown section $name" ;;
        esac
    done
done
