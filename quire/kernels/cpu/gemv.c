// bf16 matmul for CPUs: y = x W^T (+ bias) for any number of rows of x, written for a decode
// step's projections (memory-bound on reading W at a few rows, compute-bound from ~16), and bit
// for bit what oneDNN's packed bf16 matmul gives on two rows or more where oneDNN runs AVX-512
// (on AMX tiles it does not block K alike, and every call goes to matmul_amx.c instead, see
// gemv_bf16_set_amx). Every row is summed in the same order whatever the number of rows, so a
// row's result does not depend on the rest of the batch (oneDNN's does: a lone row of K > 1024 it
// sums in blocks of 512, not 1024).
//
// W is packed once at load time in oneDNN's own VNNI order, panels of GEMV_PANEL output columns:
//   packed[N_pad / 32][K / 2][32][2]   (N padded to a multiple of 32 with zero rows)
// i.e. for each panel, for each pair of input columns (k, k + 1), the 32 outputs' two weights.
// The kernel reads it front to back: per pair, two 64-byte lines, each one AVX-512 BF16 dot
// product per row of x against the broadcast pair (x[k], x[k + 1]); a lane of the accumulator is
// one output column, so no horizontal sums. More rows than fit the registers take a panel in
// passes of GEMV_GROUP rows, the panel read from memory once and then from cache. Measured here
// (SmolLM2's and Qwen3-0.6B's projections, weights streaming from memory): 40-50 GB/s at one row,
// about what a plain read reaches, against oneDNN's 25-35; 1.1-1.5x oneDNN from 8 to 64 rows;
// level with it (0.7-0.85 TFLOP/s) from 128 to 2048.
//
// Summation order, which decides the bits: each output is a float32 sum over k in order, two
// products per step (vdpbf16ps), restarted from zero every k_block columns, the blocks' sums
// added in order, then the bias, then one rounding to bf16. oneDNN (v3, AVX-512 BF16) sums the
// same way with k_block = K up to 512, 512 up to 1024 and 1024 beyond; the Python side checks
// the block size against oneDNN for each weight shape when it packs (gemv.py, `k_block_for`).
// Rows of x and threads do not change any of this, so the result of a row does not depend on the
// other rows or on the thread count.
//
// Two inner loops give those same bits. vdpbf16ps(acc, w, x) is, per lane, acc + w_odd * x_odd
// rounded, then + w_even * x_even rounded (the products of two bf16 are exact in float32), so two
// float32 FMAs in that order reproduce it (checked: 0 differences in 3.2M random lanes; they part
// only on denormals, which vdpbf16ps flushes). Where vdpbf16ps issues at half the FMA rate (an
// Intel Xeon here without AMX: 84 against 176 GFLOP/s a core), the FMA loop, on x widened to
// float32 once per call, does the compute-bound row counts in about half the time. A probe at
// first use times both and keeps the faster; gemv_bf16_set_fma (EngineConfig.gemv_fma) forces one.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "kernels.h"

#define GEMV_PANEL 32
#define GEMV_GROUP 8  // rows of x per pass over a panel

// 1: the AVX-512 BF16 kernel, 2: the AVX2 one (FMA loop only, see below), 0: none.
int gemv_bf16_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define PREFETCH_BYTES 2048

static inline __m512 dot_pair(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The same pair products (16 chains of 16 lanes, 4096 pairs each) by vdpbf16ps or by two FMAs.
static double time_pairs(int fma) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    __m512i w = _mm512_set1_epi32(0x3f803f80);
    __m512 we = _mm512_set1_ps(1.0f), wo = _mm512_set1_ps(1.0f);
    const double start = seconds();
    for (int n = 0; n < 4096; n++) {
        __asm__ volatile("" : "+v"(w), "+v"(we), "+v"(wo));  // no hoisting, no folding
        for (int i = 0; i < 16; i++)
            acc[i] = fma ? _mm512_fmadd_ps(we, we, _mm512_fmadd_ps(wo, wo, acc[i]))
                         : dot_pair(acc[i], w, w);
    }
    const double elapsed = seconds() - start;
    __m512 sum = acc[0];
    for (int i = 1; i < 16; i++) sum = _mm512_add_ps(sum, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    return elapsed;
}

static int fma_loop = -1;  // -1: not decided yet
static int amx_order = 0;  // 1: matmul_amx.c's order and kernel for every call

// 1 (and the return value 1) hands every call to the AMX kernel (matmul_amx.c), whose order then
// decides the bits, with k_block the whole K; it stays 0 where AMX cannot run. The Python side
// sets it from EngineConfig.cpu_amx when it loads the library (kernels/cpu/__init__.py).
int gemv_bf16_set_amx(int choice) {
    amx_order = choice && matmul_amx_available();
    return amx_order;
}

int gemv_bf16_uses_amx(void) { return amx_order; }

// 1: the FMA loop, 0: vdpbf16ps, -1: let the probe decide at the next call (the Python side sets
// it from EngineConfig.gemv_fma when it loads the library: kernels/cpu/__init__.py).
int gemv_bf16_set_fma(int choice) {
    fma_loop = choice;
    return 0;
}

// 1 when the kernel runs the FMA loop, 0 for vdpbf16ps (decided once: see the top of this file).
int gemv_bf16_uses_fma(void) {
    if (fma_loop < 0) {
        double dp = 1e9, fm = 1e9;
        for (int i = 0; i < 5; i++) {  // the best of five: the host is shared
            const double a = time_pairs(0), b = time_pairs(1);
            dp = a < dp ? a : dp;
            fm = b < fm ? b : fm;
        }
        fma_loop = fm < 0.8 * dp;
    }
    return fma_loop;
}

// Whether a panel read once (the call's only pass over it) is prefetched non-temporally. On AMD
// (Zen 5 here) the weights then no longer push the rest of the step (the Python around it, the KV
// cache, the small tensors) out of L2 and L3: SmolLM2 at batch 1, blocks of steps interleaved in
// one process, 0.969-0.973x the step time; no change on Qwen3-0.6B's shape (1.006x), whose step
// is almost all weight reads. On an Intel Xeon here NTA prefetches capped the read rate instead:
// batch-1 decode at 51-52% of the memory roofline against 90-91% with T0. So AMD only.
static int nta_streams(void) {
    static int nta = -1;
    if (nta < 0) {
        __builtin_cpu_init();
        nta = __builtin_cpu_is("amd");
    }
    return nta;
}

// One panel (32 output columns) against MB (1..GEMV_GROUP) rows of x; out [MB][32] float32 sums.
// STREAM: the panel is read once, prefetched non-temporally (see nta_streams). With several
// passes over a panel (more than GEMV_GROUP rows) the later passes need it in cache: T0 there.
// FMA: the FMA loop, reading x widened to float32 (xf, K floats a row) instead of x.
// next: the panel after this one, prefetched into L2 line for line as this one is read, or NULL.
static inline __attribute__((always_inline)) void gemv_panel(const int MB, const int STREAM,
                                                             const int FMA, const uint16_t* x,
                                                             int64_t x_stride, const float* xf,
                                                             const uint16_t* p, int K,
                                                             int k_block, float* out,
                                                             const uint16_t* next) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 total[GEMV_GROUP][2], acc[GEMV_GROUP][2];
    for (int k0 = 0; k0 < K; k0 += k_block) {
        const int k1 = k0 + k_block < K ? k0 + k_block : K;
        for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        const uint16_t* q = p + (int64_t)k0 * GEMV_PANEL;
        for (int k = k0; k < k1; k += 2, q += 2 * GEMV_PANEL) {
            if (STREAM) {
                _mm_prefetch((const char*)q + PREFETCH_BYTES, _MM_HINT_NTA);
                _mm_prefetch((const char*)q + PREFETCH_BYTES + 64, _MM_HINT_NTA);
            } else {
                _mm_prefetch((const char*)q + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char*)q + PREFETCH_BYTES + 64, _MM_HINT_T0);
            }
            if (next) {
                const char* line = (const char*)(next + (q - p));
                _mm_prefetch(line, _MM_HINT_T1);
                _mm_prefetch(line + 64, _MM_HINT_T1);
            }
            const __m512i w0 = _mm512_loadu_si512(q), w1 = _mm512_loadu_si512(q + 32);
            if (FMA) {
                const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
                const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
                const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
                const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
                for (int m = 0; m < MB; m++) {
                    const __m512 xe = _mm512_set1_ps(xf[m * K + k]);
                    const __m512 xo = _mm512_set1_ps(xf[m * K + k + 1]);
                    acc[m][0] = _mm512_fmadd_ps(w0e, xe, _mm512_fmadd_ps(w0o, xo, acc[m][0]));
                    acc[m][1] = _mm512_fmadd_ps(w1e, xe, _mm512_fmadd_ps(w1o, xo, acc[m][1]));
                }
                continue;
            }
            for (int m = 0; m < MB; m++) {
                int32_t pair;
                memcpy(&pair, x + m * x_stride + k, sizeof(pair));
                const __m512i xv = _mm512_set1_epi32(pair);
                acc[m][0] = dot_pair(acc[m][0], w0, xv);
                acc[m][1] = dot_pair(acc[m][1], w1, xv);
            }
        }
        for (int m = 0; m < MB; m++) {
            if (k0 == 0) {
                total[m][0] = acc[m][0], total[m][1] = acc[m][1];
            } else {
                total[m][0] = _mm512_add_ps(total[m][0], acc[m][0]);
                total[m][1] = _mm512_add_ps(total[m][1], acc[m][1]);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        _mm512_storeu_ps(out + m * GEMV_PANEL, total[m][0]);
        _mm512_storeu_ps(out + m * GEMV_PANEL + 16, total[m][1]);
    }
}

// x [M, x_stride] bf16 (first K columns used, K even); packed as above; bias [N] or NULL.
// Output row m: y_bf16 + m * y_stride (bf16), or when y_bf16 is NULL, y_f32 + m * y_stride
// (float32 holding the bf16-rounded value, as `linear(...).float()` gives).
// Each panel is read from memory once: its rows of x go through it GEMV_GROUP at a time (the
// accumulators of a group fill the registers), the later groups finding it in cache, the second
// of them prefetching the next panel.
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
              uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M, int N, int K, int k_block,
              int num_threads) {
    if (M < 1 || K < 2 || K % 2 || N < 1 || k_block < 2 || k_block % 2)
        return -1;
    if (amx_order)
        return k_block == K ? matmul_amx_bf16(x, x_stride, packed, bias, y_bf16, y_f32, y_stride,
                                              M, N, K, num_threads)
                            : -1;
    const int panels = (N + GEMV_PANEL - 1) / GEMV_PANEL;
    const int threads = panels < 2 * num_threads ? 1 : num_threads;
    const int groups = (M + GEMV_GROUP - 1) / GEMV_GROUP;  // as even as can be: 9 = 5 + 4
    const int fma = M > 1 && gemv_bf16_uses_fma();  // one row: memory-bound either way
    const int stream = groups == 1 && nta_streams();
    float* xf = NULL;  // [M, K] x widened for the FMA loop
    if (fma && !(xf = malloc((size_t)M * (size_t)K * sizeof(float))))
        return -3;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (fma) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                const uint16_t* src = x + (int64_t)m * x_stride;
                float* dst = xf + (int64_t)m * K;
                int k = 0;
                for (; k + 16 <= K; k += 16) {
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(src + k));
                    _mm512_storeu_si512(dst + k,
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                }
                for (; k < K; k++) dst[k] = bf16_to_f32(src[k]);
            }
        }
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p0 = (int)((int64_t)panels * t / nt);
        const int p1 = (int)((int64_t)panels * (t + 1) / nt);
        float out[GEMV_GROUP * GEMV_PANEL];
        for (int pi = p0; pi < p1; pi++) {
            const uint16_t* p = packed + (int64_t)pi * GEMV_PANEL * K;
            for (int g = 0; g < groups; g++) {
                const int m0 = (int)((int64_t)M * g / groups);
                const int MB = (int)((int64_t)M * (g + 1) / groups) - m0;
                const uint16_t* xg = x + (int64_t)m0 * x_stride;
                const float* xfg = fma ? xf + (int64_t)m0 * K : NULL;
                // The second pass over a panel, from cache, brings the thread's next panel into
                // L2, so that its first pass does not wait on memory: 12-32 rows in 0.89-0.93x
                // the time (a batch-16 decode step 0.92x), 256 rows and more unchanged.
                const uint16_t* next = g == 1 && pi + 1 < p1 ? p + (int64_t)GEMV_PANEL * K : NULL;
#define GEMV_CASE(N)                                                          \
    case N:                                                                   \
        if (fma && stream)                                                    \
            gemv_panel(N, 1, 1, xg, x_stride, xfg, p, K, k_block, out, next); \
        else if (fma)                                                         \
            gemv_panel(N, 0, 1, xg, x_stride, xfg, p, K, k_block, out, next); \
        else if (stream)                                                      \
            gemv_panel(N, 1, 0, xg, x_stride, xfg, p, K, k_block, out, next); \
        else                                                                  \
            gemv_panel(N, 0, 0, xg, x_stride, xfg, p, K, k_block, out, next); \
        break;
                switch (MB) {  // constant trip counts: the accumulators stay in registers
                    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4)
                    GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7)
                    default: GEMV_CASE(8)
                }
#undef GEMV_CASE
                store_panel(out, GEMV_PANEL, MB, m0, pi * GEMV_PANEL, N, bias, y_bf16, y_f32,
                            y_stride);
            }
        }
    }
    free(xf);
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------------------------------------
// AVX2 (no AVX-512): the FMA loop alone, on the same packed panels, x widened to float32 once a
// call. A ymm register holds 8 output columns' weight pairs, so a panel is 4 of them per pair
// of input columns; each lane's sum is taken in the AVX-512 FMA loop's order (odd product, then
// even, restarted every k_block columns, the blocks added in order), so the bits are the same as
// on an AVX-512 host. Registers (16): one row takes the whole panel in a pass (4 accumulators, 8
// weight vectors, 2 of x); more rows go AVX2_GROUP at a time over each half panel (8
// accumulators, 4 weight vectors, 2 of x), the second half and the later groups reading the
// panel from cache.
#include <immintrin.h>
#include <omp.h>

#define PREFETCH_BYTES 2048
#define AVX2_GROUP 4  // rows of x per pass over a half panel

// NC (4: the whole panel, 2: 16 columns from c0) column vectors x MB rows; out [MB][32] float32.
static inline __attribute__((always_inline)) void gemv_pass_avx2(const int MB, const int NC,
                                                                 const float* xf, int K,
                                                                 const uint16_t* p, int c0,
                                                                 int k_block, float* out) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 total[AVX2_GROUP][4], acc[AVX2_GROUP][4];
    for (int k0 = 0; k0 < K; k0 += k_block) {
        const int k1 = k0 + k_block < K ? k0 + k_block : K;
        for (int m = 0; m < MB; m++)
            for (int c = 0; c < NC; c++) acc[m][c] = _mm256_setzero_ps();
        const uint16_t* q = p + (int64_t)k0 * GEMV_PANEL + 2 * c0;
        for (int k = k0; k < k1; k += 2, q += 2 * GEMV_PANEL) {
            for (int i = 0; i < NC; i += 2)
                _mm_prefetch((const char*)q + PREFETCH_BYTES + 32 * i, _MM_HINT_T0);
            __m256 we[4], wo[4];
            for (int c = 0; c < NC; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(q + 16 * c));
                we[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                wo[c] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
            }
            for (int m = 0; m < MB; m++) {
                const __m256 xe = _mm256_broadcast_ss(xf + (int64_t)m * K + k);
                const __m256 xo = _mm256_broadcast_ss(xf + (int64_t)m * K + k + 1);
                for (int c = 0; c < NC; c++)
                    acc[m][c] = _mm256_fmadd_ps(we[c], xe, _mm256_fmadd_ps(wo[c], xo, acc[m][c]));
            }
        }
        for (int m = 0; m < MB; m++)
            for (int c = 0; c < NC; c++)
                total[m][c] = k0 == 0 ? acc[m][c] : _mm256_add_ps(total[m][c], acc[m][c]);
    }
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < NC; c++)
            _mm256_storeu_ps(out + m * GEMV_PANEL + c0 + 8 * c, total[m][c]);
}

// The arguments of the AVX-512 gemv_bf16 above.
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
              uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M, int N, int K, int k_block,
              int num_threads) {
    if (M < 1 || K < 2 || K % 2 || N < 1 || k_block < 2 || k_block % 2)
        return -1;
    const int panels = (N + GEMV_PANEL - 1) / GEMV_PANEL;
    const int threads = panels < 2 * num_threads ? 1 : num_threads;
    const int groups = (M + AVX2_GROUP - 1) / AVX2_GROUP;  // as even as can be: 5 = 3 + 2
    float* xf = malloc((size_t)M * (size_t)K * sizeof(float));  // x widened
    if (!xf) return -3;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const uint16_t* src = x + (int64_t)m * x_stride;
            float* dst = xf + (int64_t)m * K;
            int k = 0;
            for (; k + 8 <= K; k += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i*)(src + k));
                _mm256_storeu_si256((__m256i*)(dst + k),
                                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
            for (; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        }
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p0 = (int)((int64_t)panels * t / nt);
        const int p1 = (int)((int64_t)panels * (t + 1) / nt);
        float out[AVX2_GROUP * GEMV_PANEL];
        for (int pi = p0; pi < p1; pi++) {
            const uint16_t* p = packed + (int64_t)pi * GEMV_PANEL * K;
            if (M == 1) {
                gemv_pass_avx2(1, 4, xf, K, p, 0, k_block, out);
                store_panel(out, GEMV_PANEL, 1, 0, pi * GEMV_PANEL, N, bias, y_bf16, y_f32,
                            y_stride);
                continue;
            }
            for (int g = 0; g < groups; g++) {
                const int m0 = (int)((int64_t)M * g / groups);
                const int MB = (int)((int64_t)M * (g + 1) / groups) - m0;
                const float* xfg = xf + (int64_t)m0 * K;
                for (int c0 = 0; c0 < GEMV_PANEL; c0 += 16) {
                    switch (MB) {  // constant trip counts: the accumulators stay in registers
                        case 1: gemv_pass_avx2(1, 2, xfg, K, p, c0, k_block, out); break;
                        case 2: gemv_pass_avx2(2, 2, xfg, K, p, c0, k_block, out); break;
                        case 3: gemv_pass_avx2(3, 2, xfg, K, p, c0, k_block, out); break;
                        default: gemv_pass_avx2(4, 2, xfg, K, p, c0, k_block, out); break;
                    }
                }
                store_panel(out, GEMV_PANEL, MB, m0, pi * GEMV_PANEL, N, bias, y_bf16, y_f32,
                            y_stride);
            }
        }
    }
    free(xf);
    return 0;
}
#else
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
              uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M, int N, int K, int k_block,
              int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y_bf16, (void)y_f32;
    (void)y_stride, (void)M, (void)N, (void)K, (void)k_block, (void)num_threads;
    return -2;  // built without AVX-512 BF16 or AVX2
}
#endif

#if !defined(__AVX512BF16__)
// Without AVX-512 BF16: no AMX order, and the FMA loop is the AVX2 kernel's only one.
int gemv_bf16_set_amx(int choice) {
    (void)choice;
    return 0;
}
int gemv_bf16_uses_amx(void) { return 0; }

int gemv_bf16_set_fma(int choice) {
    (void)choice;
    return 0;
}
int gemv_bf16_uses_fma(void) { return gemv_bf16_available() == 2; }
#endif
