// Paged decode attention for CPUs: one query token per request, K/V read once through the block
// table (no gathered copy), all query heads of a KV head (the GQA group) served by one read,
// online softmax one KV block at a time, float32 accumulation. OpenMP over requests (or over
// (request, KV head) when there are too few requests for the threads).
//
// Layouts (row-major):
//   q, out       [num_seqs, num_heads, head_dim]
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32
#include <math.h>
#include <stdint.h>

#define MAX_HEADS 64
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
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1; \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t block_stride = token_stride * block_size;                                        \
    /* A task is one request and a range of its KV heads: all of them when there are enough      \
       requests to keep the threads busy (each block is then read once, contiguously), one KV     \
       head per task otherwise. */                                                                 \
    const int heads_per_task = num_seqs >= 2 * num_threads ? num_kv_heads : 1;                    \
    const int tasks_per_seq = num_kv_heads / heads_per_task;                                       \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                      \
    for (int task = 0; task < num_seqs * tasks_per_seq; task++) {                                  \
        const int s = task / tasks_per_seq;                                                        \
        const int kvh0 = (task % tasks_per_seq) * heads_per_task;                                  \
        const int h0 = kvh0 * group, nh = heads_per_task * group;                                  \
        float qf[MAX_HEADS][MAX_HEAD_DIM];                                                         \
        float acc[MAX_HEADS][MAX_HEAD_DIM];                                                        \
        float scores[MAX_HEADS][MAX_BLOCK_SIZE];                                                   \
        float kf[MAX_HEAD_DIM];                                                                    \
        float running_max[MAX_HEADS], running_sum[MAX_HEADS];                                      \
        const T* q_row = q + ((int64_t)s * num_heads + h0) * head_dim;                             \
        for (int h = 0; h < nh; h++) {                                                             \
            for (int d = 0; d < head_dim; d++) {                                                   \
                qf[h][d] = LOAD(q_row[h * head_dim + d]) * scale;                                  \
                acc[h][d] = 0.0f;                                                                  \
            }                                                                                      \
            running_max[h] = -1e30f;                                                               \
            running_sum[h] = 0.0f;                                                                 \
        }                                                                                          \
        const int len = seq_lens[s];                                                               \
        const int32_t* table = block_tables + (int64_t)s * max_blocks;                             \
        for (int start = 0; start < len; start += block_size) {                                    \
            const int n = len - start < block_size ? len - start : block_size;                     \
            const int64_t base = (int64_t)table[start / block_size] * block_stride;                \
            for (int t = 0; t < n; t++) {                                                          \
                const T* k_tok = k_cache + base + t * token_stride;                                \
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {                         \
                    const T* k_row = k_tok + (int64_t)kvh * head_dim;                              \
                    for (int d = 0; d < head_dim; d++) kf[d] = LOAD(k_row[d]);                     \
                    for (int j = 0; j < group; j++) {                                              \
                        const int h = (kvh - kvh0) * group + j;                                    \
                        float dot = 0.0f;                                                          \
                        for (int d = 0; d < head_dim; d++) dot += qf[h][d] * kf[d];                \
                        scores[h][t] = dot;                                                        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int h = 0; h < nh; h++) {                                                         \
                float block_max = running_max[h];                                                  \
                for (int t = 0; t < n; t++)                                                        \
                    block_max = scores[h][t] > block_max ? scores[h][t] : block_max;               \
                const float correction = expf(running_max[h] - block_max);                         \
                running_sum[h] *= correction;                                                      \
                for (int d = 0; d < head_dim; d++) acc[h][d] *= correction;                        \
                for (int t = 0; t < n; t++) {                                                      \
                    scores[h][t] = expf(scores[h][t] - block_max);                                 \
                    running_sum[h] += scores[h][t];                                                \
                }                                                                                  \
                running_max[h] = block_max;                                                        \
            }                                                                                      \
            for (int t = 0; t < n; t++) {                                                          \
                const T* v_tok = v_cache + base + t * token_stride;                                \
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {                         \
                    const T* v_row = v_tok + (int64_t)kvh * head_dim;                              \
                    for (int d = 0; d < head_dim; d++) kf[d] = LOAD(v_row[d]);                     \
                    for (int j = 0; j < group; j++) {                                              \
                        const int h = (kvh - kvh0) * group + j;                                    \
                        const float p = scores[h][t];                                              \
                        for (int d = 0; d < head_dim; d++) acc[h][d] += p * kf[d];                 \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        T* out_row = out + ((int64_t)s * num_heads + h0) * head_dim;                               \
        for (int h = 0; h < nh; h++) {                                                             \
            const float inv = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;                \
            for (int d = 0; d < head_dim; d++) out_row[h * head_dim + d] = STORE(acc[h][d] * inv); \
        }                                                                                          \
    }                                                                                              \
    return 0;                                                                                      \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)
