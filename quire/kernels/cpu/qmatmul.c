// Matmul on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1) for CPUs: y = x W^T (+ bias), x bf16,
// for any number of rows. The weights stay in their blocks of 32 (a scale d, for Q4_1 an offset
// m, 32 codes: w = d q + m), repacked once at load time; each row of x is quantized to int8 in
// blocks of 32 (as llama.cpp's q8 activations: dx = amax / 127, qx = round(x / dx), sx = sum qx),
// so a block's dot product is integer: with u the weight codes as unsigned bytes (Q8_0's
// signed codes + 128, Q4's nibbles 0..15), sum(u qx) is one AVX-512 VNNI vpdpbusd per 4 columns
// of K (unsigned weights times signed activations), and
//   Q8_0: d dx (sum(u qx) - 128 sx)   Q4_0: d dx (sum(u qx) - 8 sx)   Q4_1: d dx sum(u qx) + m dx sx
// A decode step reads 4.25-8.5 bits a weight instead of bf16's 16. Without VNNI, an AVX2 loop
// gets the same integer sums from vpmaddubsw / vpmaddwd (below), and without AVX2 plain C does.
//
// Packed layout: panels of QPANEL = 32 output columns, each the K / 32 blocks in order, a block
// one record: the codes, then d as 32 float16, then (Q4_1) m as 32 float16:
//   Q8_0 codes [8 groups][32 columns][4]: byte i of group g is column c's code 4g + i, plus 128
//   Q4_x codes [4 groups][32 columns][4]: low nibble code 4g + i, high nibble code 16 + 4g + i
// (records of 1088, 576 and 640 bytes: whole cache lines). N is padded to a multiple of 32 with
// zero scales.
//
// Summation order, which decides the bits: each block's integer sum is exact; per output, the
// blocks are added in order of k in float32 (one FMA each: the integer sum, converted, times
// d dx; Q4_1 then adds m times dx sx with a second FMA), then the bias, then one rounding to
// bf16. Rows of x, threads and the number of rows do not change any of this, so a row's result
// does not depend on the rest of the batch: prompt and generated tokens can share a step.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define QPANEL 32
#define QBLOCK 32
#define QGROUP 4  // rows of x per pass over a panel

enum { Q8_0 = 1, Q4_0 = 2, Q4_1 = 3, Q4_K = 4, PARTS = 7 };  // 4..6: K-quants, qmatmul_k.c

static int codes_bytes(int format) { return format == Q8_0 ? QPANEL * QBLOCK : QPANEL * QBLOCK / 2; }

// The unsigned code of weight k (0..31) of column c in a block record (the layout above).
static inline int block_code(int format, const uint8_t* r, int c, int k) {
    if (format == Q8_0) return r[(k / 4) * 128 + c * 4 + k % 4];
    if (k < 16) return r[(k / 4) * 128 + c * 4 + k % 4] & 0x0F;
    return r[((k - 16) / 4) * 128 + c * 4 + k % 4] >> 4;
}

int qmatmul_record_bytes(int format) {
    switch (format) {
        case Q8_0: return QPANEL * QBLOCK + 2 * QPANEL;
        case Q4_0: return QPANEL * QBLOCK / 2 + 2 * QPANEL;
        case Q4_1: return QPANEL * QBLOCK / 2 + 4 * QPANEL;
        default: return -1;
    }
}

int qmatmul_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

// Which loops this build runs (here and in qmatmul_k.c): 2 AVX-512 VNNI, 1 AVX2, 0 plain C.
int qmatmul_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

// Rows of x (bf16, K a multiple of 32) to int8 blocks: q [M][K], d [M][K / 32] (float32 scale),
// s [M][K / 32] (sum of the block's codes). Rounding to nearest, ties to even.
static void quantize_row(const uint16_t* x, int K, int8_t* q, float* d, int32_t* s) {
    for (int b = 0; b < K / QBLOCK; b++) {
        float v[QBLOCK], amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            v[i] = bf16_to_f32(x[b * QBLOCK + i]);
            const float a = v[i] < 0 ? -v[i] : v[i];
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const int32_t c = (int32_t)__builtin_rintf(v[i] * inv);
            q[b * QBLOCK + i] = (int8_t)c;
            sum += c;
        }
        d[b] = scale;
        s[b] = sum;
    }
}

int quantize_rows_q8_bf16(const uint16_t* x, int64_t x_stride, int M, int K, int8_t* q, float* d,
                          int32_t* s) {
    if (M < 1 || K < QBLOCK || K % QBLOCK) return -1;
    const int nb = K / QBLOCK;
    for (int m = 0; m < M; m++)
        quantize_row(x + m * x_stride, K, q + (int64_t)m * K, d + (int64_t)m * nb,
                     s + (int64_t)m * nb);
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define PREFETCH_BYTES 2048

// A column pair's integer sums += the products of its codes (a, b: 16 columns each) with x's
// four codes broadcast in xv.
static inline __attribute__((always_inline)) void add_products(__m512i sums[2], __m512i a,
                                                                __m512i b, __m512i xv) {
    sums[0] = _mm512_dpbusd_epi32(sums[0], a, xv);
    sums[1] = _mm512_dpbusd_epi32(sums[1], b, xv);
}

// One panel (32 output columns) against MB (1..QGROUP) rows of quantized x; out [MB][32].
static inline __attribute__((always_inline)) void qpanel(const int FMT, const int MB,
                                                         const int8_t* xq, const float* xd,
                                                         const int32_t* xs, int K,
                                                         const uint8_t* p, float* out) {
    const int nb = K / QBLOCK, record = qmatmul_record_bytes(FMT), cb = codes_bytes(FMT);
    const int SPLIT = MB < 3;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[QGROUP][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, p += record) {
        for (int line = 0; line < record; line += 64)
            _mm_prefetch((const char*)p + PREFETCH_BYTES + line, _MM_HINT_T0);
        // For one or two rows (SPLIT), two integer sums per output (even / odd groups, or low /
        // high nibbles), added at the end of the block: shorter chains of vpdpbusd; from three
        // rows on the rows' chains are enough. The same exact sum either way.
        __m512i dot[QGROUP][2], odd[QGROUP][2];
        for (int m = 0; m < MB; m++) {
            const int32_t sx = xs[m * nb + b];
            const __m512i start = _mm512_set1_epi32(FMT == Q8_0 ? -128 * sx
                                                    : FMT == Q4_0 ? -8 * sx
                                                                  : 0);
            dot[m][0] = dot[m][1] = start;
            odd[m][0] = odd[m][1] = _mm512_setzero_si512();
        }
        if (FMT == Q8_0) {
            for (int g = 0; g < 8; g += 2) {
                const __m512i w0 = _mm512_loadu_si512(p + g * 128);
                const __m512i w1 = _mm512_loadu_si512(p + g * 128 + 64);
                const __m512i u0 = _mm512_loadu_si512(p + g * 128 + 128);
                const __m512i u1 = _mm512_loadu_si512(p + g * 128 + 192);
                for (int m = 0; m < MB; m++) {
                    int32_t four, next;
                    memcpy(&four, xq + (int64_t)m * K + b * QBLOCK + 4 * g, sizeof(four));
                    memcpy(&next, xq + (int64_t)m * K + b * QBLOCK + 4 * g + 4, sizeof(next));
                    const __m512i xv = _mm512_set1_epi32(four), xn = _mm512_set1_epi32(next);
                    add_products(dot[m], w0, w1, xv);
                    add_products(SPLIT ? odd[m] : dot[m], u0, u1, xn);
                }
            }
        } else {
            for (int g = 0; g < 4; g++) {
                const __m512i v0 = _mm512_loadu_si512(p + g * 128);
                const __m512i v1 = _mm512_loadu_si512(p + g * 128 + 64);
                const __m512i lo0 = _mm512_and_si512(v0, low);
                const __m512i lo1 = _mm512_and_si512(v1, low);
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
                for (int m = 0; m < MB; m++) {
                    int32_t lo4, hi4;
                    const int8_t* xb = xq + (int64_t)m * K + b * QBLOCK;
                    memcpy(&lo4, xb + 4 * g, sizeof(lo4));
                    memcpy(&hi4, xb + 16 + 4 * g, sizeof(hi4));
                    const __m512i xl = _mm512_set1_epi32(lo4), xh = _mm512_set1_epi32(hi4);
                    add_products(dot[m], lo0, lo1, xl);
                    add_products(SPLIT ? odd[m] : dot[m], hi0, hi1, xh);
                }
            }
        }
        for (int m = 0; m < MB && SPLIT; m++) {
            dot[m][0] = _mm512_add_epi32(dot[m][0], odd[m][0]);
            dot[m][1] = _mm512_add_epi32(dot[m][1], odd[m][1]);
        }
        const uint8_t* sc = p + cb;
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)));
        for (int m = 0; m < MB; m++) {
            const float dx = xd[m * nb + b];
            const __m512 dxv = _mm512_set1_ps(dx);
            acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(d0, dxv),
                                        acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), _mm512_mul_ps(d1, dxv),
                                        acc[m][1]);
        }
        if (FMT == Q4_1) {
            const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 64)));
            const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 96)));
            for (int m = 0; m < MB; m++) {
                const __m512 dsx = _mm512_set1_ps(xd[m * nb + b] * (float)xs[m * nb + b]);
                acc[m][0] = _mm512_fmadd_ps(m0, dsx, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(m1, dsx, acc[m][1]);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        _mm512_storeu_ps(out + m * QPANEL, acc[m][0]);
        _mm512_storeu_ps(out + m * QPANEL + 16, acc[m][1]);
    }
}

static void run_panel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                      int K, const uint8_t* p, float* out) {
#define QCASE(F, N) \
    case N: qpanel(F, N, xq, xd, xs, K, p, out); break;
#define QFORMAT(F)                                    \
    switch (MB) {                                     \
        QCASE(F, 1) QCASE(F, 2) QCASE(F, 3)           \
        default: qpanel(F, QGROUP, xq, xd, xs, K, p, out); \
    }
    if (format == Q8_0) {
        QFORMAT(Q8_0)
    } else if (format == Q4_0) {
        QFORMAT(Q4_0)
    } else {
        QFORMAT(Q4_1)
    }
#undef QFORMAT
#undef QCASE
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define PREFETCH_BYTES 2048
#define AVX2_GROUP 2  // rows of x per pass here: 16 ymm registers hold 2 rows' sums

// AVX2 without VNNI (Zen 2/3, Haswell to Skylake): the same exact integer sums from vpmaddubsw
// (unsigned times signed byte pairs, added to int16 with saturation) and vpmaddwd (int16 pairs
// to int32), with the codes kept small enough that nothing saturates: Q4's nibbles (0..15)
// times qx (|qx| <= 127), a pair at most 3810 and a low plus a high pair 7620; Q8_0's signed
// code q = u - 128 as |q| (<= 128) times qx carrying q's sign, a pair at most 32512, which sums
// q qx directly (the VNNI path's sum(u qx) - 128 sx). A ymm holds 8 columns: 4 per panel.
static inline __attribute__((always_inline)) void qpanel(const int FMT, const int MB,
                                                         const int8_t* xq, const float* xd,
                                                         const int32_t* xs, int K,
                                                         const uint8_t* p, float* out) {
    const int nb = K / QBLOCK, record = qmatmul_record_bytes(FMT), cb = codes_bytes(FMT);
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AVX2_GROUP][4];
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < 4; c++) acc[m][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, p += record) {
        for (int line = 0; line < record; line += 64)
            _mm_prefetch((const char*)p + PREFETCH_BYTES + line, _MM_HINT_T0);
        __m256i dot[AVX2_GROUP][4];
        for (int m = 0; m < MB; m++)
            for (int c = 0; c < 4; c++)
                dot[m][c] = _mm256_set1_epi32(FMT == Q4_0 ? -8 * xs[m * nb + b] : 0);
        if (FMT == Q8_0) {
            for (int g = 0; g < 8; g++) {
                __m256i magnitude[4], code[4];
                for (int c = 0; c < 4; c++) {
                    code[c] = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i*)(p + g * 128 + 32 * c)), flip);
                    magnitude[c] = _mm256_abs_epi8(code[c]);
                }
                for (int m = 0; m < MB; m++) {
                    int32_t four;
                    memcpy(&four, xq + (int64_t)m * K + b * QBLOCK + 4 * g, sizeof(four));
                    const __m256i xv = _mm256_set1_epi32(four);
                    for (int c = 0; c < 4; c++) {
                        const __m256i pairs =
                            _mm256_maddubs_epi16(magnitude[c], _mm256_sign_epi8(xv, code[c]));
                        dot[m][c] = _mm256_add_epi32(dot[m][c], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        } else {
            for (int g = 0; g < 4; g++) {
                __m256i lo[4], hi[4];
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + g * 128 + 32 * c));
                    lo[c] = _mm256_and_si256(v, low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for (int m = 0; m < MB; m++) {
                    int32_t lo4, hi4;
                    const int8_t* xb = xq + (int64_t)m * K + b * QBLOCK;
                    memcpy(&lo4, xb + 4 * g, sizeof(lo4));
                    memcpy(&hi4, xb + 16 + 4 * g, sizeof(hi4));
                    const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
                    for (int c = 0; c < 4; c++) {
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xl),
                                                               _mm256_maddubs_epi16(hi[c], xh));
                        dot[m][c] = _mm256_add_epi32(dot[m][c], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        const uint8_t* sc = p + cb;
        for (int c = 0; c < 4; c++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 16 * c)));
            for (int m = 0; m < MB; m++)
                acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][c]),
                                            _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])),
                                            acc[m][c]);
        }
        if (FMT == Q4_1) {
            for (int c = 0; c < 4; c++) {
                const __m256 mins =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 64 + 16 * c)));
                for (int m = 0; m < MB; m++)
                    acc[m][c] = _mm256_fmadd_ps(
                        mins, _mm256_set1_ps(xd[m * nb + b] * (float)xs[m * nb + b]), acc[m][c]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + m * QPANEL + 8 * c, acc[m][c]);
}

static void run_panel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                      int K, const uint8_t* p, float* out) {
    const int nb = K / QBLOCK;
    for (int m0 = 0; m0 < MB; m0 += AVX2_GROUP) {  // the later passes find the panel in cache
        const int two = MB - m0 >= 2;
        const int8_t* q = xq + (int64_t)m0 * K;
        const float* d = xd + m0 * nb;
        const int32_t* sums = xs + m0 * nb;
        float* o = out + m0 * QPANEL;
        if (format == Q8_0)
            two ? qpanel(Q8_0, 2, q, d, sums, K, p, o) : qpanel(Q8_0, 1, q, d, sums, K, p, o);
        else if (format == Q4_0)
            two ? qpanel(Q4_0, 2, q, d, sums, K, p, o) : qpanel(Q4_0, 1, q, d, sums, K, p, o);
        else
            two ? qpanel(Q4_1, 2, q, d, sums, K, p, o) : qpanel(Q4_1, 1, q, d, sums, K, p, o);
    }
}
#else
// Portable C: the same sums in the same order, a column at a time.
static void run_panel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                      int K, const uint8_t* p, float* out) {
    const int nb = K / QBLOCK, record = qmatmul_record_bytes(format), cb = codes_bytes(format);
    for (int m = 0; m < MB; m++) {
        for (int c = 0; c < QPANEL; c++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t* r = p + (int64_t)b * record;
                const int8_t* xb = xq + (int64_t)m * K + b * QBLOCK;
                const int32_t sx = xs[m * nb + b];
                int32_t dot = format == Q8_0 ? -128 * sx : format == Q4_0 ? -8 * sx : 0;
                for (int k = 0; k < QBLOCK; k++) dot += block_code(format, r, c, k) * xb[k];
                uint16_t h;
                memcpy(&h, r + cb + 2 * c, sizeof(h));
                const float dx = xd[m * nb + b];
                acc = (float)dot * (f16_to_f32(h) * dx) + acc;
                if (format == Q4_1) {
                    memcpy(&h, r + cb + 64 + 2 * c, sizeof(h));
                    acc = f16_to_f32(h) * (dx * (float)sx) + acc;
                }
            }
            out[m * QPANEL + c] = acc;
        }
    }
}
#endif

// Prompt rows on AMX tiles (qmatmul_rows_bf16): blocks [b0, b1) of `packed` (Q8_0 / Q4_0 /
// Q4_1; a panel's K / 32 blocks in a row, so block b of panel p is number p K / 32 + b) as bf16
// weights in gemv.c's packed layout, each block 16 pair rows [16][32][2] (for column c, weights
// k and k + 1 side by side): panels [p0, p1) come out as [p1 - p0][K / 2][32][2]. Each weight is
// d (u - 128), d (q - 8) or d q + m (one FMA) in float32, rounded once to bf16, to nearest with
// ties to even: bits of the weight alone. The K-quants' sub-blocks of 32 come out the same way
// (qmatmul_k_dequantize_bf16). qmatmul_dequantizes: whether a format's weight of K columns can.
static inline float dequantize_one(int format, int u, float d, float m) {
    if (format == Q8_0) return (float)(u - 128) * d;
    if (format == Q4_0) return (float)(u - 8) * d;
    return __builtin_fmaf(d, (float)u, m);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define DEQUANTIZE_PREFETCH 4096  // bytes ahead of the block being dequantized

// 16 columns' weights k (codes in `a`) and k + 1 (in `b`), as int32 lanes of bf16 pairs.
static inline __m512i bf16_pairs(int format, __m512i a, __m512i b, __m512 d, __m512 m) {
    __m512 wa, wb;
    if (format == Q4_1) {
        wa = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(a), m);
        wb = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(b), m);
    } else {
        const __m512i zero = _mm512_set1_epi32(format == Q8_0 ? 128 : 8);
        wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a, zero)), d);
        wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(b, zero)), d);
    }
    return bf16_pair_lanes(wa, wb);
}

// One block (32 values of k) of 16 columns (half h of the panel) into its 16 pair rows.
static void dequantize_block_half(int format, const uint8_t* r, int h, uint16_t* out) {
    const uint8_t* sc = r + codes_bytes(format);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32 * h)));
    const __m512 m = format == Q4_1
                         ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 64 + 32 * h)))
                         : _mm512_setzero_ps();
    const __m512i byte = _mm512_set1_epi32(0xFF), nibble = _mm512_set1_epi32(0x0F);
    uint16_t* o = out + 32 * h;  // pair row j: o + 64 j
    if (format == Q8_0) {
        for (int g = 0; g < 8; g++) {  // codes 4g .. 4g + 3: pair rows 2g, 2g + 1
            const __m512i v = _mm512_loadu_si512(r + g * 128 + 64 * h);
            const __m512i c0 = _mm512_and_si512(v, byte);
            const __m512i c1 = _mm512_and_si512(_mm512_srli_epi32(v, 8), byte);
            const __m512i c2 = _mm512_and_si512(_mm512_srli_epi32(v, 16), byte);
            const __m512i c3 = _mm512_srli_epi32(v, 24);
            _mm512_storeu_si512(o + 64 * (2 * g), bf16_pairs(format, c0, c1, d, m));
            _mm512_storeu_si512(o + 64 * (2 * g + 1), bf16_pairs(format, c2, c3, d, m));
        }
        return;
    }
    for (int g = 0; g < 4; g++) {  // low nibbles: codes 4g ..; high nibbles: codes 16 + 4g ..
        const __m512i v = _mm512_loadu_si512(r + g * 128 + 64 * h);
        __m512i c[8];
        for (int i = 0; i < 8; i++) c[i] = _mm512_and_si512(_mm512_srli_epi32(v, 4 * i), nibble);
        // c[2i]: byte i's low nibble (code 4g + i), c[2i + 1]: its high one (16 + 4g + i)
        _mm512_storeu_si512(o + 64 * (2 * g), bf16_pairs(format, c[0], c[2], d, m));
        _mm512_storeu_si512(o + 64 * (2 * g + 1), bf16_pairs(format, c[4], c[6], d, m));
        _mm512_storeu_si512(o + 64 * (8 + 2 * g), bf16_pairs(format, c[1], c[3], d, m));
        _mm512_storeu_si512(o + 64 * (9 + 2 * g), bf16_pairs(format, c[5], c[7], d, m));
    }
}
#endif

int qmatmul_dequantizes(int format, int K) {
    if (format >= Q8_0 && format <= Q4_1) return K >= QBLOCK && K % QBLOCK == 0;
    return qmatmul_k_record_bytes(format) > 0 && K >= 256 && K % 256 == 0;
}

int qmatmul_dequantize_bf16(int format, const uint8_t* packed, int64_t b0, int64_t b1,
                            uint16_t* out) {
    if (format >= Q4_K) return qmatmul_k_dequantize_bf16(format, packed, b0, b1, out);
    if (format < Q8_0 || b0 < 0 || b1 < b0) return -1;
    const int record = qmatmul_record_bytes(format), cb = codes_bytes(format);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t* r = packed + b * record;
        uint16_t* ob = out + (b - b0) * QBLOCK * QPANEL;  // 16 pair rows of 64
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        (void)cb;
        for (int line = 0; line < record; line += 64)  // the weights stream from memory
            _mm_prefetch((const char*)r + DEQUANTIZE_PREFETCH + line, _MM_HINT_T0);
        dequantize_block_half(format, r, 0, ob);
        dequantize_block_half(format, r, 1, ob);
#else
        for (int c = 0; c < QPANEL; c++) {
            uint16_t h;
            memcpy(&h, r + cb + 2 * c, sizeof(h));
            const float d = f16_to_f32(h);
            float m = 0.0f;
            if (format == Q4_1) {
                memcpy(&h, r + cb + 64 + 2 * c, sizeof(h));
                m = f16_to_f32(h);
            }
            for (int k = 0; k < QBLOCK; k++)
                ob[(k / 2) * 2 * QPANEL + 2 * c + k % 2] =
                    f32_to_bf16(dequantize_one(format, block_code(format, r, c, k), d, m));
        }
#endif
    }
    return 0;
}

// A step's rows, those from `first_prompt` on its prompt tokens: where the bf16 matmul runs on
// AMX tiles (gemv_bf16_uses_amx) and the weight can be dequantized (qmatmul_dequantizes: every
// format, the K-quants with K a multiple of 256), the prompt rows take qmatmul_amx_bf16 (the
// weight dequantized to bf16 a chunk of panels at a time, bf16 rows on the tiles: prefill is
// compute-bound, and AMX's bf16 rate is 8x VNNI's int8 here), and the rows before it (generated
// tokens) the int8 sums. A weight in parts (q | k | v of two K-quants) does so part by part.
// Each row's bits depend on its kind and its values only, so a request's bits do not depend on
// the batch or on how its prompt is chunked. Elsewhere, every row takes qmatmul_bf16_then.
// Arguments as qmatmul_bf16's.
int qmatmul_rows_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                      int M, int N, int K, int first_prompt, int num_threads) {
    if (first_prompt < 0 || first_prompt > M) return -1;
    if (format == PARTS)
        return qmatmul_parts_rows_bf16(x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N,
                                       K, first_prompt, num_threads);
    const int prompt_rows = M - first_prompt;
    if (prompt_rows > 0 && qmatmul_dequantizes(format, K) && gemv_bf16_uses_amx()) {
        const int64_t at = (int64_t)first_prompt * y_stride;
        const int status = qmatmul_amx_bf16(
            format, x + (int64_t)first_prompt * x_stride, x_stride, packed, bias,
            y_bf16 ? y_bf16 + at : NULL, y_bf16 ? NULL : y_f32 + at, y_stride, prompt_rows, N, K,
            num_threads);
        if (status != 0) return status;
        if (first_prompt == 0) return 0;
        M = first_prompt;
    }
    return qmatmul_bf16(format, x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N, K,
                        num_threads);
}

// x [M, x_stride] bf16 (first K columns used, K a multiple of 32); packed as above, `format` one
// of Q8_0 / Q4_0 / Q4_1 (Q4_K / Q5_K / Q6_K: qmatmul_k.c, K a multiple of 256); bias [N] bf16
// or NULL. Output row m: y_bf16 + m * y_stride (bf16), or
// when y_bf16 is NULL, y_f32 + m * y_stride (float32 holding the bf16-rounded value).
// Returns 0, -1 for a shape or format it does not take, -3 out of memory.
int qmatmul_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                 const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                 int N, int K, int num_threads) {
    return qmatmul_bf16_then(format, x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N, K,
                             num_threads, NULL);
}

// qmatmul_bf16 with `then` (NULL: nothing) in its parallel region.
int qmatmul_bf16_then(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                      int M, int N, int K, int num_threads, const ColumnEpilogue* then) {
    if (format >= Q4_K)  // the K-quants, and weights in parts: qmatmul_k.c
        return qmatmul_k_bf16_then(format, x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M,
                                   N, K, num_threads, then);
    if (M < 1 || N < 1 || K < QBLOCK || K % QBLOCK || qmatmul_record_bytes(format) < 0) return -1;
    const int nb = K / QBLOCK, panels = (N + QPANEL - 1) / QPANEL;
    const int64_t panel_bytes = (int64_t)nb * qmatmul_record_bytes(format);
    int8_t* xq = malloc((size_t)M * (size_t)K);
    float* xd = malloc((size_t)M * nb * sizeof(float));
    int32_t* xs = malloc((size_t)M * nb * sizeof(int32_t));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -3;
    }
    const int threads = panels < 2 * num_threads && M < 2 * num_threads ? 1 : num_threads;
    const int groups = (M + QGROUP - 1) / QGROUP;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp for schedule(static) nowait
        for (int m = 0; m < M; m++)
            quantize_row(x + m * x_stride, K, xq + (int64_t)m * K, xd + (int64_t)m * nb,
                         xs + (int64_t)m * nb);
        if (then && then->before) then->before(then->ctx, t, nt);
#pragma omp barrier
        float out[QGROUP * QPANEL];
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int pi = p0; pi < p1; pi++) {
            const uint8_t* p = packed + pi * panel_bytes;
            const int n0 = pi * QPANEL;
            for (int g = 0; g < groups; g++) {
                const int m0 = (int)((int64_t)M * g / groups);
                const int MB = (int)((int64_t)M * (g + 1) / groups) - m0;
                run_panel(format, MB, xq + (int64_t)m0 * K, xd + (int64_t)m0 * nb,
                          xs + (int64_t)m0 * nb, K, p, out);
                store_panel(out, QPANEL, MB, m0, n0, N, bias, y_bf16, y_f32, y_stride);
            }
        }
        if (then && p1 > p0)
            then->after(then->ctx, p0 * QPANEL, p1 * QPANEL < N ? p1 * QPANEL : N);
    }
    free(xq), free(xd), free(xs);
    return 0;
}
