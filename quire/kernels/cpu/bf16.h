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

// Rows m0..m0+MB-1 of one panel's result (columns n0.. of N), from the float32 sums
// out [MB][panel]: + bias, rounded to bf16 into y_bf16, or (y_bf16 NULL) into y_f32 as the
// bf16-rounded value widened, as `linear(...).float()` gives it.
static inline void store_panel(const float* out, int panel, int MB, int m0, int n0, int N,
                               const uint16_t* bias, uint16_t* y_bf16, float* y_f32,
                               int64_t y_stride) {
    const int cols = N - n0 < panel ? N - n0 : panel;
    for (int m = 0; m < MB; m++) {
        for (int i = 0; i < cols; i++) {
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
