// Paged decode attention for CPUs: one query token per request, K/V read once through the block
// table (no gathered copy), all query heads of a KV head (the GQA group) served by one read,
// online softmax one KV block at a time, float32 accumulation. OpenMP over (request, KV head).
//
// Layouts (row-major):
//   q, out       [num_seqs, num_heads, head_dim]
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

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

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                  \
int NAME(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,             \
         const int32_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads,          \
         int head_dim, int block_size, int max_blocks, float scale, int num_threads) {             \
    const int group = num_heads / num_kv_heads;                                                    \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1;   \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t block_stride = token_stride * block_size;                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")          \
    for (int s = 0; s < num_seqs; s++) {                                                           \
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                             \
            float qf[MAX_GROUP][MAX_HEAD_DIM];                                                     \
            float acc[MAX_GROUP][MAX_HEAD_DIM];                                                    \
            float scores[MAX_GROUP][MAX_BLOCK_SIZE];                                               \
            float running_max[MAX_GROUP], running_sum[MAX_GROUP];                                  \
            const T* q_row = q + ((int64_t)s * num_heads + (int64_t)kvh * group) * head_dim;       \
            for (int j = 0; j < group; j++) {                                                      \
                for (int d = 0; d < head_dim; d++) {                                               \
                    qf[j][d] = LOAD(q_row[j * head_dim + d]) * scale;                              \
                    acc[j][d] = 0.0f;                                                              \
                }                                                                                  \
                running_max[j] = -1e30f;                                                           \
                running_sum[j] = 0.0f;                                                             \
            }                                                                                      \
            const int len = seq_lens[s];                                                           \
            const int32_t* table = block_tables + (int64_t)s * max_blocks;                         \
            for (int start = 0; start < len; start += block_size) {                                \
                const int n = len - start < block_size ? len - start : block_size;                 \
                const int64_t base = (int64_t)table[start / block_size] * block_stride             \
                                     + (int64_t)kvh * head_dim;                                    \
                const T* kb = k_cache + base;                                                      \
                const T* vb = v_cache + base;                                                      \
                for (int t = 0; t < n; t++) {                                                      \
                    const T* k_row = kb + t * token_stride;                                        \
                    for (int j = 0; j < group; j++) {                                              \
                        float dot = 0.0f;                                                          \
                        for (int d = 0; d < head_dim; d++) dot += qf[j][d] * LOAD(k_row[d]);       \
                        scores[j][t] = dot;                                                        \
                    }                                                                              \
                }                                                                                  \
                for (int j = 0; j < group; j++) {                                                  \
                    float block_max = running_max[j];                                              \
                    for (int t = 0; t < n; t++)                                                    \
                        block_max = scores[j][t] > block_max ? scores[j][t] : block_max;           \
                    const float correction = expf(running_max[j] - block_max);                     \
                    running_sum[j] *= correction;                                                  \
                    for (int d = 0; d < head_dim; d++) acc[j][d] *= correction;                    \
                    for (int t = 0; t < n; t++) {                                                  \
                        scores[j][t] = expf(scores[j][t] - block_max);                             \
                        running_sum[j] += scores[j][t];                                            \
                    }                                                                              \
                    running_max[j] = block_max;                                                    \
                }                                                                                  \
                for (int t = 0; t < n; t++) {                                                      \
                    const T* v_row = vb + t * token_stride;                                        \
                    for (int j = 0; j < group; j++) {                                              \
                        const float p = scores[j][t];                                              \
                        for (int d = 0; d < head_dim; d++) acc[j][d] += p * LOAD(v_row[d]);        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            T* out_row = out + ((int64_t)s * num_heads + (int64_t)kvh * group) * head_dim;         \
            for (int j = 0; j < group; j++) {                                                      \
                const float inv = running_sum[j] > 0.0f ? 1.0f / running_sum[j] : 0.0f;            \
                for (int d = 0; d < head_dim; d++) out_row[j * head_dim + d] = STORE(acc[j][d] * inv); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    return 0;                                                                                      \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)
