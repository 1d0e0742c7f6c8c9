// Matmul on GGUF K-quant weights (Q4_K, Q5_K, Q6_K: what "Q4_K_M" files hold) for CPUs:
// y = x W^T (+ bias), x bf16, any number of rows; qmatmul_bf16 (qmatmul.c) hands these formats
// here. The weights stay in their super-blocks of 256, repacked once at load time; each row of x
// is quantized to int8 in blocks of 32 exactly as for Q8_0 / Q4_x (quantize_rows_q8_bf16: dx,
// codes qx, sums sx), so every dot product is integer, one AVX-512 VNNI vpdpbusd per 4 columns
// of K (unsigned weight codes times signed activations; without VNNI an AVX2 loop, then plain C,
// with the same sums):
//   Q4_K / Q5_K: sub-blocks of 32, w = d sc q - dmin m  (q 4 / 5 bits, sc and m 6 bits)
//     per sub-block j:  d dx (sc sum(q qx)) - dmin dx (m sx)
//   Q6_K: sub-blocks of 16, w = d sc (q - 32)  (q 6 bits, sc int8); an activation block of 32
//     covers two:  d dx (sc_a (sum_a(q qx) - 32 s_a) + sc_b (sum_b(q qx) - 32 s_b))
//     with s_a, s_b the sums of the block's first and last 16 codes.
//
// Packed layout: panels of KPANEL = 32 output columns, each the K / 256 super-blocks in order, a
// super-block one record: the 8 sub-blocks of 32 along K, then the scales.
//   a sub-block: the low 4 bits of each code as qmatmul.c packs Q4_x, [4 groups][32 columns][4],
//     low nibble code 4g + i, high nibble code 16 + 4g + i; then for Q5_K the fifth bits,
//     [2 halves of 16 columns][64]: bit 2g + h of byte 4c + i is code h 16 + 4g + i's; for Q6_K
//     the top two bits, [2 halves][2][64]: bits 2s, 2s + 1 of byte 4c + i of plane t are code
//     h 16 + 4g + i's where 2g + h = 4t + s. A 64-byte load then holds 16 columns' codes.
//   the scales: Q4_K / Q5_K  sc [8][32] uint8, m [8][32] uint8, d [32] f16, dmin [32] f16;
//               Q6_K         sc [16][32] int8, d [32] f16.
// Records of 4736, 5760 and 6720 bytes: 4.625, 5.625 and 6.5625 bits a weight.
//
// Summation order, which decides the bits: the integer products above are exact, and below
// 2^24, so their conversion to float32 is exact; per output the sub-blocks are added in order of
// k in float32, one FMA each (Q4_K / Q5_K a second one for the mins, with -dmin dx), then the
// bias, then one rounding to bf16. Nothing depends on the rows, the threads or the batch.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define KPANEL 32
#define KSUPER 256
#define KSUB 32
#define KGROUP 4  // rows of x per pass over a panel

enum { Q4_K = 4, Q5_K = 5, Q6_K = 6, PARTS = 7 };

static int high_bytes(int format) { return format == Q4_K ? 0 : format == Q5_K ? 128 : 256; }
static int sub_bytes(int format) { return KPANEL * KSUB / 2 + high_bytes(format); }
static int scale_bytes(int format) {
    return format == Q6_K ? 16 * KPANEL + 2 * KPANEL : 2 * 8 * KPANEL + 4 * KPANEL;
}

int qmatmul_k_record_bytes(int format) {
    if (format < Q4_K || format > Q6_K) return -1;
    return 8 * sub_bytes(format) + scale_bytes(format);
}

// Column c's code k (0..31) of a packed sub-block (the layout at the top).
static inline int packed_code(int format, const uint8_t* c, int col, int k) {
    const int h = k / 16, g = (k % 16) / 4, i = k % 4, idx = 2 * g + h;
    const int half = col / 16, pos = (col % 16) * 4 + i;
    int u = (c[g * 128 + half * 64 + pos] >> (4 * h)) & 0x0F;
    if (format == Q5_K) u |= ((c[512 + half * 64 + pos] >> idx) & 1) << 4;
    if (format == Q6_K) u |= ((c[512 + half * 128 + (idx / 4) * 64 + pos] >> (2 * (idx % 4))) & 3) << 4;
    return u;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define PREFETCH_BYTES 2048

// Bit `from` of every byte of h moved to bit `to` (the other bits are masked off by the caller).
static inline __attribute__((always_inline)) __m512i move_bits(__m512i h, int from, int to) {
    return from < to ? _mm512_slli_epi16(h, to - from)
                     : from > to ? _mm512_srli_epi16(h, from - to) : h;
}

// a | (b & c), one vpternlogd
static inline __attribute__((always_inline)) __m512i or_masked(__m512i a, __m512i b, __m512i c) {
    return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

static inline __attribute__((always_inline)) __m512i bytes_to_epi32(const uint8_t* p, int sign) {
    const __m128i v = _mm_loadu_si128((const __m128i*)p);
    return sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// One panel (32 output columns) against MB (1..KGROUP) rows of quantized x; out [MB][32].
static inline __attribute__((always_inline)) void kpanel(const int FMT, const int MB,
                                                         const int8_t* xq, const float* xd,
                                                         const int32_t* xs, const int32_t* xlo,
                                                         int K, const uint8_t* p, float* out) {
    const int nsuper = K / KSUPER, nb = K / KSUB, sub = sub_bytes(FMT);
    const int record = qmatmul_k_record_bytes(FMT), lines = (record + 63) / 64;
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[KGROUP][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int s = 0; s < nsuper; s++, p += record) {
        const uint8_t* scales = p + 8 * sub;
        const uint8_t* dh = scales + 16 * KPANEL;  // after sc (and m): d (and dmin)
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dh));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + 32)));
        __m512 nm0 = _mm512_setzero_ps(), nm1 = _mm512_setzero_ps();
        if (FMT != Q6_K) {  // -dmin
            nm0 = _mm512_sub_ps(nm0, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + 64))));
            nm1 = _mm512_sub_ps(nm1, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + 96))));
        }
        for (int j = 0; j < 8; j++) {
            for (int line = j * lines / 8; line < (j + 1) * lines / 8; line++)
                _mm_prefetch((const char*)p + PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
            const uint8_t* c = p + j * sub;
            const int b = s * 8 + j;
            __m512i dot[KGROUP][2], odd[KGROUP][2];
            for (int m = 0; m < MB; m++) {
                if (FMT == Q6_K) {
                    const int32_t lo = xlo[m * nb + b], hi = xs[m * nb + b] - lo;
                    dot[m][0] = dot[m][1] = _mm512_set1_epi32(-32 * lo);
                    odd[m][0] = odd[m][1] = _mm512_set1_epi32(-32 * hi);
                } else {
                    dot[m][0] = dot[m][1] = odd[m][0] = odd[m][1] = _mm512_setzero_si512();
                }
            }
            for (int g = 0; g < 4; g++) {
                const __m512i v0 = _mm512_loadu_si512(c + g * 128);
                const __m512i v1 = _mm512_loadu_si512(c + g * 128 + 64);
                __m512i lo0 = _mm512_and_si512(v0, low), lo1 = _mm512_and_si512(v1, low);
                __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
                __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
                if (FMT == Q5_K) {
                    const __m512i h0 = _mm512_loadu_si512(c + 512);
                    const __m512i h1 = _mm512_loadu_si512(c + 576);
                    lo0 = or_masked(lo0, move_bits(h0, 2 * g, 4), bit4);
                    lo1 = or_masked(lo1, move_bits(h1, 2 * g, 4), bit4);
                    hi0 = or_masked(hi0, move_bits(h0, 2 * g + 1, 4), bit4);
                    hi1 = or_masked(hi1, move_bits(h1, 2 * g + 1, 4), bit4);
                } else if (FMT == Q6_K) {
                    const int t = g / 2, sl = 2 * (g % 2);
                    const __m512i h0 = _mm512_loadu_si512(c + 512 + t * 64);
                    const __m512i h1 = _mm512_loadu_si512(c + 512 + 128 + t * 64);
                    lo0 = or_masked(lo0, move_bits(h0, 2 * sl, 4), bits45);
                    lo1 = or_masked(lo1, move_bits(h1, 2 * sl, 4), bits45);
                    hi0 = or_masked(hi0, move_bits(h0, 2 * sl + 2, 4), bits45);
                    hi1 = or_masked(hi1, move_bits(h1, 2 * sl + 2, 4), bits45);
                }
                for (int m = 0; m < MB; m++) {
                    int32_t lo4, hi4;
                    const int8_t* xb = xq + (int64_t)m * K + b * KSUB;
                    memcpy(&lo4, xb + 4 * g, sizeof(lo4));
                    memcpy(&hi4, xb + 16 + 4 * g, sizeof(hi4));
                    const __m512i xl = _mm512_set1_epi32(lo4), xh = _mm512_set1_epi32(hi4);
                    dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo0, xl);
                    dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], lo1, xl);
                    odd[m][0] = _mm512_dpbusd_epi32(odd[m][0], hi0, xh);
                    odd[m][1] = _mm512_dpbusd_epi32(odd[m][1], hi1, xh);
                }
            }
            // The scale products are integers below 2^24 (|sc q x| sums: under 8.4M for Q4_K /
            // Q5_K, two under 8.4M for Q6_K; m sx under 2^18), so float32 holds them exactly:
            // products of the float32 factors (vpmulld's two uops and ten cycles spared), the
            // same numbers as the integer ones converted.
            if (FMT == Q6_K) {
                const uint8_t* sa = scales + 2 * j * KPANEL;
                const __m512 a0 = _mm512_cvtepi32_ps(bytes_to_epi32(sa, 1));
                const __m512 a1 = _mm512_cvtepi32_ps(bytes_to_epi32(sa + 16, 1));
                const __m512 b0 = _mm512_cvtepi32_ps(bytes_to_epi32(sa + 32, 1));
                const __m512 b1 = _mm512_cvtepi32_ps(bytes_to_epi32(sa + 48, 1));
                for (int m = 0; m < MB; m++) {
                    const __m512 t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), a0,
                                                      _mm512_mul_ps(_mm512_cvtepi32_ps(odd[m][0]), b0));
                    const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), a1,
                                                      _mm512_mul_ps(_mm512_cvtepi32_ps(odd[m][1]), b1));
                    const __m512 dxv = _mm512_set1_ps(xd[m * nb + b]);
                    acc[m][0] = _mm512_fmadd_ps(t0, _mm512_mul_ps(d0, dxv), acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(t1, _mm512_mul_ps(d1, dxv), acc[m][1]);
                }
            } else {
                const uint8_t* sc = scales + j * KPANEL;
                const uint8_t* mn = scales + 8 * KPANEL + j * KPANEL;
                const __m512 s0 = _mm512_cvtepi32_ps(bytes_to_epi32(sc, 0));
                const __m512 s1 = _mm512_cvtepi32_ps(bytes_to_epi32(sc + 16, 0));
                const __m512 m0 = _mm512_cvtepi32_ps(bytes_to_epi32(mn, 0));
                const __m512 m1 = _mm512_cvtepi32_ps(bytes_to_epi32(mn + 16, 0));
                for (int m = 0; m < MB; m++) {
                    const __m512 t0 = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_add_epi32(dot[m][0], odd[m][0])), s0);
                    const __m512 t1 = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_add_epi32(dot[m][1], odd[m][1])), s1);
                    const __m512 dxv = _mm512_set1_ps(xd[m * nb + b]);
                    const __m512 sxv = _mm512_set1_ps((float)xs[m * nb + b]);
                    acc[m][0] = _mm512_fmadd_ps(t0, _mm512_mul_ps(d0, dxv), acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(t1, _mm512_mul_ps(d1, dxv), acc[m][1]);
                    acc[m][0] = _mm512_fmadd_ps(_mm512_mul_ps(m0, sxv), _mm512_mul_ps(nm0, dxv),
                                                acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(_mm512_mul_ps(m1, sxv), _mm512_mul_ps(nm1, dxv),
                                                acc[m][1]);
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        _mm512_storeu_ps(out + m * KPANEL, acc[m][0]);
        _mm512_storeu_ps(out + m * KPANEL + 16, acc[m][1]);
    }
}

static void run_kpanel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                       const int32_t* xlo, int K, const uint8_t* p, float* out) {
#define KCASE(F, N) \
    case N: kpanel(F, N, xq, xd, xs, xlo, K, p, out); break;
#define KFORMAT(F)                                              \
    switch (MB) {                                               \
        KCASE(F, 1) KCASE(F, 2) KCASE(F, 3)                     \
        default: kpanel(F, KGROUP, xq, xd, xs, xlo, K, p, out); \
    }
    if (format == Q4_K) {
        KFORMAT(Q4_K)
    } else if (format == Q5_K) {
        KFORMAT(Q5_K)
    } else {
        KFORMAT(Q6_K)
    }
#undef KFORMAT
#undef KCASE
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define PREFETCH_BYTES 2048

// AVX2 without VNNI: qmatmul.c's AVX2 loop for the K-quants, one row of x per pass (16 ymm
// registers hold one row's sums), a ymm 8 columns (4 per panel). vpmaddubsw never saturates:
// codes below 64 times |qx| <= 127 make a pair at most 16002; Q4_K / Q5_K (codes below 32)
// add a sub-block's low and high pairs in int16 (at most 15748) as they are summed anyway.
static inline __attribute__((always_inline)) __m256i move_bits256(__m256i h, int from, int to) {
    return from < to ? _mm256_slli_epi16(h, to - from)
                     : from > to ? _mm256_srli_epi16(h, from - to) : h;
}

static inline __attribute__((always_inline)) __m256i bytes8_to_epi32(const uint8_t* p, int sign) {
    const __m128i v = _mm_loadl_epi64((const __m128i*)p);
    return sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

static inline __attribute__((always_inline)) void kpanel(const int FMT, const int8_t* xq,
                                                         const float* xd, const int32_t* xs,
                                                         const int32_t* xlo, int K,
                                                         const uint8_t* p, float* out) {
    const int nsuper = K / KSUPER, sub = sub_bytes(FMT);
    const int record = qmatmul_k_record_bytes(FMT), lines = (record + 63) / 64;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i high = _mm256_set1_epi8(FMT == Q6_K ? 0x30 : 0x10);
    __m256 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_ps();
    for (int s = 0; s < nsuper; s++, p += record) {
        const uint8_t* scales = p + 8 * sub;
        const uint8_t* dh = scales + 16 * KPANEL;  // after sc (and m): d (and dmin)
        for (int j = 0; j < 8; j++) {
            for (int line = j * lines / 8; line < (j + 1) * lines / 8; line++)
                _mm_prefetch((const char*)p + PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
            const uint8_t* c = p + j * sub;
            const int b = s * 8 + j;
            __m256i dot[4], odd[4];
            for (int q = 0; q < 4; q++) {
                dot[q] = _mm256_set1_epi32(FMT == Q6_K ? -32 * xlo[b] : 0);
                odd[q] = _mm256_set1_epi32(FMT == Q6_K ? -32 * (xs[b] - xlo[b]) : 0);
            }
            for (int g = 0; g < 4; g++) {
                int32_t lo4, hi4;
                memcpy(&lo4, xq + b * KSUB + 4 * g, sizeof(lo4));
                memcpy(&hi4, xq + b * KSUB + 16 + 4 * g, sizeof(hi4));
                const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
                for (int q = 0; q < 4; q++) {  // columns 8q..8q+7
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(c + g * 128 + 32 * q));
                    __m256i lo = _mm256_and_si256(v, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    const int half = q / 2, part = 32 * (q % 2);
                    if (FMT == Q5_K) {
                        const __m256i h =
                            _mm256_loadu_si256((const __m256i*)(c + 512 + half * 64 + part));
                        lo = _mm256_or_si256(lo, _mm256_and_si256(move_bits256(h, 2 * g, 4), high));
                        hi = _mm256_or_si256(hi,
                                             _mm256_and_si256(move_bits256(h, 2 * g + 1, 4), high));
                    } else if (FMT == Q6_K) {
                        const int t = g / 2, sl = 2 * (g % 2);
                        const __m256i h = _mm256_loadu_si256(
                            (const __m256i*)(c + 512 + half * 128 + t * 64 + part));
                        lo = _mm256_or_si256(lo, _mm256_and_si256(move_bits256(h, 2 * sl, 4), high));
                        hi = _mm256_or_si256(hi,
                                             _mm256_and_si256(move_bits256(h, 2 * sl + 2, 4), high));
                    }
                    const __m256i pl = _mm256_maddubs_epi16(lo, xl);
                    const __m256i ph = _mm256_maddubs_epi16(hi, xh);
                    if (FMT == Q6_K) {
                        dot[q] = _mm256_add_epi32(dot[q], _mm256_madd_epi16(pl, ones));
                        odd[q] = _mm256_add_epi32(odd[q], _mm256_madd_epi16(ph, ones));
                    } else {
                        dot[q] = _mm256_add_epi32(dot[q],
                                                  _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
                    }
                }
            }
            const __m256 dxv = _mm256_set1_ps(xd[b]);
            for (int q = 0; q < 4; q++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dh + 16 * q)));
                __m256i t;
                if (FMT == Q6_K) {
                    const uint8_t* sa = scales + 2 * j * KPANEL + 8 * q;
                    t = _mm256_add_epi32(_mm256_mullo_epi32(dot[q], bytes8_to_epi32(sa, 1)),
                                         _mm256_mullo_epi32(odd[q], bytes8_to_epi32(sa + 32, 1)));
                } else {
                    t = _mm256_mullo_epi32(dot[q], bytes8_to_epi32(scales + j * KPANEL + 8 * q, 0));
                }
                acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, dxv), acc[q]);
                if (FMT != Q6_K) {
                    const __m256 nm = _mm256_sub_ps(
                        _mm256_setzero_ps(),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dh + 64 + 16 * q))));
                    const __m256i mins = _mm256_mullo_epi32(
                        bytes8_to_epi32(scales + 8 * KPANEL + j * KPANEL + 8 * q, 0),
                        _mm256_set1_epi32(xs[b]));
                    acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(nm, dxv),
                                             acc[q]);
                }
            }
        }
    }
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(out + 8 * q, acc[q]);
}

static void run_kpanel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                       const int32_t* xlo, int K, const uint8_t* p, float* out) {
    const int nb = K / KSUB;
    for (int m = 0; m < MB; m++) {  // the later passes find the panel in cache
        const int8_t* q = xq + (int64_t)m * K;
        const int64_t at = (int64_t)m * nb;
        if (format == Q4_K)
            kpanel(Q4_K, q, xd + at, xs + at, xlo + at, K, p, out + m * KPANEL);
        else if (format == Q5_K)
            kpanel(Q5_K, q, xd + at, xs + at, xlo + at, K, p, out + m * KPANEL);
        else
            kpanel(Q6_K, q, xd + at, xs + at, xlo + at, K, p, out + m * KPANEL);
    }
}
#else
// Portable C: the same sums in the same order, a column at a time.
static void run_kpanel(int format, int MB, const int8_t* xq, const float* xd, const int32_t* xs,
                       const int32_t* xlo, int K, const uint8_t* p, float* out) {
    const int nsuper = K / KSUPER, nb = K / KSUB, sub = sub_bytes(format);
    const int record = qmatmul_k_record_bytes(format);
    for (int m = 0; m < MB; m++) {
        for (int col = 0; col < KPANEL; col++) {
            float acc = 0.0f;
            for (int s = 0; s < nsuper; s++) {
                const uint8_t* r = p + (int64_t)s * record;
                const uint8_t* scales = r + 8 * sub;
                uint16_t h;
                memcpy(&h, scales + 16 * KPANEL + 2 * col, sizeof(h));
                const float d = f16_to_f32(h);
                float dmin = 0.0f;
                if (format != Q6_K) {
                    memcpy(&h, scales + 16 * KPANEL + 2 * KPANEL + 2 * col, sizeof(h));
                    dmin = f16_to_f32(h);
                }
                for (int j = 0; j < 8; j++) {
                    const int b = s * 8 + j;
                    const int8_t* xb = xq + (int64_t)m * K + b * KSUB;
                    int32_t half_sums[2] = {0, 0};
                    for (int k = 0; k < KSUB; k++)
                        half_sums[k / 16] += packed_code(format, r + j * sub, col, k) * xb[k];
                    const float dx = xd[m * nb + b];
                    if (format == Q6_K) {
                        const int32_t lo = xlo[m * nb + b], hi = xs[m * nb + b] - lo;
                        const int8_t sa = (int8_t)scales[2 * j * KPANEL + col];
                        const int8_t sb = (int8_t)scales[(2 * j + 1) * KPANEL + col];
                        const int32_t t = sa * (half_sums[0] - 32 * lo) + sb * (half_sums[1] - 32 * hi);
                        acc = __builtin_fmaf((float)t, d * dx, acc);
                    } else {
                        const int32_t sc = scales[j * KPANEL + col], mn = scales[(8 + j) * KPANEL + col];
                        acc = __builtin_fmaf((float)(sc * (half_sums[0] + half_sums[1])), d * dx, acc);
                        acc = __builtin_fmaf((float)(mn * xs[m * nb + b]), -dmin * dx, acc);
                    }
                }
            }
            out[m * KPANEL + col] = acc;
        }
    }
}
#endif

// Prompt rows on AMX tiles (qmatmul_rows_bf16, matmul_amx.c): sub-blocks [b0, b1) of `packed`
// as bf16 weights in gemv.c's packed layout, as qmatmul_dequantize_bf16 gives Q8_0 / Q4_x. A
// panel's sub-blocks of 32 along K are numbered in order, so sub-block b of the weight is
// number b % 8 of record b / 8; each comes out as 16 pair rows [16][32][2]. Each weight is
// gguf's float32 value rounded once to bf16 (to nearest even):
//   Q4_K / Q5_K  (d sc) q - (dmin m): both products exact, and (d sc) q too: one rounding
//   Q6_K         (d sc) (q - 32): d sc exact, one rounding
// (gguf.quants.dequantize's values; llama.cpp's dequantize_row_q*_K give the same.)
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The 16 columns of half h of sub-block j of record r: the codes of pair rows 2g, 2g + 1
// (k = 4g..4g+3) and 8 + 2g, 9 + 2g (k = 16 + 4g..), as qmatmul.c's Q4_x.
static void dequantize_k_half(int format, const uint8_t* r, int j, int h, uint16_t* out) {
    const uint8_t* sub = r + j * sub_bytes(format);
    const uint8_t* scales = r + 8 * sub_bytes(format);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 512 + 32 * h)));
    __m512 da, db, ma = _mm512_setzero_ps(), mb = _mm512_setzero_ps();  // k < 16, k >= 16
    if (format == Q6_K) {
        da = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_to_epi32(scales + 2 * j * KPANEL + 16 * h, 1)));
        db = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(bytes_to_epi32(scales + (2 * j + 1) * KPANEL + 16 * h, 1)));
    } else {
        const __m512 dmin =
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 576 + 32 * h)));
        da = db = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_to_epi32(scales + j * KPANEL + 16 * h, 0)));
        ma = mb = _mm512_mul_ps(
            dmin, _mm512_cvtepi32_ps(bytes_to_epi32(scales + (8 + j) * KPANEL + 16 * h, 0)));
    }
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    const __m512i high = format == Q5_K   ? _mm512_loadu_si512(sub + 512 + 64 * h)
                         : format == Q6_K ? _mm512_loadu_si512(sub + 512 + 128 * h)
                                          : _mm512_setzero_si512();
    const __m512i high2 = format == Q6_K ? _mm512_loadu_si512(sub + 512 + 128 * h + 64) : high;
    uint16_t* o = out + 32 * h;  // pair row i: o + 64 i
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(sub + g * 128 + 64 * h);
        __m512 w[8];
        for (int i = 0; i < 8; i++) {  // w[2b]: code 4g + b (byte b's low nibble); w[2b + 1]: 16 + 4g + b
            __m512i c = _mm512_and_si512(_mm512_srli_epi32(v, 4 * i), nibble);
            const int b = i / 2, upper = i % 2;
            if (format == Q5_K) {  // bit 2g + upper of byte b
                const __m512i bit = _mm512_srli_epi32(high, 8 * b + 2 * g + upper);
                c = _mm512_or_si512(c, _mm512_slli_epi32(_mm512_and_si512(bit, _mm512_set1_epi32(1)), 4));
            } else if (format == Q6_K) {  // plane g / 2, bits 2s, 2s + 1 of byte b, s = 2 (g % 2) + upper
                const __m512i bits = _mm512_srli_epi32(g < 2 ? high : high2, 8 * b + 2 * (2 * (g % 2) + upper));
                c = _mm512_or_si512(c, _mm512_slli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(3)), 4));
            }
            const __m512 u = _mm512_cvtepi32_ps(c);
            w[i] = format == Q6_K ? _mm512_mul_ps(upper ? db : da, _mm512_sub_ps(u, _mm512_set1_ps(32.0f)))
                                  : _mm512_fmsub_ps(upper ? db : da, u, upper ? mb : ma);
        }
        _mm512_storeu_si512(o + 64 * (2 * g), bf16_pair_lanes(w[0], w[2]));
        _mm512_storeu_si512(o + 64 * (2 * g + 1), bf16_pair_lanes(w[4], w[6]));
        _mm512_storeu_si512(o + 64 * (8 + 2 * g), bf16_pair_lanes(w[1], w[3]));
        _mm512_storeu_si512(o + 64 * (9 + 2 * g), bf16_pair_lanes(w[5], w[7]));
    }
}
#endif

// Column c's weight k of sub-block j of record r, as gguf's float32 value (the rules above).
static inline float k_weight(int format, const uint8_t* r, int j, int c, int k) {
    const uint8_t* scales = r + 8 * sub_bytes(format);
    uint16_t h;
    memcpy(&h, scales + 16 * KPANEL + 2 * c, sizeof(h));
    const float d = f16_to_f32(h);
    const int u = packed_code(format, r + j * sub_bytes(format), c, k);
    if (format == Q6_K) {
        const int8_t sc = (int8_t)scales[(2 * j + k / 16) * KPANEL + c];
        return (d * (float)sc) * (float)(u - 32);
    }
    memcpy(&h, scales + 16 * KPANEL + 2 * KPANEL + 2 * c, sizeof(h));
    const float dmin = f16_to_f32(h);
    const float d1 = d * (float)scales[j * KPANEL + c], m1 = dmin * (float)scales[(8 + j) * KPANEL + c];
    return __builtin_fmaf(d1, (float)u, -m1);
}

int qmatmul_k_dequantize_bf16(int format, const uint8_t* packed, int64_t b0, int64_t b1,
                              uint16_t* out) {
    if (format < Q4_K || format > Q6_K || b0 < 0 || b1 < b0) return -1;
    const int record = qmatmul_k_record_bytes(format);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t* r = packed + b / 8 * record;
        const int j = (int)(b % 8);
        uint16_t* ob = out + (b - b0) * KSUB * KPANEL;  // 16 pair rows of 64
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (j == 0)  // the record streams from memory: its lines a record ahead
            for (int line = 0; line < record; line += 64)
                _mm_prefetch((const char*)r + record + line, _MM_HINT_T0);
        dequantize_k_half(format, r, j, 0, ob);
        dequantize_k_half(format, r, j, 1, ob);
#else
        for (int c = 0; c < KPANEL; c++)
            for (int k = 0; k < KSUB; k++)
                ob[(k / 2) * 2 * KPANEL + 2 * c + k % 2] = f32_to_bf16(k_weight(format, r, j, c, k));
#endif
    }
    return 0;
}

// A part's view of its weight's epilogue: its columns shifted by the part's first column.
typedef struct {
    const ColumnEpilogue* whole;
    int first;
} PartEpilogue;

static void part_before(const void* ctx, int t, int nt) {
    const PartEpilogue* e = ctx;
    e->whole->before(e->whole->ctx, t, nt);
}

static void part_after(const void* ctx, int c0, int c1) {
    const PartEpilogue* e = ctx;
    e->whole->after(e->whole->ctx, e->first + c0, e->first + c1);
}

// A fused linear whose row blocks (q | k | v) came in different types, as Q4_K_M files give
// q and k in Q4_K and v in Q6_K: `packed` starts with int64 words [number of parts P, then per
// part its format, its rows and the byte offset of its packed weight from `packed`], and each
// part writes its columns of y. A row's bits are each part's, so still the batch's no concern.
// Each part runs qmatmul_rows_bf16 with `first_prompt` (M: every row a generated token's), or,
// with `then`, qmatmul_bf16_then: its `before` with the first part, its `after` on each part's
// columns.
static int qmatmul_parts_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                              const uint16_t* bias, uint16_t* y_bf16, float* y_f32,
                              int64_t y_stride, int M, int N, int K, int first_prompt,
                              int num_threads, const ColumnEpilogue* then) {
    int64_t header[1 + 3 * 8];
    memcpy(header, packed, sizeof(int64_t));
    const int64_t parts = header[0];
    if (parts < 1 || parts > 8) return -1;
    memcpy(header, packed, (size_t)(1 + 3 * parts) * sizeof(int64_t));
    int64_t n0 = 0;
    for (int64_t i = 0; i < parts; i++) {
        const int64_t format = header[1 + 3 * i], rows = header[2 + 3 * i];
        if (format < 1 || format >= PARTS || rows < 1 || n0 + rows > N) return -1;
        const uint8_t* part_packed = packed + header[3 + 3 * i];
        const uint16_t* part_bias = bias ? bias + n0 : NULL;
        uint16_t* part_bf16 = y_bf16 ? y_bf16 + n0 : NULL;
        float* part_f32 = y_bf16 ? NULL : y_f32 + n0;
        const PartEpilogue part = {then, (int)n0};
        const ColumnEpilogue part_then = {i == 0 && then && then->before ? part_before : NULL,
                                          part_after, &part};
        const int status =
            then ? qmatmul_bf16_then((int)format, x, x_stride, part_packed, part_bias, part_bf16,
                                     part_f32, y_stride, M, (int)rows, K, num_threads, &part_then)
                 : qmatmul_rows_bf16((int)format, x, x_stride, part_packed, part_bias, part_bf16,
                                     part_f32, y_stride, M, (int)rows, K, first_prompt,
                                     num_threads);
        if (status != 0) return status;
        n0 += rows;
    }
    return n0 == N ? 0 : -1;
}

// qmatmul_rows_bf16 (qmatmul.c) for a weight in parts: each part's columns by its own format's
// rows rule.
int qmatmul_parts_rows_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                            const uint16_t* bias, uint16_t* y_bf16, float* y_f32,
                            int64_t y_stride, int M, int N, int K, int first_prompt,
                            int num_threads) {
    return qmatmul_parts_bf16(x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N, K,
                              first_prompt, num_threads, NULL);
}

// qmatmul_bf16's contract (qmatmul.c) for the K-quant formats (K a multiple of 256) and for a
// weight in parts of several formats.
int qmatmul_k_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                   const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                   int N, int K, int num_threads) {
    return qmatmul_k_bf16_then(format, x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N,
                               K, num_threads, NULL);
}

// qmatmul_k_bf16 with `then` (NULL: nothing) in its parallel region, as qmatmul_bf16_then.
int qmatmul_k_bf16_then(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                        const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                        int M, int N, int K, int num_threads, const ColumnEpilogue* then) {
    if (format == PARTS)
        return qmatmul_parts_bf16(x, x_stride, packed, bias, y_bf16, y_f32, y_stride, M, N, K, M,
                                  num_threads, then);
    if (M < 1 || N < 1 || K < KSUPER || K % KSUPER || qmatmul_k_record_bytes(format) < 0) return -1;
    const int nb = K / KSUB, panels = (N + KPANEL - 1) / KPANEL;
    const int64_t panel_bytes = (int64_t)(K / KSUPER) * qmatmul_k_record_bytes(format);
    int8_t* xq = malloc((size_t)M * (size_t)K);
    float* xd = malloc((size_t)M * nb * sizeof(float));
    int32_t* xs = malloc((size_t)M * nb * sizeof(int32_t));
    int32_t* xlo = malloc((size_t)M * nb * sizeof(int32_t));
    if (!xq || !xd || !xs || !xlo) {
        free(xq), free(xd), free(xs), free(xlo);
        return -3;
    }
    const int threads = panels < 2 * num_threads && M < 2 * num_threads ? 1 : num_threads;
    const int groups = (M + KGROUP - 1) / KGROUP;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp for schedule(static) nowait
        for (int m = 0; m < M; m++) {
            int8_t* q = xq + (int64_t)m * K;
            quantize_rows_q8_bf16(x + m * x_stride, x_stride, 1, K, q, xd + (int64_t)m * nb,
                                  xs + (int64_t)m * nb);
            for (int b = 0; b < nb; b++) {  // Q6_K's sums of each block's first 16 codes
                int32_t lo = 0;
                for (int i = 0; i < KSUB / 2; i++) lo += q[b * KSUB + i];
                xlo[(int64_t)m * nb + b] = lo;
            }
        }
        if (then && then->before) then->before(then->ctx, t, nt);
#pragma omp barrier
        float out[KGROUP * KPANEL];
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int pi = p0; pi < p1; pi++) {
            const uint8_t* p = packed + pi * panel_bytes;
            for (int g = 0; g < groups; g++) {
                const int m0 = (int)((int64_t)M * g / groups);
                const int MB = (int)((int64_t)M * (g + 1) / groups) - m0;
                run_kpanel(format, MB, xq + (int64_t)m0 * K, xd + (int64_t)m0 * nb,
                           xs + (int64_t)m0 * nb, xlo + (int64_t)m0 * nb, K, p, out);
                store_panel(out, KPANEL, MB, m0, pi * KPANEL, N, bias, y_bf16, y_f32, y_stride);
            }
        }
        if (then && p1 > p0)
            then->after(then->ctx, p0 * KPANEL, p1 * KPANEL < N ? p1 * KPANEL : N);
    }
    free(xq), free(xd), free(xs), free(xlo);
    return 0;
}
