// bfloat16 <-> float32 (and float16 -> float32) for the portable C paths of the CPU kernels,
// and the bf16 store of a matmul panel's float32 sums.
#ifndef QUIRE_BF16_H
#define QUIRE_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);  // round to nearest even
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 bf16 values widened to float32 (exactly).
static inline __m512 widen_16(const uint16_t* x) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

// 16 float32 sums (+ bias) rounded to bf16 as f32_to_bf16 rounds, into y_bf16, or widened back
// into y_f32.
static inline void store_16(const float* sums, const uint16_t* bias, uint16_t* y_bf16,
                            float* y_f32) {
    __m512 v = _mm512_loadu_ps(sums);
    if (bias) v = _mm512_add_ps(v, widen_16(bias));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    if (y_bf16)
        _mm256_storeu_si256((__m256i*)y_bf16, _mm512_cvtepi32_epi16(r));
    else
        _mm512_storeu_ps(y_f32, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 columns' float32 weights k (wa) and k + 1 (wb), each rounded to bf16 (to nearest even), as
// int32 lanes of bf16 pairs: lane j holds column j's (k, k + 1), gemv.c's packed pair layout.
static inline __m512i bf16_pair_lanes(__m512 wa, __m512 wb) {
    // [wa 0..15 | wb 0..15] as bf16, then interleaved: lane 2j takes wa j, lane 2j + 1 wb j
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(wb, wa));
}
#endif

// Rows m0..m0+MB-1 of one panel's result (columns n0.. of N), from the float32 sums
// out [MB][panel]: + bias, rounded to bf16 into y_bf16, or (y_bf16 NULL) into y_f32 as the
// bf16-rounded value widened, as `linear(...).float()` gives it.
static inline void store_panel(const float* out, int panel, int MB, int m0, int n0, int N,
                               const uint16_t* bias, uint16_t* y_bf16, float* y_f32,
                               int64_t y_stride) {
    const int cols = N - n0 < panel ? N - n0 : panel;
    for (int m = 0; m < MB; m++) {
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= cols; i += 16) {
            const int64_t at = (int64_t)(m0 + m) * y_stride + n0 + i;
            store_16(out + m * panel + i, bias ? bias + n0 + i : NULL, y_bf16 ? y_bf16 + at : NULL,
                     y_bf16 ? NULL : y_f32 + at);
        }
#endif
        for (; i < cols; i++) {
            float v = out[m * panel + i];
            if (bias) v += bf16_to_f32(bias[n0 + i]);
            const int64_t at = (int64_t)(m0 + m) * y_stride + n0 + i;
            if (y_bf16)
                y_bf16[at] = f32_to_bf16(v);
            else
                y_f32[at] = bf16_to_f32(f32_to_bf16(v));
        }
    }
}

// IEEE half precision (GGUF's block scales) to float32, exactly: normals, subnormals, inf/NaN.
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1F) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

#endif
