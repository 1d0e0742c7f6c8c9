// A quantized KV cache's rows (quire/kernels/kv_format.py): per token and KV head, head_dim
// one-byte codes then that row's float32 scale (little-endian, at byte head_dim), set once when
// the token is written. A code's value is decode(code) * scale:
//   KV_INT8      the code as a signed integer (-127..127), scale = amax / 127
//   KV_FP8_E4M3  an OCP float8 e4m3fn (max 448), scale = amax / 448
//   KV_FP8_E5M2  an OCP float8 e5m2 (max 57344), scale = amax / 57344
// where amax is the row's largest magnitude (a zero row: scale 1, codes 0).
#ifndef QUIRE_KV_QUANT_H
#define QUIRE_KV_QUANT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KV_INT8 1
#define KV_FP8_E4M3 2
#define KV_FP8_E5M2 3
#define KV_SCALE_BYTES 4

static inline float kv_code_max(int kind) {
    return kind == KV_INT8 ? 127.0f : kind == KV_FP8_E4M3 ? 448.0f : 57344.0f;
}

static inline float f32_from_bits(uint32_t u) {
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

// An fp8 code's value, exactly, in integer steps only: a normal code's exponent and mantissa bits
// placed where float32's are, the exponent rebiased by 127 - bias; a subnormal's mantissa m as
// the float m (exact) with its exponent lowered by bias - 1 + mant bits. (A float multiply by
// 2^(127 - bias) did the same, but the library's -ffast-math may fold that constant into the
// row's scale, overflowing float32 from a scale of 2^8 on.)
static inline float fp8_to_f32(uint8_t b, int mant, int bias) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t e = (b & 0x7Fu) >> mant, m = b & ((1u << mant) - 1u);
    if (e) return f32_from_bits(sign | (e + 127u - (uint32_t)bias) << 23 | m << (23 - mant));
    if (!m) return f32_from_bits(sign);
    const float value = (float)m;  // m * 2^(1 - bias - mant)
    uint32_t u;
    memcpy(&u, &value, sizeof(u));
    return f32_from_bits(sign | (u - ((uint32_t)(bias - 1 + mant) << 23)));
}

static inline float fp8_e4m3_to_f32(uint8_t b) { return fp8_to_f32(b, 3, 7); }

static inline float fp8_e5m2_to_f32(uint8_t b) { return fp8_to_f32(b, 2, 15); }

static inline float kv_code_to_f32(int kind, uint8_t b) {
    return kind == KV_INT8 ? (float)(int8_t)b
                           : kind == KV_FP8_E4M3 ? fp8_e4m3_to_f32(b) : fp8_e5m2_to_f32(b);
}

// |y| <= the format's max, to the nearest fp8 code (ties to even): below the smallest normal
// the subnormal step is exact in float32; above it the float32 mantissa is rounded to
// `mant` bits, a carry moving into the exponent as in IEEE.
static inline uint8_t f32_to_fp8(float y, int mant, int bias, uint8_t max_code) {
    const uint8_t sign = y < 0.0f ? 0x80u : 0u;
    const float a = fabsf(y);
    uint32_t code;
    if (a < ldexpf(1.0f, 1 - bias)) {
        code = (uint32_t)nearbyintf(ldexpf(a, bias - 1 + mant));  // 2^mant: the smallest normal
    } else {
        uint32_t u;
        memcpy(&u, &a, sizeof(u));
        const int shift = 23 - mant;
        u += (1u << (shift - 1)) - 1u + ((u >> shift) & 1u);
        code = (u >> shift) - ((uint32_t)(127 - bias) << mant);
    }
    return sign | (uint8_t)(code < max_code ? code : max_code);
}

static inline uint8_t kv_f32_to_code(int kind, float y) {
    if (kind == KV_INT8) {
        const float r = nearbyintf(y);
        return (uint8_t)(int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return kind == KV_FP8_E4M3 ? f32_to_fp8(y, 3, 7, 0x7E) : f32_to_fp8(y, 2, 15, 0x7B);
}

static inline float kv_row_scale(const uint8_t* row, int head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof(s));
    return s;
}

// dst[d] = the row's value d, as float32 (decode(code) * scale).
static inline void kv_dequant_row(int kind, const uint8_t* row, int head_dim, float* dst) {
    const float s = kv_row_scale(row, head_dim);
    for (int d = 0; d < head_dim; d++) dst[d] = kv_code_to_f32(kind, row[d]) * s;
}

#endif
