// A quantized KV row's codes (kv_quant.h) as the bf16 numbers they are, 32 at a time, with
// AVX-512 BW: what the decode kernel's QK reads (paged_decode.c) and what the prefill kernel
// packs after multiplying by the row's scale (prefill_attention.c). Exact: an int8 code or an
// fp8 code's value is a bf16 number (the scale stays aside).
#ifndef QUIRE_KV_CODES_H
#define QUIRE_KV_CODES_H
#include <immintrin.h>
#include <stdint.h>

#include "kv_quant.h"

// bf16 bits of the fp8 values with exponent 0, by mantissa: e4m3 m * 2^-9, e5m2 m * 2^-16.
static const uint16_t E4M3_SUBNORMAL_BF16[32] = {0, 0x3B00, 0x3B80, 0x3BC0,
                                                 0x3C00, 0x3C20, 0x3C40, 0x3C60};
static const uint16_t E5M2_SUBNORMAL_BF16[32] = {0, 0x3780, 0x3800, 0x3840};

// The `sub` table codes_to_bf16 takes for a format (unused for int8).
static inline __attribute__((always_inline)) __m512i subnormal_bf16(int kind) {
    return _mm512_loadu_si512(kind == KV_FP8_E4M3 ? E4M3_SUBNORMAL_BF16 : E5M2_SUBNORMAL_BF16);
}

// 32 fp8 codes at p as 32 bf16 numbers, exactly, in 16-bit lanes (no float arithmetic): a normal
// code's exponent and mantissa bits moved to bf16's and its exponent rebased (+120 for e4m3, +112
// for e5m2); a code with exponent 0 (zero or subnormal) looked up by its mantissa in `sub`; then
// the sign. Codes past the format's max (never written) decode as kv_quant.h's reference does.
static inline __attribute__((always_inline)) __m512i fp8_to_bf16(const int KIND, const char* p,
                                                                 __m512i sub) {
    const int e4m3 = KIND == KV_FP8_E4M3;
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));  // signed
    const __m512i shifted = e4m3 ? _mm512_slli_epi16(w, 4) : _mm512_slli_epi16(w, 5);
    const __m512i normal = _mm512_add_epi16(
        _mm512_and_si512(shifted, _mm512_set1_epi16(e4m3 ? 0x07F0 : 0x0FE0)),
        _mm512_set1_epi16(e4m3 ? 120 << 7 : 112 << 7));
    // Exponent 0: the low 5 bits of w are the mantissa (its upper ones are exponent bits, 0).
    const __mmask32 small = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(e4m3 ? 0x78 : 0x7C));
    const __m512i magnitude = _mm512_mask_permutexvar_epi16(normal, small, w, sub);
    return _mm512_ternarylogic_epi32(magnitude, w, _mm512_set1_epi16((short)0x8000),
                                     0xF8);  // magnitude | (w & sign bit)
}

// 32 codes of format KIND at p as 32 bf16 numbers (`sub`: subnormal_bf16(KIND)).
static inline __attribute__((always_inline)) __m512i codes_to_bf16(const int KIND, const char* p,
                                                                   __m512i sub) {
    if (KIND != KV_INT8) return fp8_to_bf16(KIND, p, sub);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#endif
