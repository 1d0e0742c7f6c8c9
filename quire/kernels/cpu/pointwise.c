// Row-wise bf16 layer ops for CPUs, each one pass over its rows instead of several torch ops (a
// batch-1 decode step runs ~60 norms and ~30 rotaries, and each torch op costs microseconds of
// dispatch). Rounding follows Hugging Face's bf16 modules step by step, so results match them:
//   add + RMSNorm: residual = bf16(x + residual); out = bf16(bf16(residual * rstd) * weight),
//                  rstd = 1 / sqrt(mean(residual^2) + eps) in float32
//   rotary:        x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
//   SiLU and mul:  out = bf16(silu(gate) * up), silu from a table of torch's own bf16 values
// OpenMP over rows once there are enough of them to pay for waking the threads.
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define MIN_ROWS_PER_THREAD 16
#define SILU_PARALLEL_ROWS 4  // rows are wider (the MLP's width): threads pay from fewer of them
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

// silu(gate) * up for each row of gate_up [rows, 2 * d] (gate, then up), into out [rows, d]. The
// SiLU comes from silu [65536], torch's own bf16 SiLU of every bit pattern as float32 (a float32
// formula here would differ from torch's vectorized one on some inputs); the product of two bf16
// values is exact in float32 and rounded once, so the result is `F.silu(gate) * up` bit for bit
// (NaN payloads aside). With AVX-512, 16 lanes at a time, the table read by a gather: 1.3-2x
// torch's silu and mul on a 2,048-token prefill of SmolLM2's MLP.

static void silu_and_mul_row(const uint16_t* gate, const uint16_t* up, const float* silu,
                             uint16_t* out, int d) {
    int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= d; i += 16) {
        const __m512i g = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(gate + i)));
        const __m512 s = _mm512_i32gather_ps(g, silu, 4);
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(up + i)));
        const __m512i p = _mm512_castps_si512(
            _mm512_mul_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))));
        // Round to nearest even, as f32_to_bf16: (p + 0x7FFF + bit 16 of p) >> 16.
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(p, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(p, _mm512_set1_epi32(0x7FFF)), lsb), 16);
        _mm256_storeu_si256((__m256i*)(out + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < d; i++) out[i] = f32_to_bf16(silu[gate[i]] * bf16_to_f32(up[i]));
}

int silu_and_mul_bf16(const uint16_t* gate_up, const float* silu, uint16_t* out, int rows, int d,
                      int num_threads) {
    const int threads = rows >= SILU_PARALLEL_ROWS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        const uint16_t* gate = gate_up + (int64_t)r * 2 * d;
        silu_and_mul_row(gate, gate + d, silu, out + (int64_t)r * d, d);
    }
    return 0;
}
