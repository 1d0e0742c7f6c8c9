// Writing a step's K/V rows into the paged cache at their slots: bf16 rows are copied; into a
// quantized cache (kv_quant.h) each token's row per KV head is quantized alone with its own
// scale, so a token's bytes depend only on its K/V, never on the batch or the chunk it came in.
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "kv_quant.h"

static void quantize_row(int kind, const uint16_t* x, int head_dim, uint8_t* row) {
    float amax = 0.0f;
    for (int d = 0; d < head_dim; d++) {
        const float a = fabsf(bf16_to_f32(x[d]));
        amax = a > amax ? a : amax;
    }
    const float scale = amax > 0.0f ? amax / kv_code_max(kind) : 1.0f;
    const float inv = 1.0f / scale;
    for (int d = 0; d < head_dim; d++) row[d] = kv_f32_to_code(kind, bf16_to_f32(x[d]) * inv);
    memcpy(row + head_dim, &scale, sizeof(scale));
}

// key, value [num_tokens, num_kv_heads, head_dim] bf16 (heads contiguous, tokens `stride`
// elements apart) into the caches' rows at slots[t]: [num_slots, num_kv_heads, head_dim] bf16
// (kind 0), or [num_slots, num_kv_heads, head_dim + 4] quantized (kind: kv_quant.h).
int store_kv_rows(int kind, const uint16_t* key, const uint16_t* value, int64_t key_stride,
                  int64_t value_stride, uint8_t* k_cache, uint8_t* v_cache, const int64_t* slots,
                  int num_tokens, int num_kv_heads, int head_dim, int num_threads) {
    if (kind < 0 || kind > KV_FP8_E5M2) return -1;
    if (kind == 0) {  // a token's heads are one contiguous run in the step and in its slot
        const size_t bytes = (size_t)num_kv_heads * head_dim * sizeof(uint16_t);
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 64) schedule(static)
        for (int t = 0; t < num_tokens; t++) {
            memcpy(k_cache + slots[t] * bytes, key + t * key_stride, bytes);
            memcpy(v_cache + slots[t] * bytes, value + t * value_stride, bytes);
        }
        return 0;
    }
    const int64_t row_bytes = head_dim + KV_SCALE_BYTES;
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 8) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (slots[t] * num_kv_heads + h) * row_bytes;
            quantize_row(kind, key + t * key_stride + (int64_t)h * head_dim, head_dim,
                         k_cache + at);
            quantize_row(kind, value + t * value_stride + (int64_t)h * head_dim, head_dim,
                         v_cache + at);
        }
    }
    return 0;
}
