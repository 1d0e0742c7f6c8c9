// Row-wise bf16 layer ops for CPUs, each one pass over its rows instead of several torch ops (a
// batch-1 decode step runs ~60 norms and ~30 rotaries, and each torch op costs microseconds of
// dispatch). Rounding follows Hugging Face's bf16 modules step by step, so results match them:
//   add + RMSNorm: residual = bf16(x + residual); out = bf16(bf16(residual * rstd) * weight),
//                  rstd = 1 / sqrt(mean(residual^2) + eps) in float32
//   rotary:        x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
// OpenMP over rows once there are enough of them to pay for waking the threads.
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"

#define MIN_ROWS_PER_THREAD 16
#define MAX_DIM 16384
#define MAX_HEAD_DIM 512

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// x [rows, x_stride] (first dim columns used); residual (may be NULL) and out [rows, dim]
// contiguous. With a residual, it is updated in place to x + residual and that sum is normalized.
int add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, uint16_t* residual,
                      const uint16_t* weight, uint16_t* out, int rows, int dim, float eps,
                      int num_threads) {
    if (dim > MAX_DIM) return -1;
    const int threads = rows >= 2 * MIN_ROWS_PER_THREAD ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        float row[MAX_DIM];
        const uint16_t* x_row = x + (int64_t)r * x_stride;
        uint16_t* res_row = residual ? residual + (int64_t)r * dim : 0;
        float sum_sq = 0.0f;
        for (int i = 0; i < dim; i++) {
            float v = bf16_to_f32(x_row[i]);
            if (res_row) {
                v = round_bf16(v + bf16_to_f32(res_row[i]));
                res_row[i] = f32_to_bf16(v);
            }
            row[i] = v;
            sum_sq += v * v;
        }
        const float rstd = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        uint16_t* out_row = out + (int64_t)r * dim;
        for (int i = 0; i < dim; i++)
            out_row[i] = f32_to_bf16(round_bf16(row[i] * rstd) * bf16_to_f32(weight[i]));
    }
    return 0;
}

// In place over the first num_heads heads of each token's row: x [tokens, row_stride], head h at
// x + t * row_stride + h * head_dim. cos/sin [tokens, head_dim] bf16 (the rotate-half tables).
int rotary_bf16(uint16_t* x, int64_t row_stride, const uint16_t* cos, const uint16_t* sin,
                int tokens, int num_heads, int head_dim, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 2) return -1;
    const int half = head_dim / 2;
    const int threads = tokens >= 2 * MIN_ROWS_PER_THREAD ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < tokens; t++) {
        float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM];
        for (int i = 0; i < head_dim; i++) {
            c[i] = bf16_to_f32(cos[(int64_t)t * head_dim + i]);
            s[i] = bf16_to_f32(sin[(int64_t)t * head_dim + i]);
        }
        for (int h = 0; h < num_heads; h++) {
            uint16_t* head = x + (int64_t)t * row_stride + (int64_t)h * head_dim;
            float v[MAX_HEAD_DIM];
            for (int i = 0; i < head_dim; i++) v[i] = bf16_to_f32(head[i]);
            for (int i = 0; i < half; i++) {
                const float lo = round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]);
                const float hi = round_bf16(v[i + half] * c[i + half]) + round_bf16(v[i] * s[i + half]);
                head[i] = f32_to_bf16(lo);
                head[i + half] = f32_to_bf16(hi);
            }
        }
    }
    return 0;
}
