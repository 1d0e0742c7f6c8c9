// bfloat16 <-> float32 for the portable C paths of the CPU kernels.
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

#endif
