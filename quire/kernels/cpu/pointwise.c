// Row-wise bf16 layer ops for CPUs, each one pass over its rows instead of several torch ops (a
// batch-1 decode step runs ~60 norms and ~30 rotaries, and each torch op costs microseconds of
// dispatch). Rounding follows Hugging Face's bf16 modules step by step, so results match them:
//   add + RMSNorm: residual = bf16(x + residual); out = bf16(bf16(residual * rstd) * weight),
//                  rstd = 1 / sqrt(mean(residual^2) + eps) in float32
//   rotary:        x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
//   SiLU and mul:  out = bf16(silu(gate) * up), silu as torch's bf16 SiLU gives it, bit for bit
//   argmax:        the first maximum of each float32 row, NaN above all (torch.argmax)
// OpenMP over rows once there are enough of them to pay for waking the threads.
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define MIN_ROWS_PER_THREAD 16
#define SILU_PARALLEL_ROWS 4  // rows are wider (the MLP's width): threads pay from fewer of them
#define MAX_DIM 16384
#define MAX_HEAD_DIM 512

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 bf16 values from memory, as float32 bit patterns.
static inline __m512i load_bf16_bits(const uint16_t* p) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}

// f rounded to bf16 (nearest even, as f32_to_bf16), still as float32 bit patterns.
static inline __m512i round_to_bf16_bits(__m512i f) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(f, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(f, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u));
}

// The float32 values of 16 bf16 bit patterns' rounding, as 16 bf16 values in memory.
static inline void store_bf16_bits(uint16_t* p, __m512i bits) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
#endif

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
        uint16_t* out_row = out + (int64_t)r * dim;
        float sum_sq = 0.0f;
        int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // 16 lanes of squares along the row, then the lanes' sum; the tail after
        __m512 squares = _mm512_setzero_ps();
        for (; i + 16 <= dim; i += 16) {
            __m512i v = load_bf16_bits(x_row + i);
            if (res_row) {
                const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(v),
                                                 _mm512_castsi512_ps(load_bf16_bits(res_row + i)));
                v = round_to_bf16_bits(_mm512_castps_si512(sum));
                store_bf16_bits(res_row + i, v);
            }
            const __m512 f = _mm512_castsi512_ps(v);
            _mm512_storeu_ps(row + i, f);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(f, f));
        }
        sum_sq = _mm512_reduce_add_ps(squares);
#endif
        for (; i < dim; i++) {
            float v = bf16_to_f32(x_row[i]);
            if (res_row) {
                v = round_bf16(v + bf16_to_f32(res_row[i]));
                res_row[i] = f32_to_bf16(v);
            }
            row[i] = v;
            sum_sq += v * v;
        }
        const float rstd = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 scale = _mm512_set1_ps(rstd);
        for (; i + 16 <= dim; i += 16) {
            const __m512i normed =
                round_to_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(row + i), scale)));
            const __m512 weighted = _mm512_mul_ps(_mm512_castsi512_ps(normed),
                                                  _mm512_castsi512_ps(load_bf16_bits(weight + i)));
            store_bf16_bits(out_row + i, round_to_bf16_bits(_mm512_castps_si512(weighted)));
        }
#endif
        for (; i < dim; i++)
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
            int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            // the same products, roundings and sums, 16 lanes at a time
            for (; i + 16 <= half; i += 16) {
                const __m512 a = _mm512_castsi512_ps(load_bf16_bits(head + i));
                const __m512 b = _mm512_castsi512_ps(load_bf16_bits(head + i + half));
                const __m512 c_lo = _mm512_loadu_ps(c + i), c_hi = _mm512_loadu_ps(c + i + half);
                const __m512 s_lo = _mm512_loadu_ps(s + i), s_hi = _mm512_loadu_ps(s + i + half);
                const __m512 lo = _mm512_add_ps(
                    _mm512_castsi512_ps(round_to_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(a, c_lo)))),
                    _mm512_castsi512_ps(round_to_bf16_bits(_mm512_castps_si512(
                        _mm512_mul_ps(_mm512_xor_ps(b, _mm512_set1_ps(-0.0f)), s_lo)))));
                const __m512 hi = _mm512_add_ps(
                    _mm512_castsi512_ps(round_to_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(b, c_hi)))),
                    _mm512_castsi512_ps(round_to_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(a, s_hi)))));
                store_bf16_bits(head + i, round_to_bf16_bits(_mm512_castps_si512(lo)));
                store_bf16_bits(head + i + half, round_to_bf16_bits(_mm512_castps_si512(hi)));
            }
            if (i == half) continue;
#endif
            float v[MAX_HEAD_DIM];
            for (int j = 0; j < head_dim; j++) v[j] = bf16_to_f32(head[j]);
            for (; i < half; i++) {
                const float lo = round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]);
                const float hi = round_bf16(v[i + half] * c[i + half]) + round_bf16(v[i] * s[i + half]);
                head[i] = f32_to_bf16(lo);
                head[i + half] = f32_to_bf16(hi);
            }
        }
    }
    return 0;
}

// silu(gate) * up for each row of gate_up [rows, 2 * d] (gate, then up), into out [rows, d], as
// torch computes `F.silu(gate) * up` in bf16: silu(g) = g / (1 + exp(-g)) in float32 rounded to
// bf16, times up (exact in float32), rounded once more. `silu` [65536] holds torch's own bf16
// SiLU of every bit pattern, as float32; it is the reference. With AVX-512 the SiLU is computed
// 16 lanes at a time, and a lane reads the table only where the computed value could round
// otherwise than torch's: within SILU_NEAR_TIE float32 ulps of a bf16 rounding tie (our exp is
// within ~2 ulps; ~0.4% of all bf16 inputs), below -88 (torch's exp(-g) overflows there, giving
// -0), or not finite. Reading the table for every lane, as this did before, costs ~3.5 us per
// layer in a decode step: the weights streaming through evict the 256 KB table from the caches.
// From SILU_TABLE_ROWS rows on (a prefill) the table stays in cache and a gather per lane is
// faster than the exp and the division (2,048 rows of SmolLM2's MLP: 0.63 against 0.96 ms).
// tests/test_cpu_pointwise.py checks all 65536 gate values against the table.
#define SILU_NEAR_TIE 64
#define SILU_TABLE_ROWS 64

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bf16(s * u) for 16 lanes, s and u bf16 values as float32 bit patterns: the product is exact in
// float32, then rounded once.
static inline __m256i silu_times_up(__m512i s, __m512i u) {
    const __m512 p = _mm512_mul_ps(_mm512_castsi512_ps(s), _mm512_castsi512_ps(u));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_bits(_mm512_castps_si512(p)), 16));
}

// torch's bf16 SiLU of 16 gate values g (bf16 bit patterns zero-extended, x the same as floats).
static inline __m512i silu_bits(__m512i g, __m512 x, const float* silu) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512i f = _mm512_castps_si512(_mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    const __m512i low_bits = _mm512_and_si512(f, _mm512_set1_epi32(0xFFFF));
    const __m512i tie_distance =
        _mm512_abs_epi32(_mm512_sub_epi32(low_bits, _mm512_set1_epi32(0x8000)));
    const __m512i exponent = _mm512_set1_epi32(0x7F800000);
    const __mmask16 table =
        _mm512_cmplt_epi32_mask(tie_distance, _mm512_set1_epi32(SILU_NEAR_TIE)) |
        _mm512_cmplt_ps_mask(x, _mm512_set1_ps(-88.0f)) |
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), exponent), exponent);
    const __m512 s = _mm512_castsi512_ps(round_to_bf16_bits(f));
    if (!table) return _mm512_castps_si512(s);
    return _mm512_castps_si512(_mm512_mask_i32gather_ps(s, table, g, silu, 4));
}
#endif

static void silu_and_mul_row(const uint16_t* gate, const uint16_t* up, const float* silu,
                             uint16_t* out, int d, int table_only) {
    int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= d; i += 16) {
        const __m512i g_bits = load_bf16_bits(gate + i);
        const __m512i g = _mm512_srli_epi32(g_bits, 16);
        const __m512i s = table_only ? _mm512_castps_si512(_mm512_i32gather_ps(g, silu, 4))
                                     : silu_bits(g, _mm512_castsi512_ps(g_bits), silu);
        _mm256_storeu_si256((__m256i*)(out + i), silu_times_up(s, load_bf16_bits(up + i)));
    }
#else
    (void)table_only;
#endif
    for (; i < d; i++) out[i] = f32_to_bf16(silu[gate[i]] * bf16_to_f32(up[i]));
}

int silu_and_mul_bf16(const uint16_t* gate_up, const float* silu, uint16_t* out, int rows, int d,
                      int num_threads) {
    const int threads = rows >= SILU_PARALLEL_ROWS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        const uint16_t* gate = gate_up + (int64_t)r * 2 * d;
        silu_and_mul_row(gate, gate + d, silu, out + (int64_t)r * d, d, rows >= SILU_TABLE_ROWS);
    }
    return 0;
}

// Index of the largest value of each row of x [rows, cols] float32 into out [rows], as
// torch.argmax gives it: the first of equal maxima, and the first NaN when a row has one (NaN
// ranks above every number). NaNs are told by their bits: the library is built with
// -ffast-math, under which float comparisons may assume there are none.
static int64_t argmax_row(const float* x, int64_t cols) {
    const uint32_t* bits = (const uint32_t*)x;
    int64_t i = 0;
    float best = -INFINITY;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    __mmask16 nan = 0;
    for (; i + 16 <= cols; i += 16) {
        const __m512i v = _mm512_loadu_si512(x + i);
        nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs_mask), inf);
        vmax = _mm512_max_ps(vmax, _mm512_castsi512_ps(v));
    }
    best = _mm512_reduce_max_ps(vmax);
    const int64_t vector_end = i;
    for (; i < cols; i++) best = x[i] > best ? x[i] : best;
    if (!nan) {
        for (int64_t j = vector_end; j < cols; j++) nan |= (bits[j] & 0x7FFFFFFFu) > 0x7F800000u;
    }
    if (!nan) {  // the first position holding the maximum
        const __m512 b = _mm512_set1_ps(best);
        for (i = 0; i + 16 <= cols; i += 16) {
            const __mmask16 hit = _mm512_cmpeq_ps_mask(_mm512_loadu_ps(x + i), b);
            if (hit) return i + __builtin_ctz(hit);
        }
        for (; i < cols; i++)
            if (x[i] == best) return i;
        return 0;  // every value -inf: torch returns 0 as well
    }
#endif
    for (i = 0; i < cols; i++)  // a NaN somewhere (or no AVX-512): scalar, in order
        if ((bits[i] & 0x7FFFFFFFu) > 0x7F800000u) return i;
    int64_t at = 0;
    best = x[0];
    for (i = 1; i < cols; i++)
        if (x[i] > best) best = x[i], at = i;
    return at;
}

// The largest value of x [cols] (any one of equal maxima; NaNs ignored), and whether x holds a
// NaN: one pass of vector maxima in four independent chains, no position. argmax_f32_beyond
// searches a row for its position only where this says the row can change the answer.
static float max_and_nan(const float* x, int64_t cols, int* has_nan) {
    const uint32_t* bits = (const uint32_t*)x;
    int64_t i = 0;
    float best = -INFINITY;
    int nan = 0;
#if defined(__AVX512F__)
    if (cols >= 64) {
        __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0;  // the largest |bits|: NaN above 0x7F800000
        const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
        for (; i + 64 <= cols; i += 64) {
            const __m512i v0 = _mm512_loadu_si512(x + i), v1 = _mm512_loadu_si512(x + i + 16);
            const __m512i v2 = _mm512_loadu_si512(x + i + 32), v3 = _mm512_loadu_si512(x + i + 48);
            m0 = _mm512_max_ps(m0, _mm512_castsi512_ps(v0));
            m1 = _mm512_max_ps(m1, _mm512_castsi512_ps(v1));
            m2 = _mm512_max_ps(m2, _mm512_castsi512_ps(v2));
            m3 = _mm512_max_ps(m3, _mm512_castsi512_ps(v3));
            a0 = _mm512_max_epu32(a0, _mm512_max_epu32(_mm512_and_si512(v0, abs_mask),
                                                       _mm512_and_si512(v1, abs_mask)));
            a1 = _mm512_max_epu32(a1, _mm512_max_epu32(_mm512_and_si512(v2, abs_mask),
                                                       _mm512_and_si512(v3, abs_mask)));
        }
        best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
        nan = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1)) > 0x7F800000u;
    }
#endif
    for (; i < cols; i++) {
        nan |= (bits[i] & 0x7FFFFFFFu) > 0x7F800000u;
        best = x[i] > best ? x[i] : best;
    }
    *has_nan = nan;
    return best;
}

int argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t* out, int num_threads) {
    if (rows < 0 || cols < 1) return -1;
    const int threads = rows >= 2 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
    return 0;
}

// Each row's argmax over x [rows, cols] merged into a running best, for a row whose columns come
// a block at a time in ascending order (the fused LM head, decode_layer.c): best_value[r] and
// best_id[r] (-1: nothing seen yet; ids are this block's positions plus `first`) are replaced
// where the block holds the row's first NaN or a value above the best (equal ones keep the
// earlier column: torch.argmax's first maximum). A row already holding a NaN stays. A block that
// cannot change a row's answer costs one pass of vector maxima, not a search for the position.
void argmax_f32_beyond(const float* x, int64_t rows, int64_t cols, int64_t first,
                       float* best_value, int64_t* best_id, uint8_t* best_nan) {
    for (int64_t r = 0; r < rows; r++) {
        if (best_id[r] >= 0 && best_nan[r]) continue;
        const float* row = x + r * cols;
        int nan;
        const float top = max_and_nan(row, cols, &nan);
        if (best_id[r] >= 0 && !nan && !(top > best_value[r])) continue;
        const int64_t at = argmax_row(row, cols);
        best_value[r] = row[at];
        best_id[r] = first + at;
        best_nan[r] = (uint8_t)nan;
    }
}

// Structured outputs: in each of `num_masks` rows of x [?, cols] float32 (row rows[i] masked by
// bitmask row i, [num_masks, words] packed bits, bit j of word w for token 32 w + j), the
// tokens whose bit is 0 become -inf. Words are split across threads; an all-ones word is
// skipped, an all-zeros word filled.
int apply_token_bitmask_f32(float* x, int64_t cols, const int32_t* bitmask, int64_t words,
                            const int64_t* rows, int64_t num_masks, int num_threads) {
    if (cols < 1 || words < (cols + 31) / 32 || num_masks < 0) return -1;
    const int64_t n = num_masks * words;
    const int threads = n >= 2048 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < n; i++) {
        const int64_t mask_row = i / words, w = i % words;
        const uint32_t bits = (uint32_t)bitmask[mask_row * words + w];
        if (bits == 0xFFFFFFFFu) continue;
        float* row = x + rows[mask_row] * cols;
        const int64_t start = 32 * w, end = start + 32 < cols ? start + 32 : cols;
        if (bits == 0) {  // the usual word: nothing allowed
            for (int64_t t = start; t < end; t++) row[t] = -INFINITY;
            continue;
        }
        for (int64_t t = start; t < end; t++)
            if (!((bits >> (t - start)) & 1u)) row[t] = -INFINITY;
    }
    return 0;
}
