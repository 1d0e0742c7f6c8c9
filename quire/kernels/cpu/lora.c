// LoRA deltas beside a linear: each token row t with an adapter slot s (-1: none) gets
//   out[t] += B[s] (A[s] x[t])
// for the fused modules of the layer (q|k|v, gate|up: A's ranks one under the other, B's output
// columns side by side), in float32, rounded once into out (bf16 or float32). A carries the
// adapter's scale. Each row is computed alone by one thread in an order fixed by the shapes
// (16 float32 lanes along the input, then ranks in order for each output column), so its bits
// do not depend on the other rows, the thread count, or which slot holds its adapter.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

typedef float f32x16 __attribute__((vector_size(64)));

// x . a over n floats: 16 lanes summed along the input, then the lanes, then the tail.
static float dot(const float* x, const float* a, int n) {
    f32x16 acc = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        f32x16 xv, av;
        memcpy(&xv, x + k, sizeof xv);
        memcpy(&av, a + k, sizeof av);
        acc += xv * av;
    }
    float lanes[16], sum = 0.0f;
    memcpy(lanes, &acc, sizeof lanes);
    for (int l = 0; l < 16; l++) sum += lanes[l];
    for (; k < n; k++) sum += x[k] * a[k];
    return sum;
}

static float* aligned_floats(int n) {
    const size_t bytes = ((sizeof(float) * (size_t)n + 63) / 64) * 64;
    return aligned_alloc(64, bytes);
}

// x [tokens, in] (row stride x_stride), out [tokens, out] (row stride out_stride), both bf16
// (is_bf16) or float32; lora_a [slots, modules * max_rank, in], lora_b [slots, max_rank, out]
// (B transposed) float32; token_slots [tokens]; out_slices [modules][2]: each module's first
// output column and width. Returns 0, or -1 for shapes it does not take.
int lora_add(int is_bf16, const void* x, int64_t x_stride, void* out, int64_t out_stride,
             const float* lora_a, const float* lora_b, const int32_t* token_slots,
             const int32_t* out_slices, int modules, int64_t tokens, int in, int out_features,
             int max_rank, int num_threads) {
    const int ranks = modules * max_rank;
    if (in < 1 || out_features < 1 || ranks < 1 || tokens < 0) return -1;
    const int threads = tokens >= 2 ? num_threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        // 64-byte aligned, so no row's loops start at another alignment than another's
        float* xf = aligned_floats(in);
        float* u = aligned_floats(ranks);
        float* delta = aligned_floats(out_features);
        if (!xf || !u || !delta) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            const int slot = token_slots[t];
            if (slot < 0 || !xf || !u || !delta) continue;
            if (is_bf16) {
                const uint16_t* row = (const uint16_t*)x + t * x_stride;
                for (int k = 0; k < in; k++) xf[k] = bf16_to_f32(row[k]);
            } else {
                const float* row = (const float*)x + t * x_stride;
                for (int k = 0; k < in; k++) xf[k] = row[k];
            }
            const float* a = lora_a + (int64_t)slot * ranks * in;
            for (int j = 0; j < ranks; j++) u[j] = dot(xf, a + (int64_t)j * in, in);
            const float* bt = lora_b + (int64_t)slot * max_rank * out_features;
            for (int m = 0; m < modules; m++) {
                const int first = out_slices[2 * m], width = out_slices[2 * m + 1];
                float* d = delta + first;
                for (int o = 0; o < width; o++) d[o] = 0.0f;
                for (int r = 0; r < max_rank; r++) {
                    const float ur = u[m * max_rank + r];
                    const float* b = bt + (int64_t)r * out_features + first;
                    for (int o = 0; o < width; o++) d[o] += ur * b[o];
                }
                if (is_bf16) {
                    uint16_t* y = (uint16_t*)out + t * out_stride + first;
                    for (int o = 0; o < width; o++) y[o] = f32_to_bf16(bf16_to_f32(y[o]) + d[o]);
                } else {
                    float* y = (float*)out + t * out_stride + first;
                    for (int o = 0; o < width; o++) y[o] += d[o];
                }
            }
        }
        free(xf);
        free(u);
        free(delta);
    }
    return failed ? -1 : 0;
}
