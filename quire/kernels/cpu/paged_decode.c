// Paged decode attention for CPUs: one query token per request, K/V read once through the block
// table (no gathered copy), all query heads of a KV head (the GQA group) served by one read,
// online softmax, float32 accumulation. OpenMP over requests (or over (request, range of KV
// heads) when there are too few requests for the threads).
//
// Layouts (row-major):
//   q, out       [num_seqs, num_heads, head_dim]
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32
//
// Three implementations with the same semantics: portable C (float32 always, and bfloat16 where
// no SIMD path is compiled in or takes the shape), an AVX-512 BF16 path for bfloat16 with
// head_dim a multiple of 32, and an AVX2 path for a bf16 cache with head_dim a multiple of 16
// (see below); the two SIMD paths share their task split and partitions.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "kv_quant.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

// A task is one request and a range of its KV heads: all of them when there are enough requests
// to keep the threads busy (each block is then read once, contiguously), otherwise the widest
// range (dividing num_kv_heads) that still gives at least 2 tasks per thread. Every KV head is
// computed the same way whichever range it falls in, so the results do not depend on the split.
static inline int kv_heads_per_task(int num_seqs, int num_kv_heads, int num_threads) {
    int heads = num_kv_heads;
    while (heads > 1 &&
           (num_kv_heads % heads || num_seqs * (num_kv_heads / heads) < 2 * num_threads))
        heads--;
    return heads;
}

// Portable C, instantiated below for bfloat16 and float32 queries and caches, and for bfloat16
// queries over the quantized caches of kv_quant.h: KT is the cache's element, ROW(head_dim) the
// elements of one token's row per KV head, LOAD_ROW(dst, row, head_dim) its float32 values.
#define DEFINE_PAGED_DECODE(LINKAGE, NAME, T, KT, ROW, LOAD, STORE, LOAD_ROW)                      \
LINKAGE                                                                                            \
int NAME(const T* q, const KT* k_cache, const KT* v_cache, const int32_t* block_tables,           \
         const int32_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads,          \
         int head_dim, int block_size, int max_blocks, float scale, int num_threads) {             \
    const int group = num_heads / num_kv_heads;                                                    \
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1; \
    const int64_t row = ROW(head_dim);                                                             \
    const int64_t token_stride = (int64_t)num_kv_heads * row;                                      \
    const int64_t block_stride = token_stride * block_size;                                        \
    const int heads_per_task = kv_heads_per_task(num_seqs, num_kv_heads, num_threads);             \
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
                const KT* k_tok = k_cache + base + t * token_stride;                               \
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {                         \
                    LOAD_ROW(kf, k_tok + kvh * row, head_dim);                                     \
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
                const KT* v_tok = v_cache + base + t * token_stride;                               \
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {                         \
                    LOAD_ROW(kf, v_tok + kvh * row, head_dim);                                     \
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGED_DECODE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGED_DECODE_AVX2 1
#endif

#if defined(PAGED_DECODE_AVX512) || defined(PAGED_DECODE_AVX2)
// ---------------------------------------------------------------------------------------------
// What the SIMD paths share: a task's context walked in chunks of CHUNK positions, their rows
// found through the block table, long contexts cut into partitions, and the partitions' merge.
#include <immintrin.h>

#define CHUNK 16           // context positions per step: a zmm register's lanes, or two ymm's
#define PREFETCH_CHUNKS 3  // how far ahead K/V rows are prefetched
#define OFFSET_RING 4      // chunks whose row offsets are kept
_Static_assert(OFFSET_RING > PREFETCH_CHUNKS, "chunks c and c + PREFETCH_CHUNKS are both in use");

// How PV reads value rows: bf16 (0), int8 codes (KV_INT8), or fp8 codes as float32 bit patterns
// that are the code's value times 2^-120 (e4m3) or 2^-112 (e5m2), exactly (a subnormal code gives
// a float32 denormal), the factor 2^120 / 2^112 being in the weights p instead (*_RAW, when the
// row scales allow it, see pv_weights) or multiplied in per code (KV_FP8_E4M3, KV_FP8_E5M2).
#define PV_E4M3_RAW (KV_FP8_E5M2 + 1)
#define PV_E5M2_RAW (KV_FP8_E5M2 + 2)

// Whether the fp8 factor goes into the PV weights (a *_RAW kind) for a chunk whose largest value
// row scale is max_scale: when p * scale * 2^120 (or 2^112) cannot overflow, p <= 1 (every scale
// below 2^8 or 2^16, values up to 114688 or ~3.8e9). Returns how PV reads the rows, and the
// factor's exponent in *rebias (0: none).
static inline int pv_kind_for(int kind, float max_scale, float* rebias) {
    *rebias = 0.0f;
    if (kind == KV_FP8_E4M3 && max_scale < 0x1p8f) return *rebias = 120.0f, PV_E4M3_RAW;
    if (kind == KV_FP8_E5M2 && max_scale < 0x1p16f) return *rebias = 112.0f, PV_E5M2_RAW;
    return kind;
}

// Prefetches `lines` 64-byte lines from each of pk + pf_off[t] and pv + pf_off[t], t < n
// (into L2: on the hosts measured, L1 or L2 made no difference or favoured L2).
static inline __attribute__((always_inline)) void prefetch_rows(const char* pk, const char* pv,
                                                                const int64_t* pf_off, int n,
                                                                int lines) {
    for (int t = 0; t < n; t++)
        for (int i = 0; i < lines; i++) {
            _mm_prefetch(pk + pf_off[t] + 64 * i, _MM_HINT_T1);
            _mm_prefetch(pv + pf_off[t] + 64 * i, _MM_HINT_T1);
        }
}

// The scales of the CHUNK rows at byte offsets off[0..CHUNK) from base (a quantized row's scale
// is at byte head_dim), into s.
static inline void chunk_scales(const char* base, const int64_t* off, int head_dim, float* s) {
    for (int t = 0; t < CHUNK; t++) memcpy(s + t, base + off[t] + head_dim, sizeof(float));
}

static inline int min_int(int a, int b) { return a < b ? a : b; }

// chunk, found through the block table in order and kept for the last OFFSET_RING chunks.
// Positions past the end of the context get the offset of the chunk's first row, so that the
// 16 rows QK reads are all inside the cache.
typedef struct {
    const int32_t* table;
    int block_size, len;
    int64_t block_stride, token_stride;
    int located;          // chunks located so far
    int block, in_block;  // where chunk `located` starts
    int64_t off[OFFSET_RING][CHUNK];
} RowLocator;

static inline const int64_t* chunk_rows(RowLocator* r, int c) {
    for (; r->located <= c; r->located++) {
        int64_t* off = r->off[r->located % OFFSET_RING];
        const int n = min_int(r->len - r->located * CHUNK, CHUNK);
        for (int t = 0; t < n; t++) {
            off[t] = (int64_t)r->table[r->block] * r->block_stride + r->in_block * r->token_stride;
            if (++r->in_block == r->block_size) r->in_block = 0, r->block++;
        }
        for (int t = n; t < CHUNK; t++) off[t] = off[0];
    }
    return r->off[c % OFFSET_RING];
}

// One head's output from its accumulator a (per slice of `slice` dims, 32 or 16: its even dims,
// then its odd ones): a * inv, rounded to bf16, in natural order.
static inline void store_head(uint16_t* o, const float* a, int head_dim, float inv, int slice) {
    const int half = slice / 2;
    for (int d = 0; d < head_dim; d += slice)
        for (int i = 0; i < half; i++) {
            o[d + 2 * i] = f32_to_bf16(a[d + i] * inv);
            o[d + 2 * i + 1] = f32_to_bf16(a[d + half + i] * inv);
        }
}

// The context of a request is cut into partitions of at most PARTITION positions, each a task of
// its own (with a range of KV heads), so that a few requests with long contexts still keep every
// thread busy (batch 1 of a model with 3 KV heads would otherwise be 3 tasks on 2 threads). The
// partitions share the context's chunks equally: 530 positions are two of 272 and 258, not 512
// and 18, whose tasks the threads could not share evenly (batch 1, ~530 positions: 0.83-0.90x
// the time at SmolLM2's and Qwen3-0.6B's shapes, Intel Xeon AMX). A request with more than one
// partition has its partial results (unnormalized accumulator, running max and sum per query
// head) merged in partition order by whichever task finishes the request's last partition: no
// second parallel region, and no heap for up to SCRATCH_ON_STACK bytes of partials (batch 1: 26
// against 29.5 us a call at SmolLM2's shape, context 618, bits unchanged). Partitions depend only
// on the context length, so a request's result does not depend on the batch or on the thread
// count.
#define PARTITION 512
#define SCRATCH_ON_STACK 16384  // bytes of partial results and task lists kept off the heap
_Static_assert(PARTITION % CHUNK == 0, "a partition is whole chunks");

// Partitions of a context of `len` positions (an empty context is one empty partition).
static inline int num_partitions(int len) {
    return len > PARTITION ? (len + PARTITION - 1) / PARTITION : 1;
}

// Chunks of each partition of a context of `len` positions (the last one may hold fewer).
static inline int partition_chunks(int len) {
    const int chunks = (len + CHUNK - 1) / CHUNK, parts = num_partitions(len);
    return (chunks + parts - 1) / parts;
}

// A call's units of work, (request, partition), and its scratch: per unit its request and
// partition; the partial results of the units of split requests ([unit][num_heads][head_dim + 2]
// floats: the accumulator, then the running max and the sum); per (request, task's KV heads),
// how many of its partitions are done (the task that finishes the last one merges them). One
// buffer for all of it, on the caller's stack (SCRATCH_ON_STACK bytes) for a few requests
// (batch 1 of a long context).
typedef struct {
    int num_units, heads_per_task, tasks_per_unit;
    int64_t partial_stride;
    float* partial;
    int* unit_seq;
    int* unit_part;
    int* done;
    char* heap;  // the buffer when it is not on the stack (free it), else NULL
} CallPlan;

// 0, or -3 when the buffer cannot be allocated.
static int plan_call(CallPlan* plan, char* stack_buffer, const int32_t* seq_lens, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int num_threads) {
    int num_units = 0;
    for (int s = 0; s < num_seqs; s++) num_units += num_partitions(seq_lens[s]);
    plan->num_units = num_units;
    plan->heads_per_task = kv_heads_per_task(num_units, num_kv_heads, num_threads);
    plan->tasks_per_unit = num_kv_heads / plan->heads_per_task;
    const int split = num_units > num_seqs;  // some request has more than one partition
    plan->partial_stride = (int64_t)num_heads * (head_dim + 2);
    const size_t unit_bytes = sizeof(int) * 2 * (size_t)num_units;
    const size_t done_bytes = split ? sizeof(int) * (size_t)num_seqs * plan->tasks_per_unit : 0;
    const size_t partial_bytes =
        split ? sizeof(float) * (size_t)(num_units * plan->partial_stride) : 0;
    const size_t bytes = partial_bytes + unit_bytes + done_bytes;  // floats first: aligned
    plan->heap = NULL;
    char* buffer = stack_buffer;
    if (bytes > SCRATCH_ON_STACK && !(buffer = plan->heap = malloc(bytes))) return -3;
    plan->partial = (float*)buffer;
    plan->unit_seq = (int*)(buffer + partial_bytes);
    plan->unit_part = plan->unit_seq + num_units;
    plan->done = plan->unit_part + num_units;
    for (int s = 0, u = 0; s < num_seqs; s++) {
        const int parts = num_partitions(seq_lens[s]);
        for (int part = 0; part < parts; part++, u++)
            plan->unit_seq[u] = s, plan->unit_part[u] = part;
    }
    if (split) memset(plan->done, 0, done_bytes);
    return 0;
}

// Merges the partitions of one request for query heads h0..h0+nh: partial holds its first
// partition's rows ([num_heads][head_dim + 2] each, partial_stride apart). Each head's partitions
// are rescaled to their largest max and summed in partition order; out points at head h0. The
// accumulators' layout: store_head's, by `slice`.
static void merge_partitions(const float* partial, int64_t partial_stride, int parts,
                             uint16_t* out, int h0, int nh, int head_dim, int slice) {
    for (int h = h0; h < h0 + nh; h++) {
        float a[MAX_HEAD_DIM];
        float m = -1e30f, total = 0.0f;
        for (int i = 0; i < parts; i++) {
            const float* row = partial + i * partial_stride + (int64_t)h * (head_dim + 2);
            m = row[head_dim] > m ? row[head_dim] : m;
        }
        for (int d = 0; d < head_dim; d++) a[d] = 0.0f;
        for (int i = 0; i < parts; i++) {
            const float* row = partial + i * partial_stride + (int64_t)h * (head_dim + 2);
            const float w = expf(row[head_dim] - m);
            total += w * row[head_dim + 1];
            for (int d = 0; d < head_dim; d++) a[d] += w * row[d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        store_head(out + (int64_t)(h - h0) * head_dim, a, head_dim, inv, slice);
    }
}

// What every task of one call shares.
typedef struct {
    const int32_t* block_tables;
    const int32_t* seq_lens;
    const int* unit_seq;  // per unit (request, partition): its request and partition
    const int* unit_part;
    const char* k_cache;
    const char* v_cache;
    int64_t block_stride, token_stride, row_bytes;  // bytes
    int max_blocks, block_size, head_dim, tasks_per_unit, heads_per_task;
} CallShape;

// One task: a partition [c0, c1) of a request's chunks and a range of its KV heads, with its
// row offsets and the K/V rows of its first KV head (where its prefetches start).
typedef struct {
    int u, s, part, kvh0, len, c0, c1;
    RowLocator rows;
    const char* pk;
    const char* pv;
} TaskSpan;

static inline void task_span(const CallShape* cs, int task, TaskSpan* t) {
    t->u = task / cs->tasks_per_unit;
    t->s = cs->unit_seq[t->u];
    t->part = cs->unit_part[t->u];
    t->kvh0 = (task % cs->tasks_per_unit) * cs->heads_per_task;
    t->len = cs->seq_lens[t->s];
    const int part_chunks = partition_chunks(t->len);
    t->c0 = t->part * part_chunks;
    t->c1 = min_int((t->len + CHUNK - 1) / CHUNK, t->c0 + part_chunks);
    t->rows = (RowLocator){.table = cs->block_tables + (int64_t)t->s * cs->max_blocks,
                           .block_size = cs->block_size, .len = t->len,
                           .block_stride = cs->block_stride, .token_stride = cs->token_stride,
                           .located = t->c0, .block = t->c0 * CHUNK / cs->block_size,
                           .in_block = t->c0 * CHUNK % cs->block_size};
    t->pk = cs->k_cache + t->kvh0 * cs->row_bytes;
    t->pv = cs->v_cache + t->kvh0 * cs->row_bytes;
}
#endif

#if defined(PAGED_DECODE_AVX512)
// ---------------------------------------------------------------------------------------------
// AVX-512 BF16 path (bfloat16, head_dim a multiple of 32).
//
// A task walks its request's context in chunks of CHUNK = 16 positions (one score per lane of a
// zmm register). The element offsets of a chunk's 16 token rows are found through the block
// table once (RowLocator; a chunk may span blocks, so any block_size works). Then, for each KV
// head of the task (a unit of work: one chunk x one KV head):
//   QK   for each query head of the group: vdpbf16ps multiplies the bf16 query by each bf16 key
//        row directly, pairwise into 16 float32 lanes, one partial-sum vector per token; a
//        transpose-add tree turns the 16 vectors into one vector of 16 scores, then scaled;
//   softmax  online, per query head: the chunk's max; when it exceeds the running max, the
//        correction exp(old max - new max) for the running sum and the accumulator; the 16
//        numerators exp(score - max) at once (exp512). The running sum is kept per lane (a
//        vector) and reduced at the end;
//   PV   each V row (32 bf16 per zmm) is widened to float32 once per register tile and FMA'd
//        into the float32 accumulators of up to 4 query heads x 64 dims held in registers
//        (the tile), loaded from and stored back to the task's accumulator array once per unit.
// Lanes past the end of the context read the chunk's first row again; their scores are masked
// to -1e30 and their numerators to 0, and PV stops at the last token.
// Prefetch: the rows of chunk c + PREFETCH_CHUNKS are prefetched while chunk c runs, in address
// order (per token, the task's KV heads are one contiguous range), a few tokens in each QK call so
// that the requests are spread evenly over the computation; past a task's last chunk, the first
// chunks of the task its thread runs next (each thread claims the task after its own when it starts
// one, so the tasks still go to whichever thread is free, in order): a batch-32 decode step 0.946x,
// batch 8 0.961x, batch 1 level. Into L2 (T1), not L1: on an AMD EPYC (Zen 4) here, a batch-32
// SmolLM2 decode step spent 20.8 ms in this kernel against 30.2 with T0 (0.85x the step time), and
// the kernel alone ran 1.04-1.36x faster at SmolLM2's and Qwen3-0.6B's shapes, batch 1 to 32; on
// the Zen 5 host of an earlier session L2 prefetches were no better than L1 ones.
//
// bf16 -> f32 without a shuffle: a 32-bit lane holds the bf16 pair (2i, 2i+1); shifting it left
// by 16 gives element 2i as a float, masking off the low half gives element 2i+1. So for each
// 32-dim slice of head_dim the accumulator holds the 16 even dims, then the 16 odd dims; the
// output is written back in natural order at the end.
#include "kv_codes.h"
#include "vec_math.h"

#define PV_TILE_HEADS 4    // query heads per PV register tile
#define PV_TILE_SLICES 2   // 32-dim slices per PV tile (4 x 2 x 2 = 16 zmm accumulators)

// Lane t of the result = sum of the 16 lanes of v[t]: pairs of vectors are interleaved and
// added (unpack ps, unpack pd, then 128-bit lane shuffles twice), halving the count each level.
static inline __m512 transpose_sum16(const __m512 v[CHUNK]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  // 128-bit lane: [v2i, v2i+1, v2i, v2i+1]
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // 128-bit lane: [v4i, ..., v4i+3]
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  // 128-bit lanes: [v8i..8i+3, v8i..8i+3, v8i+4..8i+7, ditto]
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// A 32-dim slice of a quantized row (32 one-byte codes at p, kv_quant.h) as float32 in the bf16
// path's order: *even the 16 even dims, *odd the 16 odd ones (see PV_E4M3_RAW for fp8). Each code
// is sign-extended to 16 bits, so a 32-bit lane holds codes (2i, 2i+1); int8 converts, fp8
// places its sign, exponent and mantissa bits where float32's are.
static inline __attribute__((always_inline)) void widen_codes(const int KIND, const char* p,
                                                              __m512* even, __m512* odd) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
    if (KIND == KV_INT8) {
        *even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16));
        *odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16));
        return;
    }
    const int e4m3 = KIND == KV_FP8_E4M3 || KIND == PV_E4M3_RAW;
    const __m512i mask = _mm512_set1_epi32(e4m3 ? (int)0x87F00000u : (int)0x8FE00000u);
    const __m512i e = e4m3 ? _mm512_slli_epi32(w, 20) : _mm512_slli_epi32(w, 21);
    const __m512i o = e4m3 ? _mm512_slli_epi32(w, 4) : _mm512_slli_epi32(w, 5);
    *even = _mm512_castsi512_ps(_mm512_and_si512(e, mask));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(o, mask));
    if (KIND == KV_FP8_E4M3 || KIND == KV_FP8_E5M2) {
        const __m512 bias = _mm512_set1_ps(e4m3 ? 0x1p120f : 0x1p112f);
        *even = _mm512_mul_ps(*even, bias);
        *odd = _mm512_mul_ps(*odd, bias);
    }
}

// The scales of the 16 rows at byte offsets off[0..16) from base (a quantized row's scale is
// at byte head_dim).
static inline __attribute__((always_inline)) __m512 row_scales(const char* base,
                                                               const int64_t* off, int head_dim) {
    float s[CHUNK] __attribute__((aligned(64)));
    chunk_scales(base, off, head_dim, s);
    return _mm512_load_ps(s);
}

// The 16 unscaled scores q . k_t of one query head, for the bf16 key rows at byte offsets
// off[0..16) from k, with prefetch_rows(pk, pv, pf_off, npf, pf_lines) issued halfway. ND =
// head_dim / 32 (a constant where inlined, so the query and the 16 partial sums stay in
// registers and every loop unrolls).
static inline __attribute__((always_inline)) __m512 qk16(const int ND, const uint16_t* q_row,
                                                         const char* k, const int64_t* off,
                                                         const char* pk, const char* pv,
                                                         const int64_t* pf_off, int npf,
                                                         int pf_lines) {
    __m512bh qv[MAX_HEAD_DIM / 32];
    for (int i = 0; i < ND; i++) qv[i] = (__m512bh)_mm512_loadu_si512(q_row + 32 * i);
    __m512 part[CHUNK];
#pragma GCC unroll 16
    for (int t = 0; t < CHUNK; t++) {
        __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < ND; i++)
            a = _mm512_dpbf16_ps(a, qv[i], (__m512bh)_mm512_loadu_si512(k + off[t] + 64 * i));
        part[t] = a;
        if (t == CHUNK / 2 - 1) prefetch_rows(pk, pv, pf_off, npf, pf_lines);
    }
    return transpose_sum16(part);
}

// qk16 for any ND. Not inlined: inside the task loop gcc would keep the partial sums in memory.
static __attribute__((noinline)) __m512 qk_scores(int nd, const uint16_t* q_row, const char* k,
                                                  const int64_t* off, const char* pk,
                                                  const char* pv, const int64_t* pf_off, int npf,
                                                  int pf_lines) {
#define QK_CASE(ND) \
    case ND: return qk16(ND, q_row, k, off, pk, pv, pf_off, npf, pf_lines);
    switch (nd) {
        QK_CASE(1) QK_CASE(2) QK_CASE(3) QK_CASE(4) QK_CASE(5) QK_CASE(6) QK_CASE(7)
        default: return qk16(8, q_row, k, off, pk, pv, pf_off, npf, pf_lines);
    }
#undef QK_CASE
}

// A chunk's 16 quantized key rows (byte offsets off[t] from k) as bf16 rows of head_dim in
// kb, exactly (an int8 or fp8 code is a bf16 number; the scales stay aside), so that QK runs
// as for a bf16 cache, once per query head of the group, over a 16 x head_dim tile in L1.
static inline __attribute__((always_inline)) void keys_tile(const int KIND, const char* k,
                                                            const int64_t* off, int head_dim,
                                                            uint16_t* kb) {
    const __m512i sub = subnormal_bf16(KIND);
    for (int t = 0; t < CHUNK; t++)
        for (int d = 0; d < head_dim; d += 32)
            _mm512_storeu_si512(kb + t * head_dim + d, codes_to_bf16(KIND, k + off[t] + d, sub));
}

static void keys_to_bf16(int kind, const char* k, const int64_t* off, int head_dim,
                         uint16_t* kb) {
    switch (kind) {
        case KV_INT8: keys_tile(KV_INT8, k, off, head_dim, kb); break;
        case KV_FP8_E4M3: keys_tile(KV_FP8_E4M3, k, off, head_dim, kb); break;
        default: keys_tile(KV_FP8_E5M2, k, off, head_dim, kb); break;
    }
}

// One PV register tile: NH query heads x NS 32-dim slices starting at dim d0. The accumulator
// rows (one per head, acc_stride floats apart) are rescaled by corr[j], then accumulate
// p[j][t] * v_t (p rows CHUNK floats apart) over the value rows at byte offsets off[0..n)
// from v, read as KIND says (quantized: p holds pv_weights).
static inline __attribute__((always_inline)) void pv_tile(const int KIND, const int NS,
                                                          const int NH, float* acc,
                                                          int acc_stride, const float* p,
                                                          const float* corr, const char* v,
                                                          const int64_t* off, int n, int d0) {
    __m512 a[PV_TILE_HEADS][2 * PV_TILE_SLICES];
    for (int j = 0; j < NH; j++) {
        const __m512 c = _mm512_set1_ps(corr[j]);
        for (int i = 0; i < 2 * NS; i++)
            a[j][i] = _mm512_mul_ps(_mm512_load_ps(acc + j * acc_stride + d0 + 16 * i), c);
    }
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int t = 0; t < n; t++) {
        __m512 pt[PV_TILE_HEADS];
        for (int j = 0; j < NH; j++)
            pt[j] = _mm512_set1_ps(p[j * CHUNK + t]);
        for (int s = 0; s < NS; s++) {
            __m512 even, odd;
            if (KIND == 0) {
                const __m512i w = _mm512_loadu_si512(v + off[t] + 2 * (d0 + 32 * s));
                even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
            } else {
                widen_codes(KIND, v + off[t] + d0 + 32 * s, &even, &odd);
            }
            for (int j = 0; j < NH; j++) {
                a[j][2 * s] = _mm512_fmadd_ps(pt[j], even, a[j][2 * s]);
                a[j][2 * s + 1] = _mm512_fmadd_ps(pt[j], odd, a[j][2 * s + 1]);
            }
        }
    }
    for (int j = 0; j < NH; j++)
        for (int i = 0; i < 2 * NS; i++)
            _mm512_store_ps(acc + j * acc_stride + d0 + 16 * i, a[j][i]);
}

// The PV weights of a chunk over quantized value rows with scales vs (16 lanes): p[h][t] *=
// vs[t] for the nh heads' rows of p (CHUNK floats apart), and for a *_RAW kind (pv_kind_for) then
// times 2^120 (e4m3) or 2^112 (e5m2), exactly (vscalefps: no rounding, and no reassociation by
// the compiler). Returns how pv_tile reads the rows.
static inline int pv_weights(int kind, float* p, int nh, __m512 vs) {
    float rebias;
    const int pv_kind = pv_kind_for(kind, _mm512_reduce_max_ps(vs), &rebias);
    for (int h = 0; h < nh; h++) {
        const __m512 w = _mm512_mul_ps(_mm512_load_ps(p + h * CHUNK), vs);
        _mm512_store_ps(p + h * CHUNK,
                        rebias ? _mm512_scalef_ps(w, _mm512_set1_ps(rebias)) : w);
    }
    return pv_kind;
}

static void pv_update(int kind, int ns, int nh, float* acc, int acc_stride, const float* p,
                      const float* corr, const char* v, const int64_t* off, int n, int d0) {
#define PV_CASE(KIND, NS, NH) \
    case (KIND * 2 + NS - 1) * 8 + NH: \
        pv_tile(KIND, NS, NH, acc, acc_stride, p, corr, v, off, n, d0); break;
#define PV_KIND(KIND) \
    PV_CASE(KIND, 1, 1) PV_CASE(KIND, 1, 2) PV_CASE(KIND, 1, 3) PV_CASE(KIND, 1, 4) \
    PV_CASE(KIND, 2, 1) PV_CASE(KIND, 2, 2) PV_CASE(KIND, 2, 3) PV_CASE(KIND, 2, 4)
    switch ((kind * 2 + ns - 1) * 8 + nh) {
        PV_KIND(0) PV_KIND(KV_INT8) PV_KIND(KV_FP8_E4M3) PV_KIND(KV_FP8_E5M2)
        PV_KIND(PV_E4M3_RAW) PV_KIND(PV_E5M2_RAW)
    }
#undef PV_KIND
#undef PV_CASE
}

// The byte offsets of a request's token rows (from the cache start, KV head 0), chunk by

// kind 0: a bf16 cache; else a quantized one (kv_quant.h), whose rows are head_dim codes and a
// scale.
static int paged_decode_avx512(int kind, const uint16_t* q, const void* k_cache,
                               const void* v_cache, const int32_t* block_tables,
                               const int32_t* seq_lens, uint16_t* out, int num_seqs,
                               int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int max_blocks, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int nd = head_dim / 32;  // 32-dim slices
    const int64_t row_bytes = kind == 0 ? 2 * head_dim : head_dim + KV_SCALE_BYTES;
    const int64_t token_stride = num_kv_heads * row_bytes;
    const int64_t block_stride = token_stride * block_size;
    _Alignas(64) char stack_buffer[SCRATCH_ON_STACK];
    CallPlan plan;
    if (plan_call(&plan, stack_buffer, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                  num_threads))
        return -3;
    const int heads_per_task = plan.heads_per_task, tasks_per_unit = plan.tasks_per_unit;
    const int64_t partial_stride = plan.partial_stride;
    float* partial = plan.partial;
    int* done = plan.done;
    // Prefetching a chunk: per token, heads_per_task * nd lines of K and of V; the unit of KV
    // head i takes tokens [i * pf_per_unit, (i + 1) * pf_per_unit), its QK call for query head
    // j of the group pf_per_call of those.
    const int pf_lines = (int)((heads_per_task * row_bytes + 63) / 64);
    const int pf_per_unit = (CHUNK + heads_per_task - 1) / heads_per_task;
    const int pf_per_call = (pf_per_unit + group - 1) / group;
    const CallShape cs = {.block_tables = block_tables, .seq_lens = seq_lens,
                          .unit_seq = plan.unit_seq, .unit_part = plan.unit_part,
                          .k_cache = k_cache, .v_cache = v_cache,
                          .block_stride = block_stride, .token_stride = token_stride,
                          .row_bytes = row_bytes,
                          .max_blocks = max_blocks, .block_size = block_size,
                          .head_dim = head_dim, .tasks_per_unit = tasks_per_unit,
                          .heads_per_task = heads_per_task};
    const int num_tasks = plan.num_units * tasks_per_unit;
    int claimed = 0;  // tasks are taken in order, each thread holding the one after its own
#pragma omp parallel num_threads(num_threads)
    {
        TaskSpan cur, nxt;
        int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        if (task < num_tasks) task_span(&cs, task, &cur);
        while (task < num_tasks) {
            const int next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (next < num_tasks) task_span(&cs, next, &nxt);
            const int s = cur.s, part = cur.part, u = cur.u, kvh0 = cur.kvh0, len = cur.len;
            const int h0 = kvh0 * group, nh = heads_per_task * group;
            // acc[h] holds head h0 + h: per 32-dim slice, its 16 even dims then its 16 odd dims.
            float acc[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
            float p[MAX_HEADS * CHUNK] __attribute__((aligned(64)));  // softmax numerators
            __m512 sum[MAX_HEADS];  // running softmax denominators, per lane
            float running_max[MAX_HEADS], corr[MAX_HEADS];
            uint16_t kb[CHUNK * MAX_HEAD_DIM] __attribute__((aligned(64)));  // quantized keys
            int64_t kb_off[CHUNK];
            for (int t = 0; t < CHUNK; t++) kb_off[t] = 2 * t * head_dim;
            for (int i = 0; i < nh * head_dim; i++) acc[i] = 0.0f;
            for (int h = 0; h < nh; h++) running_max[h] = -1e30f, sum[h] = _mm512_setzero_ps();
            const uint16_t* q_row = q + ((int64_t)s * num_heads + h0) * head_dim;
            const int c0 = cur.c0, c1 = cur.c1;
            // The first chunks; in cache already when the previous task prefetched them.
            for (int c = c0; c < c0 + PREFETCH_CHUNKS && c < c1; c++)
                prefetch_rows(cur.pk, cur.pv, chunk_rows(&cur.rows, c),
                              min_int(len - c * CHUNK, CHUNK), pf_lines);
            for (int c = c0; c < c1; c++) {
                const int n = min_int(len - c * CHUNK, CHUNK);
                const __mmask16 valid = (__mmask16)((1u << n) - 1);
                const int64_t* off = chunk_rows(&cur.rows, c);
                // The chunk PREFETCH_CHUNKS ahead: this task's, or past its end the next task's.
                TaskSpan* ahead = &cur;
                int pf_chunk = c + PREFETCH_CHUNKS;
                if (pf_chunk >= c1 && next < num_tasks)
                    ahead = &nxt, pf_chunk = nxt.c0 + pf_chunk - c1;
                const int pf_len = pf_chunk < ahead->c1
                                       ? min_int(ahead->len - pf_chunk * CHUNK, CHUNK) : 0;
                const int64_t* pf_off = pf_len ? chunk_rows(&ahead->rows, pf_chunk) : off;
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {
                    const int hb = (kvh - kvh0) * group;  // the group's first head in this task
                    const char* k = cs.k_cache + kvh * row_bytes;
                    const char* v = cs.v_cache + kvh * row_bytes;
                    // QK reads bf16 rows: the cache's, or a quantized chunk's keys converted
                    // (kb, rows kb_off apart), the scores then times their rows' scales (ks).
                    const char* qk_rows = k;
                    const int64_t* qk_off = off;
                    __m512 ks = _mm512_set1_ps(scale);
                    if (kind) {
                        keys_to_bf16(kind, k, off, head_dim, kb);
                        qk_rows = (const char*)kb, qk_off = kb_off;
                        ks = _mm512_mul_ps(ks, row_scales(k, off, head_dim));
                    }
                    // This unit's tokens of chunk pf_chunk to prefetch: [pf_begin, pf_end).
                    int pf_begin = min_int((kvh - kvh0) * pf_per_unit, pf_len);
                    const int pf_end = min_int(pf_begin + pf_per_unit, pf_len);
                    for (int h = hb; h < hb + group; h++) {
                        const int npf = min_int(pf_end - pf_begin, pf_per_call);
                        const __m512 sc = _mm512_mask_mul_ps(
                            _mm512_set1_ps(-1e30f), valid,
                            qk_scores(nd, q_row + h * head_dim, qk_rows, qk_off, ahead->pk,
                                      ahead->pv, pf_off + pf_begin, npf, pf_lines),
                            ks);
                        pf_begin += npf;
                        const float m = _mm512_reduce_max_ps(sc);
                        corr[h] = 1.0f;
                        if (m > running_max[h]) {
                            corr[h] = _mm512_cvtss_f32(exp512(_mm512_set1_ps(running_max[h] - m)));
                            sum[h] = _mm512_mul_ps(sum[h], _mm512_set1_ps(corr[h]));
                            running_max[h] = m;
                        }
                        const __m512 e = _mm512_maskz_mov_ps(
                            valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(running_max[h]))));
                        sum[h] = _mm512_add_ps(sum[h], e);
                        _mm512_store_ps(p + h * CHUNK, e);
                    }
                    const int pv_kind = kind ? pv_weights(kind, p + hb * CHUNK, group,
                                                          row_scales(v, off, head_dim))
                                             : 0;
                    for (int j = 0; j < group; j += PV_TILE_HEADS) {
                        const int th = min_int(group - j, PV_TILE_HEADS);
                        for (int sl = 0; sl < nd; sl += PV_TILE_SLICES) {
                            const int ts = min_int(nd - sl, PV_TILE_SLICES);
                            pv_update(pv_kind, ts, th, acc + (hb + j) * head_dim, head_dim,
                                      p + (hb + j) * CHUNK, corr + hb + j, v, off, n, 32 * sl);
                        }
                    }
                }
            }
            if (len > PARTITION) {  // a partial result; the last of the request's to end merges
                float* dst = partial + u * partial_stride;
                for (int h = 0; h < nh; h++) {
                    float* row = dst + (int64_t)(h0 + h) * (head_dim + 2);
                    for (int d = 0; d < head_dim; d++) row[d] = acc[h * head_dim + d];
                    row[head_dim] = running_max[h];
                    row[head_dim + 1] = _mm512_reduce_add_ps(sum[h]);
                }
                const int parts = num_partitions(len);
                int* count = done + (int64_t)s * tasks_per_unit + task % tasks_per_unit;
                if (__atomic_add_fetch(count, 1, __ATOMIC_ACQ_REL) == parts)
                    merge_partitions(partial + (u - part) * partial_stride, partial_stride, parts,
                                     out + ((int64_t)s * num_heads + h0) * head_dim, h0, nh,
                                     head_dim, 32);
            } else {
                uint16_t* out_row = out + ((int64_t)s * num_heads + h0) * head_dim;
                for (int h = 0; h < nh; h++) {
                    const float total = _mm512_reduce_add_ps(sum[h]);
                    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                    store_head(out_row + h * head_dim, acc + h * head_dim, head_dim, inv, 32);
                }
            }
            task = next;
            if (task < num_tasks) cur = nxt;
        }
    }
    free(plan.heap);
    return 0;
}
#endif

#if defined(PAGED_DECODE_AVX2)
// ---------------------------------------------------------------------------------------------
// AVX2 path (a bfloat16 or quantized cache, head_dim a multiple of 16), for CPUs without
// AVX-512: the AVX-512 path's tasks, chunks of 16 positions, partitions and merge, in registers
// of 8 float32 lanes.
//   QK   per token of a chunk, each 16-dim slice of its key row is widened to float32 (the even
//        dims by a shift, the odd ones by a mask) and FMA'd with the same slice of up to
//        AVX2_HEADS query heads of the group (widened and scaled once a task, in that even/odd
//        order), one 8-lane partial sum per head; a horizontal-add tree turns 8 tokens' partials
//        into 8 scores. A quantized chunk's keys are first widened into a float32 tile in that
//        order (a code is its value exactly; the row scales multiply the scores);
//   softmax  online per query head over the chunk's 16 scores (two vectors, exp256);
//   PV   per 16-dim slice, the accumulators of up to AVX2_HEADS query heads (8 even dims, then 8
//        odd dims, each) stay in registers across the chunk's tokens; quantized value rows are
//        widened as read (their scales are in the weights p, see pv_kind_for).
// Lanes past the end of the context read the chunk's first row again and are masked out. The
// sums are not the AVX-512 path's (so neither are the bits), and like those depend only on the
// context length: not on the batch or the thread count.

#define AVX2_HEADS 4  // query heads per QK pass and per PV register tile
// A chunk's rows are prefetched while the chunk before it runs, its lines shared evenly over
// that chunk's QK passes and, within a pass, over its tokens, a line or two at a time: on an AMD
// EPYC Zen 1 (SmolLM2's shape, 30 layers' caches, the kernel alone) 0.80x the time of all of a
// chunk's rows prefetched at once three chunks ahead (the AVX-512 path's distance) at batch 1
// and 546 positions, 0.72x at 2,048, 0.70x at batch 8 and 0.69x at batch 32 (512 positions).
// A burst of a chunk's lines in one pass gained half as much, two chunks ahead a little less.
#define AVX2_PREFETCH_CHUNKS 1
_Static_assert(OFFSET_RING > AVX2_PREFETCH_CHUNKS, "chunks c and c + 1 are both in use");

// What a QK pass prefetches: items [first, end) of a chunk's rows, item i the line i % lines of
// token i / lines, from each of pk + off[token] and pv + off[token] (the rows of the task's KV
// heads, `lines` 64-byte lines a token), `per_token` items per token of the pass.
typedef struct {
    const char* pk;
    const char* pv;
    const int64_t* off;
    int first, end, lines, per_token;
} PrefetchRows;

// exp(x) per lane: exp512's reduction and polynomial, 2^n built in the exponent bits, so x is
// kept to [-87, 88]; below -87 (where expf is under 1.7e-38, a weight nothing can use next to
// the chunk's largest, 1) the result is 0.
static inline __m256 exp256(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lowest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // n in [-126, 127]
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Lane t = the sum of the 8 lanes of v[t].
static inline __m256 transpose_sum8(const __m256* v) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 a = _mm256_hadd_ps(s01, s23);  // [v0..v3 lanes 0-3 | v0..v3 lanes 4-7]
    const __m256 b = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// A 16-dim slice of a row read as KIND says (PV_E4M3_RAW and friends), at p, as float32: *even
// its 8 even dims, *odd its 8 odd ones. A bf16 pair (2i, 2i+1) fills a 32-bit lane: shifting it
// left by 16 gives element 2i, masking off the low half element 2i+1. Codes are sign-extended to
// 16 bits first, so a lane holds codes (2i, 2i+1) the same way: int8 converts; fp8 places its
// sign, exponent and mantissa bits where float32's are (the value times 2^-120 or 2^-112).
static inline __attribute__((always_inline)) void widen16(const int KIND, const char* p,
                                                          __m256* even, __m256* odd) {
    if (KIND == 0) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)p);
        *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
        return;
    }
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
    if (KIND == KV_INT8) {
        *even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16));
        *odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(w, 16));
        return;
    }
    const int e4m3 = KIND == KV_FP8_E4M3 || KIND == PV_E4M3_RAW;
    const __m256i mask = _mm256_set1_epi32(e4m3 ? (int)0x87F00000u : (int)0x8FE00000u);
    const __m256i e = e4m3 ? _mm256_slli_epi32(w, 20) : _mm256_slli_epi32(w, 21);
    const __m256i o = e4m3 ? _mm256_slli_epi32(w, 4) : _mm256_slli_epi32(w, 5);
    *even = _mm256_castsi256_ps(_mm256_and_si256(e, mask));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(o, mask));
    if (KIND == KV_FP8_E4M3 || KIND == KV_FP8_E5M2) {
        const __m256 bias = _mm256_set1_ps(e4m3 ? 0x1p120f : 0x1p112f);
        *even = _mm256_mul_ps(*even, bias);
        *odd = _mm256_mul_ps(*odd, bias);
    }
}

// The 16 scores of each of GH query heads (qf: widened, scaled, head_dim floats a head) against
// the chunk's key rows at byte offsets off[0..16) from k: scores[j * CHUNK + t]. The rows are
// bf16, or with TILE float32 rows of a key tile (keys_tile: each 16-dim slice its 8 even dims,
// then its 8 odd ones), the same numbers summed in the same order.
static inline __attribute__((always_inline)) void qk_heads(const int GH, const int TILE,
                                                           int head_dim, const float* qf,
                                                           const char* k, const int64_t* off,
                                                           float* scores,
                                                           const PrefetchRows* pf) {
    __m256 partial[AVX2_HEADS][CHUNK];
    for (int t = 0; t < CHUNK; t++) {
        for (int i = pf->first + t * pf->per_token;
             i < min_int(pf->first + (t + 1) * pf->per_token, pf->end); i++) {
            const int64_t at = pf->off[i / pf->lines] + 64 * (i % pf->lines);
            _mm_prefetch(pf->pk + at, _MM_HINT_T0);
            _mm_prefetch(pf->pv + at, _MM_HINT_T0);
        }
        __m256 a[AVX2_HEADS];
        for (int j = 0; j < GH; j++) a[j] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 16) {
            __m256 even, odd;
            if (TILE) {
                even = _mm256_load_ps((const float*)(k + off[t]) + d);
                odd = _mm256_load_ps((const float*)(k + off[t]) + d + 8);
            } else {
                widen16(0, k + off[t] + 2 * d, &even, &odd);
            }
            for (int j = 0; j < GH; j++)
                a[j] = _mm256_fmadd_ps(even, _mm256_load_ps(qf + j * head_dim + d),
                                       _mm256_fmadd_ps(odd, _mm256_load_ps(qf + j * head_dim + d + 8),
                                                       a[j]));
        }
        for (int j = 0; j < GH; j++) partial[j][t] = a[j];
    }
    for (int j = 0; j < GH; j++) {
        _mm256_store_ps(scores + j * CHUNK, transpose_sum8(partial[j]));
        _mm256_store_ps(scores + j * CHUNK + 8, transpose_sum8(partial[j] + 8));
    }
}

static void qk_group(int gh, int tile, int head_dim, const float* qf, const char* k,
                     const int64_t* off, float* scores, const PrefetchRows* pf) {
    switch (gh * 2 + tile) {
        case 2: qk_heads(1, 0, head_dim, qf, k, off, scores, pf); break;
        case 3: qk_heads(1, 1, head_dim, qf, k, off, scores, pf); break;
        case 4: qk_heads(2, 0, head_dim, qf, k, off, scores, pf); break;
        case 5: qk_heads(2, 1, head_dim, qf, k, off, scores, pf); break;
        case 6: qk_heads(3, 0, head_dim, qf, k, off, scores, pf); break;
        case 7: qk_heads(3, 1, head_dim, qf, k, off, scores, pf); break;
        case 8: qk_heads(4, 0, head_dim, qf, k, off, scores, pf); break;
        default: qk_heads(4, 1, head_dim, qf, k, off, scores, pf); break;
    }
}

// A chunk's CHUNK quantized key rows (byte offsets off[t] from k) as float32 rows of head_dim in
// kf, in qk_heads' TILE order, exactly (the scales stay aside).
static inline __attribute__((always_inline)) void keys_tile(const int KIND, const char* k,
                                                            const int64_t* off, int head_dim,
                                                            float* kf) {
    for (int t = 0; t < CHUNK; t++)
        for (int d = 0; d < head_dim; d += 16) {
            __m256 even, odd;
            widen16(KIND, k + off[t] + d, &even, &odd);
            _mm256_store_ps(kf + t * head_dim + d, even);
            _mm256_store_ps(kf + t * head_dim + d + 8, odd);
        }
}

static void keys_to_f32(int kind, const char* k, const int64_t* off, int head_dim, float* kf) {
    switch (kind) {
        case KV_INT8: keys_tile(KV_INT8, k, off, head_dim, kf); break;
        case KV_FP8_E4M3: keys_tile(KV_FP8_E4M3, k, off, head_dim, kf); break;
        default: keys_tile(KV_FP8_E5M2, k, off, head_dim, kf); break;
    }
}

// One PV register tile: the 16-dim slice at d0 of NH query heads' accumulators (head_dim floats
// apart), rescaled by corr[j], plus p[j * CHUNK + t] times value row t (byte offsets off[0..n)
// from v, read as KIND says).
static inline __attribute__((always_inline)) void pv_heads(const int KIND, const int NH,
                                                           float* acc, int head_dim,
                                                           const float* p, const float* corr,
                                                           const char* v, const int64_t* off,
                                                           int n, int d0) {
    __m256 a[AVX2_HEADS][2];
    for (int j = 0; j < NH; j++) {
        const __m256 c = _mm256_set1_ps(corr[j]);
        a[j][0] = _mm256_mul_ps(_mm256_load_ps(acc + j * head_dim + d0), c);
        a[j][1] = _mm256_mul_ps(_mm256_load_ps(acc + j * head_dim + d0 + 8), c);
    }
    for (int t = 0; t < n; t++) {
        __m256 even, odd;
        widen16(KIND, v + off[t] + (KIND ? d0 : 2 * d0), &even, &odd);
        for (int j = 0; j < NH; j++) {
            const __m256 pt = _mm256_broadcast_ss(p + j * CHUNK + t);
            a[j][0] = _mm256_fmadd_ps(pt, even, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(pt, odd, a[j][1]);
        }
    }
    for (int j = 0; j < NH; j++) {
        _mm256_store_ps(acc + j * head_dim + d0, a[j][0]);
        _mm256_store_ps(acc + j * head_dim + d0 + 8, a[j][1]);
    }
}

static void pv_group(int kind, int nh, float* acc, int head_dim, const float* p,
                     const float* corr, const char* v, const int64_t* off, int n) {
#define PV_CASE(KIND, NH) \
    case KIND * 4 + NH - 1: pv_heads(KIND, NH, acc, head_dim, p, corr, v, off, n, d0); break;
#define PV_KIND(KIND) PV_CASE(KIND, 1) PV_CASE(KIND, 2) PV_CASE(KIND, 3) PV_CASE(KIND, 4)
    for (int d0 = 0; d0 < head_dim; d0 += 16) {
        switch (kind * 4 + nh - 1) {
            PV_KIND(0) PV_KIND(KV_INT8) PV_KIND(KV_FP8_E4M3) PV_KIND(KV_FP8_E5M2)
            PV_KIND(PV_E4M3_RAW) PV_KIND(PV_E5M2_RAW)
        }
    }
#undef PV_KIND
#undef PV_CASE
}

// kind 0: a bf16 cache; else a quantized one (kv_quant.h), whose rows are head_dim codes and a
// scale.
static int paged_decode_avx2(int kind, const uint16_t* q, const void* k_cache,
                             const void* v_cache, const int32_t* block_tables,
                             const int32_t* seq_lens, uint16_t* out, int num_seqs, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, int max_blocks,
                             float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t row_bytes = kind == 0 ? 2 * head_dim : head_dim + KV_SCALE_BYTES;
    const int64_t token_stride = num_kv_heads * row_bytes;
    const int64_t block_stride = token_stride * block_size;
    _Alignas(64) char stack_buffer[SCRATCH_ON_STACK];
    CallPlan plan;
    if (plan_call(&plan, stack_buffer, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                  num_threads))
        return -3;
    const int heads_per_task = plan.heads_per_task, tasks_per_unit = plan.tasks_per_unit;
    const int64_t partial_stride = plan.partial_stride;
    float* partial = plan.partial;
    int* done = plan.done;
    // Per token of a chunk, the lines of the task's KV heads' rows, over the chunk's QK passes.
    const int pf_lines = (int)((heads_per_task * row_bytes + 63) / 64);
    const int qk_passes = heads_per_task * ((group + AVX2_HEADS - 1) / AVX2_HEADS);
    const int pf_per_pass = (CHUNK * pf_lines + qk_passes - 1) / qk_passes;  // items
    const CallShape cs = {.block_tables = block_tables, .seq_lens = seq_lens,
                          .unit_seq = plan.unit_seq, .unit_part = plan.unit_part,
                          .k_cache = (const char*)k_cache, .v_cache = (const char*)v_cache,
                          .block_stride = block_stride, .token_stride = token_stride,
                          .row_bytes = row_bytes,
                          .max_blocks = max_blocks, .block_size = block_size,
                          .head_dim = head_dim, .tasks_per_unit = tasks_per_unit,
                          .heads_per_task = heads_per_task};
    const int num_tasks = plan.num_units * tasks_per_unit;
    int claimed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        // The task's query heads, widened and scaled, and their accumulators: per 16-dim slice,
        // the 8 even dims, then the 8 odd dims.
        float qf[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(32)));
        float acc[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(32)));
        float p[MAX_HEADS * CHUNK] __attribute__((aligned(32)));  // scores, then numerators
        float running_max[MAX_HEADS], sum[MAX_HEADS], corr[MAX_HEADS];
        float kf[CHUNK * MAX_HEAD_DIM] __attribute__((aligned(32)));  // a quantized chunk's keys
        int64_t kf_off[CHUNK];
        for (int t = 0; t < CHUNK; t++) kf_off[t] = (int64_t)sizeof(float) * t * head_dim;
        float ks[CHUNK] __attribute__((aligned(32))), vs[CHUNK];  // its row scales
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        TaskSpan cur;
        for (int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED); task < num_tasks;
             task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED)) {
            task_span(&cs, task, &cur);
            const int s = cur.s, part = cur.part, u = cur.u, kvh0 = cur.kvh0, len = cur.len;
            const int h0 = kvh0 * group, nh = heads_per_task * group;
            const uint16_t* q_row = q + ((int64_t)s * num_heads + h0) * head_dim;
            for (int h = 0; h < nh; h++) {
                for (int d = 0; d < head_dim; d += 16)
                    for (int i = 0; i < 8; i++) {
                        qf[h * head_dim + d + i] = bf16_to_f32(q_row[h * head_dim + d + 2 * i]) * scale;
                        qf[h * head_dim + d + 8 + i] =
                            bf16_to_f32(q_row[h * head_dim + d + 2 * i + 1]) * scale;
                    }
                for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] = 0.0f;
                running_max[h] = -1e30f, sum[h] = 0.0f;
            }
            if (cur.c0 < cur.c1)  // the first chunk's rows at once
                prefetch_rows(cur.pk, cur.pv, chunk_rows(&cur.rows, cur.c0),
                              min_int(len - cur.c0 * CHUNK, CHUNK), pf_lines);
            for (int c = cur.c0; c < cur.c1; c++) {
                const int n = min_int(len - c * CHUNK, CHUNK);
                // The next chunk's rows, a share of its tokens in each QK pass of the chunk.
                const int pf_chunk = c + AVX2_PREFETCH_CHUNKS;
                const int pf_len = pf_chunk < cur.c1 ? min_int(len - pf_chunk * CHUNK, CHUNK) : 0;
                const int64_t* off = chunk_rows(&cur.rows, c);
                const int64_t* pf_off = pf_len ? chunk_rows(&cur.rows, pf_chunk) : off;
                int pf_begin = 0;
                const __m256i valid0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
                const __m256i valid1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane);
                for (int kvh = kvh0; kvh < kvh0 + heads_per_task; kvh++) {
                    const int hb = (kvh - kvh0) * group;  // the group's first head in this task
                    const char* k = cs.k_cache + kvh * row_bytes;
                    const char* v = cs.v_cache + kvh * row_bytes;
                    // QK reads the cache's bf16 rows, or a quantized chunk's keys widened (kf,
                    // rows kf_off apart), the scores then times their rows' scales (ks).
                    const char* qk_rows = k;
                    const int64_t* qk_off = off;
                    __m256 ks0 = _mm256_set1_ps(1.0f), ks1 = ks0;
                    if (kind) {
                        keys_to_f32(kind, k, off, head_dim, kf);
                        qk_rows = (const char*)kf, qk_off = kf_off;
                        chunk_scales(k, off, head_dim, ks);
                        ks0 = _mm256_load_ps(ks), ks1 = _mm256_load_ps(ks + 8);
                    }
                    for (int j = 0; j < group; j += AVX2_HEADS) {
                        const PrefetchRows pf = {.pk = cur.pk, .pv = cur.pv, .off = pf_off,
                                                 .first = pf_begin,
                                                 .end = min_int(pf_begin + pf_per_pass,
                                                                pf_len * pf_lines),
                                                 .lines = pf_lines,
                                                 .per_token = (pf_per_pass + CHUNK - 1) / CHUNK};
                        pf_begin += pf_per_pass;
                        qk_group(min_int(group - j, AVX2_HEADS), kind != 0, head_dim,
                                 qf + (hb + j) * head_dim, qk_rows, qk_off, p + (hb + j) * CHUNK,
                                 &pf);
                    }
                    for (int h = hb; h < hb + group; h++) {
                        const __m256 none = _mm256_set1_ps(-1e30f);
                        const __m256 s0 = _mm256_blendv_ps(
                            none, _mm256_mul_ps(_mm256_load_ps(p + h * CHUNK), ks0),
                            _mm256_castsi256_ps(valid0));
                        const __m256 s1 = _mm256_blendv_ps(
                            none, _mm256_mul_ps(_mm256_load_ps(p + h * CHUNK + 8), ks1),
                            _mm256_castsi256_ps(valid1));
                        const float m = max8(_mm256_max_ps(s0, s1));
                        corr[h] = 1.0f;
                        if (m > running_max[h]) {
                            corr[h] = _mm_cvtss_f32(_mm256_castps256_ps128(
                                exp256(_mm256_set1_ps(running_max[h] - m))));
                            sum[h] *= corr[h];
                            running_max[h] = m;
                        }
                        const __m256 mx = _mm256_set1_ps(running_max[h]);
                        const __m256 e0 = exp256(_mm256_sub_ps(s0, mx));
                        const __m256 e1 = exp256(_mm256_sub_ps(s1, mx));
                        sum[h] += sum8(_mm256_add_ps(e0, e1));
                        _mm256_store_ps(p + h * CHUNK, e0);
                        _mm256_store_ps(p + h * CHUNK + 8, e1);
                    }
                    int pv_kind = 0;
                    if (kind) {  // the weights times their value rows' scales (and fp8's factor)
                        chunk_scales(v, off, head_dim, vs);
                        const __m256 vs0 = _mm256_loadu_ps(vs), vs1 = _mm256_loadu_ps(vs + 8);
                        float rebias;
                        pv_kind = pv_kind_for(kind, max8(_mm256_max_ps(vs0, vs1)), &rebias);
                        const __m256 factor = _mm256_set1_ps(rebias == 120.0f   ? 0x1p120f
                                                             : rebias == 112.0f ? 0x1p112f
                                                                                : 1.0f);
                        for (int h = hb; h < hb + group; h++) {
                            float* ph = p + h * CHUNK;
                            _mm256_store_ps(ph, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(ph), vs0), factor));
                            _mm256_store_ps(ph + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(ph + 8), vs1), factor));
                        }
                    }
                    for (int j = 0; j < group; j += AVX2_HEADS)
                        pv_group(pv_kind, min_int(group - j, AVX2_HEADS),
                                 acc + (hb + j) * head_dim, head_dim, p + (hb + j) * CHUNK,
                                 corr + hb + j, v, off, n);
                }
            }
            if (len > PARTITION) {  // a partial result; the last of the request's to end merges
                float* dst = partial + u * partial_stride;
                for (int h = 0; h < nh; h++) {
                    float* row = dst + (int64_t)(h0 + h) * (head_dim + 2);
                    for (int d = 0; d < head_dim; d++) row[d] = acc[h * head_dim + d];
                    row[head_dim] = running_max[h];
                    row[head_dim + 1] = sum[h];
                }
                const int parts = num_partitions(len);
                int* count = done + (int64_t)s * tasks_per_unit + task % tasks_per_unit;
                if (__atomic_add_fetch(count, 1, __ATOMIC_ACQ_REL) == parts)
                    merge_partitions(partial + (u - part) * partial_stride, partial_stride, parts,
                                     out + ((int64_t)s * num_heads + h0) * head_dim, h0, nh,
                                     head_dim, 16);
            } else {
                uint16_t* out_row = out + ((int64_t)s * num_heads + h0) * head_dim;
                for (int h = 0; h < nh; h++)
                    store_head(out_row + h * head_dim, acc + h * head_dim, head_dim,
                               sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f, 16);
            }
        }
    }
    free(plan.heap);
    return 0;
}
#endif

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define PLAIN_ROW(head_dim) (head_dim)
#define QUANT_ROW(head_dim) ((head_dim) + KV_SCALE_BYTES)
#define LOAD_BF16_ROW(dst, src, head_dim) \
    for (int d = 0; d < head_dim; d++) dst[d] = bf16_to_f32((src)[d])
#define LOAD_F32_ROW(dst, src, head_dim) memcpy(dst, src, sizeof(float) * (head_dim))
#define LOAD_INT8_ROW(dst, src, head_dim) kv_dequant_row(KV_INT8, src, head_dim, dst)
#define LOAD_E4M3_ROW(dst, src, head_dim) kv_dequant_row(KV_FP8_E4M3, src, head_dim, dst)
#define LOAD_E5M2_ROW(dst, src, head_dim) kv_dequant_row(KV_FP8_E5M2, src, head_dim, dst)
DEFINE_PAGED_DECODE(static, paged_decode_bf16_portable, uint16_t, uint16_t, PLAIN_ROW, bf16_to_f32,
                    f32_to_bf16, LOAD_BF16_ROW)
DEFINE_PAGED_DECODE(, paged_decode_f32, float, float, PLAIN_ROW, LOAD_F32, STORE_F32, LOAD_F32_ROW)
DEFINE_PAGED_DECODE(static, paged_decode_int8_portable, uint16_t, uint8_t, QUANT_ROW, bf16_to_f32,
                    f32_to_bf16, LOAD_INT8_ROW)
DEFINE_PAGED_DECODE(static, paged_decode_e4m3_portable, uint16_t, uint8_t, QUANT_ROW, bf16_to_f32,
                    f32_to_bf16, LOAD_E4M3_ROW)
DEFINE_PAGED_DECODE(static, paged_decode_e5m2_portable, uint16_t, uint8_t, QUANT_ROW, bf16_to_f32,
                    f32_to_bf16, LOAD_E5M2_ROW)

// Which loop decode attention runs for a bf16 or quantized cache here: 2 AVX-512 BF16 (head_dim
// a multiple of 32), 1 AVX2 (a multiple of 16), 0 the portable C loop only.
int paged_decode_path(void) {
#if defined(PAGED_DECODE_AVX512)
    return 2;
#elif defined(PAGED_DECODE_AVX2)
    return 1;
#else
    return 0;
#endif
}

int paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int32_t* block_tables, const int32_t* seq_lens, uint16_t* out,
                      int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      int max_blocks, float scale, int num_threads) {
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1;
#if defined(PAGED_DECODE_AVX512)
    if (head_dim % 32 == 0)
        return paged_decode_avx512(0, q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                                   num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                                   scale, num_threads);
#elif defined(PAGED_DECODE_AVX2)
    if (head_dim % 16 == 0)
        return paged_decode_avx2(0, q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                                 num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale,
                                 num_threads);
#endif
    return paged_decode_bf16_portable(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                                      num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                                      scale, num_threads);
}

// Decode attention over a quantized cache (kv_quant.h; `kind` says which): bf16 queries and
// output, the arguments of paged_decode_bf16 otherwise.
int paged_decode_quant(int kind, const uint16_t* q, const uint8_t* k_cache, const uint8_t* v_cache,
                       const int32_t* block_tables, const int32_t* seq_lens, uint16_t* out,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int max_blocks, float scale, int num_threads) {
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1;
#if defined(PAGED_DECODE_AVX512)
    if (head_dim % 32 == 0 && kind >= KV_INT8 && kind <= KV_FP8_E5M2)
        return paged_decode_avx512(kind, q, k_cache, v_cache, block_tables, seq_lens, out,
                                   num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                   max_blocks, scale, num_threads);
#elif defined(PAGED_DECODE_AVX2)
    if (head_dim % 16 == 0 && kind >= KV_INT8 && kind <= KV_FP8_E5M2)
        return paged_decode_avx2(kind, q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs,
                                 num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale,
                                 num_threads);
#endif
    switch (kind) {
        case KV_INT8:
            return paged_decode_int8_portable(q, k_cache, v_cache, block_tables, seq_lens, out,
                                              num_seqs, num_heads, num_kv_heads, head_dim,
                                              block_size, max_blocks, scale, num_threads);
        case KV_FP8_E4M3:
            return paged_decode_e4m3_portable(q, k_cache, v_cache, block_tables, seq_lens, out,
                                              num_seqs, num_heads, num_kv_heads, head_dim,
                                              block_size, max_blocks, scale, num_threads);
        case KV_FP8_E5M2:
            return paged_decode_e5m2_portable(q, k_cache, v_cache, block_tables, seq_lens, out,
                                              num_seqs, num_heads, num_kv_heads, head_dim,
                                              block_size, max_blocks, scale, num_threads);
    }
    return -1;
}
