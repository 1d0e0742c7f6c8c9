// Paged prefill attention for CPUs with AVX-512 BF16: flash attention (online softmax, float32
// accumulation, P rounded to bf16 for P V) over every prefill chunk of a step in one call, K/V
// read through the block table. CPUs with AVX2 and FMA but no AVX-512 BF16 run the same tasks in
// float32 with 8 lanes (the AVX2 section below).
//
// Layouts (row-major, bf16 stored as uint16_t):
//   q            [num_tokens, num_heads, head_dim], token stride q_stride (elements)
//   out          [num_tokens, num_heads, head_dim], token stride out_stride (elements)
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] bf16, or with kv_kind != 0 a
//                quantized cache (kv_quant.h): rows of head_dim one-byte codes and a float32 scale
//   block_tables [num_seqs, max_blocks] int32
//   query_start_loc [num_seqs + 1] int32: request s owns tokens [qsl[s], qsl[s + 1]) of q / out
//   seq_lens     [num_seqs] int32: context length including the chunk. Chunk token j of request s
//                sits at position seq_lens[s] - query_len + j and sees keys 0..that position.
//
// Query rows sit in the 16 lanes of a zmm throughout, so the softmax is lane-wise (no horizontal
// max or sum): vdpbf16ps multiplies a zmm of 16 rows' (x[2i], x[2i + 1]) bf16 pairs by one
// broadcast pair and adds both products into the row's float32 lane.
//
// The call runs in two parallel phases:
//  1. Pack: the context of every (request, KV head) is copied out of the paged cache once into
//     contiguous scratch, padded with zeros to a multiple of KEY_TILE keys. A quantized row is
//     dequantized there (code * scale in float32, rounded to bf16 to nearest even, subnormals
//     kept: torch's `(codes.float() * scale).bfloat16()`), so the cache is read once, in codes:
//       K: [key][head_dim], plain rows (the QK^T kernel broadcasts (k[2i], k[2i + 1]) pairs).
//       V: key pairs interleaved, [key / 2][head_dim][2] (the PV kernel broadcasts (v[key][d],
//          v[key + 1][d]) pairs).
//     Either way keys from key k on (k even) start at element k * head_dim.
//  2. Attend: a task is (request, KV head, tile of up to 64 query tokens). Its rows are the
//     (query head of the GQA group, token) pairs, row r = g * num_tile_tokens + t, so the whole
//     group shares each K/V tile; rows are padded to blocks of BLOCK_ROWS = 32 (two zmm of
//     lanes). Per task, with row r in lane r % 16 of lane group r / 16:
//       Q^T  [lane group][head_dim / 2][16][2]  bf16 pairs (packed from q)
//       O^T  [lane group][head_dim][16]         float32 accumulator
//     The task walks its keys KEY_TILE at a time (the K/V tile stays in cache) and, for every row
//     block that sees any of them:
//       S^T = K Q^T  kernel 8 keys x 32 rows: per dimension pair, two Q zmm times 8 broadcast
//                    K pairs, 16 accumulators; stored scaled by scale * log2(e) as [key][32];
//       softmax      online, base 2, lane-wise; causal mask per lane; P^T stored as bf16 pairs
//                    of consecutive keys, [key / 2][32 rows][2];
//       O^T += V^T P^T  kernel 8 dims x 32 rows: per key pair, two P zmm times 8 broadcast V
//                    pairs, O^T rescaled as it is loaded.
//     Tasks are sorted by work (causal tiles differ) and scheduled dynamically.
//
// On AMX tiles (where the bf16 matmul runs on them, prefill_attention_uses_amx) the two products
// are tdpbf16ps instead, on the same layouts: S^T = K Q^T per 16 keys with K rows as the A tile
// and the Q^T pairs as B (one float32 tile a lane group, the head's dims 32 at a time in order);
// O^T += V^T P^T per 16 dims with V packed transposed ([head_dim][key], the A tile) and the P^T
// pairs as B, 32 keys at a time in order, P^T zero past the block's keys. The tile unit sums each
// output by itself, so a row's bits still depend on nothing but its own query and context (not
// on the chunk, the other rows or the threads); they are not the AVX-512 loop's bits.
// QUIRE_CPU_AMX=0 (EngineConfig.cpu_amx) keeps the AVX-512 loop everywhere.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_quant.h"

#if defined(__AVX512BF16__)
#define PREFILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFILL_AVX2 1
#endif

#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)
#include <immintrin.h>
#include <omp.h>

#include "bf16.h"

#define KEY_TILE 64  // keys per online-softmax step; a multiple of 8
#define MAX_ROWS 256  // rows (group heads x tokens) per task
#define MAX_TILE_TOKENS 64
#if defined(PREFILL_AVX512)
#define BLOCK_ROWS 32       // query rows per kernel block: two zmm of lanes
typedef uint16_t PackElem;  // the packs hold bf16 (K rows, V key pairs or V^T)
#else
#define BLOCK_ROWS 24    // three ymm of lanes
typedef float PackElem;  // the packs hold float32 rows of K and V
#endif
#define PADDED_ROWS ((MAX_ROWS + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS)

typedef struct {
    int seq, kv_head, token0, num_tokens;  // query tokens [token0, token0 + num_tokens) of seq
    int64_t work;                          // rows x keys, for ordering
} Task;

typedef struct {
    const uint16_t* q;
    const char *k_cache, *v_cache;
    int kv_kind;  // 0: bf16 rows; else the quantized format of kv_quant.h
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    uint16_t* out;
    int64_t q_stride, out_stride;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale_log2;  // softmax scale * log2(e): scores are exponentiated base 2
    PackElem *k_pack, *v_pack;
    const int64_t* pack_offset;  // [num_seqs]: first element of request s's packs (KV head 0)
    const int* padded_len;       // [num_seqs]: context length rounded up to KEY_TILE
    int amx;  // S^T and O^T on AMX tiles (qk_tiles, pv_tiles), V packed transposed
} Problem;

// Byte offset in the K (and V) cache of key `key`'s row for one (request, KV head).
static int64_t row_offset(const Problem* pb, int s, int kv_head, int key) {
    const int64_t row_bytes = pb->kv_kind ? pb->head_dim + KV_SCALE_BYTES : 2 * pb->head_dim;
    const int64_t token_stride = (int64_t)pb->num_kv_heads * row_bytes;
    const int32_t* table = pb->block_tables + (int64_t)s * pb->max_blocks;
    return (int64_t)table[key / pb->block_size] * pb->block_size * token_stride +
           (int64_t)(key % pb->block_size) * token_stride + (int64_t)kv_head * row_bytes;
}
#endif

#if defined(PREFILL_AVX512)
#include "kv_codes.h"

#define SCRATCH_Q_BYTES(D) ((size_t)MAX_ROWS * (D) * 2)

typedef struct {  // per-thread scratch, one task at a time
    uint32_t* q;  // Q^T bf16 pairs [MAX_ROWS / 16][head_dim / 2][16]
    float* o;     // O^T [MAX_ROWS / 16][head_dim][16]
    float m[MAX_ROWS], l[MAX_ROWS];  // running max (base-2 units) and sum per row
    int32_t last[MAX_ROWS];          // last key position row r sees; -1 for padding rows
    float s[KEY_TILE * BLOCK_ROWS];       // S^T of a row block [key][32]
    uint32_t p[KEY_TILE / 2 * BLOCK_ROWS];  // P^T bf16 pairs [key / 2][32]
} Scratch;

static inline __m512bh pair_broadcast(const uint16_t* x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

// 2^x for x <= 0: 2^round(x) * 2^f with f in [-0.5, 0.5], 2^f by its degree-5 Taylor polynomial
// (relative error < 3e-6, far below the bf16 rounding of P). Inputs below -127 give ~0.
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// S^T[8 keys][32 rows] = K[8 keys][D] . Q^T, times scale_log2. q: the block's two lane groups.
static inline __attribute__((always_inline)) void qk_kernel(const uint32_t* q, const uint16_t* k,
                                                            float* s, float scale_log2,
                                                            const int D) {
    __m512 acc[8][2];
    for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int i = 0; i < D / 2; i++) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q + i * 16);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q + (D / 2 + i) * 16);
        for (int j = 0; j < 8; j++) {
            const __m512bh kp = pair_broadcast(k + j * D + 2 * i);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], q0, kp);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], q1, kp);
        }
    }
    const __m512 c = _mm512_set1_ps(scale_log2);
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_ps(s + j * BLOCK_ROWS, _mm512_mul_ps(acc[j][0], c));
        _mm512_storeu_ps(s + j * BLOCK_ROWS + 16, _mm512_mul_ps(acc[j][1], c));
    }
}

// O^T[D][32 rows] = O^T * alpha (per lane) + V^T . P^T over n keys (n even); o: the block's two
// lane groups, v: packed key pairs.
static inline __attribute__((always_inline)) void pv_kernel(const uint32_t* p, const uint16_t* v,
                                                            float* o, const __m512 alpha[2],
                                                            int n, const int D) {
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) {
            acc[i][0] = _mm512_mul_ps(_mm512_loadu_ps(o + (d0 + i) * 16), alpha[0]);
            acc[i][1] = _mm512_mul_ps(_mm512_loadu_ps(o + (D + d0 + i) * 16), alpha[1]);
        }
        for (int k = 0; k < n; k += 2) {
            const __m512bh p0 = (__m512bh)_mm512_loadu_si512(p + k / 2 * BLOCK_ROWS);
            const __m512bh p1 = (__m512bh)_mm512_loadu_si512(p + k / 2 * BLOCK_ROWS + 16);
            for (int i = 0; i < 8; i++) {
                const __m512bh vp = pair_broadcast(v + k * D + (d0 + i) * 2);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p0, vp);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p1, vp);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(o + (d0 + i) * 16, acc[i][0]);
            _mm512_storeu_ps(o + (D + d0 + i) * 16, acc[i][1]);
        }
    }
}

// x[i][j] -> x[j][i]: at each scale h = 8, 4, 2, 1 the off-diagonal h x h blocks of every 2h x 2h
// block swap places, two vectors a time (vpermt2ps).
static inline void transpose_16x16(__m512 x[16]) {
    for (int h = 8; h >= 1; h /= 2) {
        int lo[16], hi[16];
        for (int j = 0; j < 16; j++) {
            lo[j] = j & h ? 16 + j - h : j;  // a's element j, or b's j - h
            hi[j] = j & h ? 16 + j : j + h;  // a's j + h, or b's element j
        }
        const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
        for (int i = 0; i < 16; i++) {
            if (i & h) continue;
            const __m512 a = x[i], b = x[i + h];
            x[i] = _mm512_permutex2var_ps(a, ilo, b);
            x[i + h] = _mm512_permutex2var_ps(a, ihi, b);
        }
    }
}

// Masks of the lanes (rows) that see key position `key`.
static inline __mmask16 sees(__m512i last, int key) {
    return _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(key));
}

// 16 scores of S^T, times c where they are stored unscaled (the AMX products): rounded once, as
// a separate pass would store them (an explicit rounding, never fused with the next op).
static inline __m512 load_scores(const float* s, __m512 c, const int unscaled) {
    const __m512 x = _mm512_loadu_ps(s);
    return unscaled ? _mm512_mul_round_ps(x, c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                    : x;
}

// P^T pairs for n tile keys of one lane group: 2^(s - m), 0 where a row does not see the key
// (only checked when `masked`). Returns the lane-wise sum.
static inline __attribute__((always_inline)) __m512 exp_pairs(const float* s, uint32_t* p, int n,
                                                              int k0, __m512 m, __m512i last,
                                                              const int masked, __m512 c,
                                                              const int unscaled) {
    // bf16 of keys k, k + 1 interleaved: lanes 0..15 of cvtne2ps hold key k, 16..31 key k + 1.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 2) {
        __m512 e0 = exp2_ps(_mm512_sub_ps(load_scores(s + k * BLOCK_ROWS, c, unscaled), m));
        __m512 e1 =
            exp2_ps(_mm512_sub_ps(load_scores(s + (k + 1) * BLOCK_ROWS, c, unscaled), m));
        if (masked) {
            e0 = _mm512_maskz_mov_ps(sees(last, k0 + k), e0);
            e1 = _mm512_maskz_mov_ps(sees(last, k0 + k + 1), e1);
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        const __m512i pair = _mm512_permutexvar_epi16(interleave,
                                                      (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_storeu_si512(p + k / 2 * BLOCK_ROWS, pair);
    }
    return sum;
}

// Online softmax of one lane group over n tile keys starting at position k0: updates the running
// max m and sum l, writes P^T pairs and returns the rescale factor for O^T. `unscaled`: S^T is
// stored without the factor scale_log2 = c (qk_tiles), applied here as each score is read.
static inline __attribute__((always_inline)) __m512 softmax_lanes(
    const float* s, uint32_t* p, int n, int k0, float* m_row, float* l_row,
    const int32_t* last_row, __m512 c, const int unscaled) {
    const __m512i last = _mm512_loadu_si512(last_row);
    const int masked = sees(last, k0 + n - 1) != 0xFFFF;  // the causal diagonal crosses the tile
    const __m512 m_old = _mm512_loadu_ps(m_row);
    __m512 m0 = m_old, m1 = m_old;  // two chains: vmaxps latency
    for (int k = 0; k < n; k += 2) {
        const __m512 s0 = load_scores(s + k * BLOCK_ROWS, c, unscaled);
        const __m512 s1 = load_scores(s + (k + 1) * BLOCK_ROWS, c, unscaled);
        m0 = masked ? _mm512_mask_max_ps(m0, sees(last, k0 + k), m0, s0) : _mm512_max_ps(m0, s0);
        m1 = masked ? _mm512_mask_max_ps(m1, sees(last, k0 + k + 1), m1, s1)
                    : _mm512_max_ps(m1, s1);
    }
    const __m512 m = _mm512_max_ps(m0, m1);
    const __m512 sum = masked ? exp_pairs(s, p, n, k0, m, last, 1, c, unscaled)
                              : exp_pairs(s, p, n, k0, m, last, 0, c, unscaled);
    const __m512 alpha = exp2_ps(_mm512_sub_ps(m_old, m));
    _mm512_storeu_ps(m_row, m);
    _mm512_storeu_ps(l_row, _mm512_fmadd_ps(_mm512_loadu_ps(l_row), alpha, sum));
    return alpha;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUIRE_PREFILL_AMX 1

// Eight tiles of 16 rows x 64 bytes. S^T: 0, 1 and 5, 6 the float32 sums of two key blocks'
// lane groups 0 and 1; 2, 7 the A operands (16 keys x 32 dims of K, one per key block); 3, 4 the B
// operands (16 dim pairs of Q^T x 16 lanes, lane groups 0 and 1). O^T alike with two 16-dim
// blocks for the key blocks (A: 16 dims x 32 keys of V^T) and 16 key pairs of P^T as B. Two
// blocks at a time keep four independent chains on the tile unit.
static void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

// S^T[16 kb .. 16 kb + 16 keys][32 rows] for kb < key_blocks, unscaled: per 16 keys, one float32
// tile a lane group, summed over the head's dims 32 at a time in order (tdpbf16ps).
static inline void qk_tiles(const uint32_t* q, const uint16_t* k, float* s, int key_blocks,
                            const int D) {
    int kb = 0;
    for (; kb + 2 <= key_blocks; kb += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(5);
        _tile_zero(6);
        for (int h = 0; h < D / 32; h++) {
            _tile_loadd(3, q + h * 16 * 16, 16 * sizeof(uint32_t));
            _tile_loadd(4, q + (D / 2 + h * 16) * 16, 16 * sizeof(uint32_t));
            _tile_loadd(2, k + (int64_t)kb * 16 * D + h * 32, D * sizeof(uint16_t));
            _tile_loadd(7, k + (int64_t)(kb + 1) * 16 * D + h * 32, D * sizeof(uint16_t));
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
            _tile_dpbf16ps(5, 7, 3);
            _tile_dpbf16ps(6, 7, 4);
        }
        _tile_stored(0, s + kb * 16 * BLOCK_ROWS, BLOCK_ROWS * sizeof(float));
        _tile_stored(1, s + kb * 16 * BLOCK_ROWS + 16, BLOCK_ROWS * sizeof(float));
        _tile_stored(5, s + (kb + 1) * 16 * BLOCK_ROWS, BLOCK_ROWS * sizeof(float));
        _tile_stored(6, s + (kb + 1) * 16 * BLOCK_ROWS + 16, BLOCK_ROWS * sizeof(float));
    }
    if (kb < key_blocks) {
        _tile_zero(0);
        _tile_zero(1);
        for (int h = 0; h < D / 32; h++) {
            _tile_loadd(2, k + (int64_t)kb * 16 * D + h * 32, D * sizeof(uint16_t));
            _tile_loadd(3, q + h * 16 * 16, 16 * sizeof(uint32_t));
            _tile_loadd(4, q + (D / 2 + h * 16) * 16, 16 * sizeof(uint32_t));
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, s + kb * 16 * BLOCK_ROWS, BLOCK_ROWS * sizeof(float));
        _tile_stored(1, s + kb * 16 * BLOCK_ROWS + 16, BLOCK_ROWS * sizeof(float));
    }
}

// O^T[D][32 rows] = O^T * alpha (per lane) + V^T . P^T over the keys of `key_pairs` pairs (a
// multiple of 16; P^T zero past the block's keys): per 16 dims, one float32 tile a lane group,
// summed 32 keys at a time in order, two 16-dim blocks at a time (D is a multiple of 32). vt: V^T
// rows of the tile's first key, vt_stride apart.
static inline void pv_tiles(const uint32_t* p, const uint16_t* vt, int64_t vt_stride, float* o,
                            const __m512 alpha[2], int key_pairs, int o_zero, const int D) {
    // The rescale changes nothing (skipped) where O^T is still zero (`o_zero`: the block's first
    // key tile) or every lane's max stayed put (alpha exactly 1).
    for (int g = 0; g < 2 && !o_zero; g++) {
        if (_mm512_cmpeq_ps_mask(alpha[g], _mm512_set1_ps(1.0f)) == 0xFFFF) continue;
        for (int d = 0; d < D; d++)
            _mm512_storeu_ps(o + (g * D + d) * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(o + (g * D + d) * 16), alpha[g]));
    }
    for (int d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(0, o + d0 * 16, 16 * sizeof(float));
        _tile_loadd(1, o + (D + d0) * 16, 16 * sizeof(float));
        _tile_loadd(5, o + (d0 + 16) * 16, 16 * sizeof(float));
        _tile_loadd(6, o + (D + d0 + 16) * 16, 16 * sizeof(float));
        for (int kp = 0; kp < key_pairs; kp += 16) {
            _tile_loadd(3, p + kp * BLOCK_ROWS, BLOCK_ROWS * sizeof(uint32_t));
            _tile_loadd(4, p + kp * BLOCK_ROWS + 16, BLOCK_ROWS * sizeof(uint32_t));
            _tile_loadd(2, vt + d0 * vt_stride + 2 * kp, vt_stride * sizeof(uint16_t));
            _tile_loadd(7, vt + (d0 + 16) * vt_stride + 2 * kp, vt_stride * sizeof(uint16_t));
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
            _tile_dpbf16ps(5, 7, 3);
            _tile_dpbf16ps(6, 7, 4);
        }
        _tile_stored(0, o + d0 * 16, 16 * sizeof(float));
        _tile_stored(1, o + (D + d0) * 16, 16 * sizeof(float));
        _tile_stored(5, o + (d0 + 16) * 16, 16 * sizeof(float));
        _tile_stored(6, o + (D + d0 + 16) * 16, 16 * sizeof(float));
    }
}
#endif

static inline __attribute__((always_inline)) void attend(const Problem* pb, const Task* task,
                                                         Scratch* w, const int D) {
    const int s = task->seq, nt = task->num_tokens, group = pb->num_heads / pb->num_kv_heads;
    const int q0 = pb->query_start_loc[s] + task->token0;  // first token of the tile in q / out
    const int query_len = pb->query_start_loc[s + 1] - pb->query_start_loc[s];
    const int pos0 = pb->seq_lens[s] - query_len + task->token0;  // position of the first token
    const int rows = group * nt;
    const int padded_rows = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
    const int h0 = task->kv_head * group;
    memset(w->o, 0, (size_t)padded_rows * D * sizeof(float));
    for (int r0 = 0; r0 < padded_rows; r0 += 16) {  // Q^T: 16 rows' pairs transposed at a time
        const uint16_t* src[16];
        for (int r = r0; r < r0 + 16; r++) {
            const int g = r / nt, t = r % nt;
            src[r - r0] = r < rows ? pb->q + (q0 + t) * pb->q_stride + (h0 + g) * D : NULL;
            w->last[r] = r < rows ? pos0 + t : -1;
            w->m[r] = -1e30f;
            w->l[r] = 0.0f;
        }
        uint32_t* qt = w->q + (r0 / 16) * (D / 2) * 16;  // pair i of lane l: qt[i * 16 + l]
        for (int i0 = 0; i0 < D / 2; i0 += 16) {
            __m512 x[16];  // x[l]: row l's pairs i0 .. i0 + 15, then pair i0 + l of every row
            for (int l = 0; l < 16; l++)
                x[l] = src[l] ? _mm512_loadu_ps(src[l] + 2 * i0) : _mm512_setzero_ps();
            transpose_16x16(x);
            for (int l = 0; l < 16; l++) _mm512_storeu_ps(qt + (i0 + l) * 16, x[l]);
        }
    }
    const int64_t pack = pb->pack_offset[s] + (int64_t)task->kv_head * pb->padded_len[s] * D;
    const uint16_t* k_pack = pb->k_pack + pack;
    const uint16_t* v_pack = pb->v_pack + pack;
    const int num_keys = pos0 + nt;  // the tile's last token sees keys 0..num_keys - 1
    for (int k0 = 0; k0 < num_keys; k0 += KEY_TILE) {
        for (int r0 = 0; r0 < padded_rows; r0 += BLOCK_ROWS) {
            int last = -1;  // last key any row of the block sees
            for (int r = r0; r < r0 + BLOCK_ROWS; r++) last = w->last[r] > last ? w->last[r] : last;
            if (last < k0) continue;
            int n = last - k0 + 1;
            n = n > KEY_TILE ? KEY_TILE : (n + 7) / 8 * 8;
            const uint32_t* q = w->q + r0 / 16 * (D / 2) * 16;
#if defined(QUIRE_PREFILL_AMX)
            if (pb->amx) {
                qk_tiles(q, k_pack + (int64_t)k0 * D, w->s, (n + 15) / 16, D);
            } else
#endif
            {
                for (int c = 0; c < n; c += 8)
                    qk_kernel(q, k_pack + (int64_t)(k0 + c) * D, w->s + c * BLOCK_ROWS,
                              pb->scale_log2, D);
            }
            __m512 alpha[2];
            const __m512 c = _mm512_set1_ps(pb->scale_log2);
            for (int g = 0; g < 2; g++) {
                float *m = w->m + r0 + g * 16, *l = w->l + r0 + g * 16;
                const int32_t* last_row = w->last + r0 + g * 16;
                alpha[g] = pb->amx ? softmax_lanes(w->s + g * 16, w->p + g * 16, n, k0, m, l,
                                                   last_row, c, 1)
                                   : softmax_lanes(w->s + g * 16, w->p + g * 16, n, k0, m, l,
                                                   last_row, c, 0);
            }
#if defined(QUIRE_PREFILL_AMX)
            if (pb->amx) {  // keys past n up to the next 32 weigh nothing
                const int pairs = (n + 31) / 32 * 16;
                memset(w->p + n / 2 * BLOCK_ROWS, 0,
                       (size_t)(pairs - n / 2) * BLOCK_ROWS * sizeof(uint32_t));
                pv_tiles(w->p, v_pack + k0, pb->padded_len[s], w->o + r0 / 16 * D * 16, alpha,
                         pairs, k0 == 0, D);
                continue;
            }
#endif
            pv_kernel(w->p, v_pack + (int64_t)k0 * D, w->o + r0 / 16 * D * 16, alpha, n, D);
        }
    }
    // out = O / l, 16 dims of a lane group at a time transposed back to rows in registers.
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(w->l + r0));
        uint16_t* dst[16];
        for (int r = r0; r < r0 + 16; r++) {
            const int g = r / nt, t = r % nt;
            dst[r - r0] = r < rows ? pb->out + (q0 + t) * pb->out_stride + (h0 + g) * D : NULL;
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 x[16];  // x[i]: dim d0 + i of the 16 rows, then row i's dims d0 .. d0 + 15
            for (int i = 0; i < 16; i++)
                x[i] = _mm512_mul_ps(_mm512_loadu_ps(w->o + (r0 / 16 * D + d0 + i) * 16), inv);
            transpose_16x16(x);
            for (int i = 0; i < 16; i++)
                if (dst[i]) _mm256_storeu_si256((__m256i*)(dst[i] + d0),
                                                (__m256i)_mm512_cvtneps_pbh(x[i]));
        }
    }
}

// A quantized row (kv_quant.h: D codes, then the float32 scale) as bf16: each code's exact bf16
// value (kv_codes.h) widened, times the scale in float32, rounded to nearest even in integers
// (vcvtneps2bf16 would flush subnormals). D a multiple of 32.
static inline void dequantize_row(int kind, const char* row, int D, uint16_t* dst) {
    float scale;
    memcpy(&scale, row + D, sizeof(scale));
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i sub = subnormal_bf16(kind);
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int d = 0; d < D; d += 32) {
        const __m512i codes = kind == KV_INT8       ? codes_to_bf16(KV_INT8, row + d, sub)
                              : kind == KV_FP8_E4M3 ? codes_to_bf16(KV_FP8_E4M3, row + d, sub)
                                                    : codes_to_bf16(KV_FP8_E5M2, row + d, sub);
        for (int h = 0; h < 2; h++) {
            const __m256i b = h ? _mm512_extracti64x4_epi64(codes, 1) : _mm512_castsi512_si256(codes);
            const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            const __m512i u = _mm512_castps_si512(_mm512_mul_ps(value, s));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(half, odd));
            _mm256_storeu_si256((__m256i*)(dst + d + 16 * h),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
    }
}

// Key `key` of one (request, KV head) into the pack: its K row copied (or dequantized) into k_row,
// zeros at or past seq_len; returns its V row (dequantized into v_scratch for a quantized cache),
// or NULL past seq_len.
static const uint16_t* pack_key(const Problem* pb, int s, int kv_head, int key, uint16_t* k_row,
                                uint16_t* v_scratch) {
    const int D = pb->head_dim;
    if (key >= pb->seq_lens[s]) {
        memset(k_row, 0, D * 2);
        return NULL;
    }
    const int64_t at = row_offset(pb, s, kv_head, key);
    if (pb->kv_kind) {
        dequantize_row(pb->kv_kind, pb->k_cache + at, D, k_row);
        dequantize_row(pb->kv_kind, pb->v_cache + at, D, v_scratch);
        return v_scratch;
    }
    memcpy(k_row, pb->k_cache + at, D * 2);
    return (const uint16_t*)(pb->v_cache + at);
}

// pack_tile for the AMX loop: K rows as above, V transposed ([D][padded_len], the A tile of
// O^T), 16 keys x 32 dims at a time through a 16 x 16 transpose of dim pairs, then each pair's
// dims apart.
static void pack_tile_transposed(const Problem* pb, int s, int kv_head, int k0) {
    const int D = pb->head_dim;
    const int64_t pack = pb->pack_offset[s] + (int64_t)kv_head * pb->padded_len[s] * D;
    const int64_t stride = pb->padded_len[s];
    uint16_t* kp = pb->k_pack + pack + (int64_t)k0 * D;
    // 32 bf16 of 16 keys' dim pairs: the even dims (first dim of each pair), then the odd ones.
    const __m512i apart = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3,
                                           1, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                           2, 0);
    uint16_t v_dequantized[16][256] __attribute__((aligned(64)));  // head_dim <= 256
    for (int g = 0; g < KEY_TILE; g += 16) {
        const uint16_t* v_rows[16];
        for (int e = 0; e < 16; e++)
            v_rows[e] = pack_key(pb, s, kv_head, k0 + g + e, kp + (g + e) * D, v_dequantized[e]);
        uint16_t* vt = pb->v_pack + pack + k0 + g;
        for (int d = 0; d < D; d += 32) {
            __m512 x[16];  // x[e]: key e's dims d .. d + 31 as 16 pairs; then pair c of 16 keys
            for (int e = 0; e < 16; e++)
                x[e] = v_rows[e] ? _mm512_loadu_ps(v_rows[e] + d) : _mm512_setzero_ps();
            transpose_16x16(x);
            for (int c = 0; c < 16; c++) {
                const __m512i y = _mm512_permutexvar_epi16(apart, _mm512_castps_si512(x[c]));
                _mm256_storeu_si256((__m256i*)(vt + (d + 2 * c) * stride),
                                    _mm512_castsi512_si256(y));
                _mm256_storeu_si256((__m256i*)(vt + (d + 2 * c + 1) * stride),
                                    _mm512_extracti64x4_epi64(y, 1));
            }
        }
    }
}

// Packs keys [k0, k0 + KEY_TILE) of one (request, KV head) into the layouts described above;
// positions at or past seq_len are zeros.
static void pack_tile(const Problem* pb, int s, int kv_head, int k0) {
    if (pb->amx) {  // V^T [D][padded_len]: row d holds every key's dim d
        pack_tile_transposed(pb, s, kv_head, k0);
        return;
    }
    const int D = pb->head_dim;
    const int64_t pack = pb->pack_offset[s] + (int64_t)kv_head * pb->padded_len[s] * D;
    uint16_t* kp = pb->k_pack + pack + (int64_t)k0 * D;
    uint16_t* vp = pb->v_pack + pack + (int64_t)k0 * D;
    // Interleave 32 dims of two V rows a, b: (a[i], b[i]) for i < 16, then for 16 <= i < 32.
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    uint16_t v_dequantized[2][256] __attribute__((aligned(64)));  // head_dim <= 256
    for (int j = 0; j < KEY_TILE; j += 2) {  // a pair of keys
        const uint16_t* v_rows[2];
        for (int e = 0; e < 2; e++)
            v_rows[e] = pack_key(pb, s, kv_head, k0 + j + e, kp + (j + e) * D, v_dequantized[e]);
        const __m512i zero = _mm512_setzero_si512();
        for (int d = 0; d < D; d += 32) {
            const __m512i a = v_rows[0] ? _mm512_loadu_si512(v_rows[0] + d) : zero;
            const __m512i b = v_rows[1] ? _mm512_loadu_si512(v_rows[1] + d) : zero;
            _mm512_storeu_si512(vp + j * D + 2 * d, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(vp + j * D + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

static void run_task(const Problem* pb, const Task* task, Scratch* w) {
    switch (pb->head_dim) {  // compile-time head_dim for the kernels
        case 32: attend(pb, task, w, 32); break;
        case 64: attend(pb, task, w, 64); break;
        case 128: attend(pb, task, w, 128); break;
        default: attend(pb, task, w, 256); break;
    }
}

static int head_dim_supported(int head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
#elif defined(PREFILL_AVX2)
// ---------------------------------------------------------------------------------------------
// AVX2 (no AVX-512: Zen 1-3, Haswell to Skylake and client chips): the same tasks, key tiles and
// online softmax with query rows in the 8 lanes of a ymm, all in float32. Q^T holds q * scale *
// log2(e), K and V are packed as float32 rows (a quantized row as its bf16-rounded values, as
// above), and P stays float32:
//   S^T = K Q^T     kernel 4 keys x 24 rows: per dimension, three Q^T vectors times 4 broadcast
//                   keys, 12 accumulators; stored as [key][24];
//   softmax         online, base 2 (exp2_256), lane-wise; P^T stored as [key][24];
//   O^T += V^T P^T  kernel 4 dims x 24 rows: per key, three P^T vectors times 4 broadcast V
//                   values, O^T rescaled as it is loaded.
// A row's sums are in the same order whatever block, tile of tokens or thread it falls in, and
// the keys it does not see add exact zeros, so its bits depend on its query and context only.
// They are not the AVX-512 loop's bits.
#define SCRATCH_Q_BYTES(D) ((size_t)PADDED_ROWS * (D) * sizeof(float))
#define UNSEEN (-3.0e38f)  // a masked score: its exponential is 0 (exp2_256 gives 0 below -127)

// 2^x for x <= 0: exp2_ps's reduction and polynomial, 2^round(x) built in the exponent bits (0
// for x below -126.5, where exp2_ps gives a subnormal or 0). Cheaper than paged_decode.c's
// base-e exp256 with its degree-7 polynomial, as accurate here (BENCHMARKS.md).
static inline __m256 exp2_256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.3333558146428443e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

typedef struct {  // per-thread scratch, one task at a time
    float* q;     // Q^T [PADDED_ROWS / 8][head_dim][8]
    float* o;     // O^T [PADDED_ROWS / 8][head_dim][8]
    float m[PADDED_ROWS], l[PADDED_ROWS];  // running max and sum per row
    int32_t last[PADDED_ROWS];             // last key position row r sees; -1 for padding rows
    float s[KEY_TILE * BLOCK_ROWS];        // S^T of a row block [key][24]
    float p[KEY_TILE * BLOCK_ROWS];        // P^T of a row block [key][24]
} Scratch;

// S^T[4 keys][24 rows] = K[4 keys][D] . Q^T; q: the block's first lane group (the next two
// follow, D * 8 floats apart).
static inline __attribute__((always_inline)) void qk_kernel(const float* q, const float* k,
                                                            float* s, int D) {
    __m256 acc[4][3];
    for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = acc[j][2] = _mm256_setzero_ps();
    for (int i = 0; i < D; i++) {
        const __m256 q0 = _mm256_loadu_ps(q + i * 8);
        const __m256 q1 = _mm256_loadu_ps(q + (D + i) * 8);
        const __m256 q2 = _mm256_loadu_ps(q + (2 * D + i) * 8);
        for (int j = 0; j < 4; j++) {
            const __m256 kb = _mm256_broadcast_ss(k + j * D + i);
            acc[j][0] = _mm256_fmadd_ps(q0, kb, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(q1, kb, acc[j][1]);
            acc[j][2] = _mm256_fmadd_ps(q2, kb, acc[j][2]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int g = 0; g < 3; g++) _mm256_storeu_ps(s + j * BLOCK_ROWS + 8 * g, acc[j][g]);
}

// O^T[D][24 rows] = O^T * alpha (per lane) + V^T . P^T over n keys (a multiple of 4).
static inline __attribute__((always_inline)) void pv_kernel(const float* p, const float* v,
                                                            float* o, const __m256 alpha[3],
                                                            int n, int D) {
    for (int d0 = 0; d0 < D; d0 += 4) {
        __m256 acc[4][3];
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < 3; g++)
                acc[i][g] = _mm256_mul_ps(_mm256_loadu_ps(o + (g * D + d0 + i) * 8), alpha[g]);
        for (int k = 0; k < n; k++) {
            const __m256 p0 = _mm256_loadu_ps(p + k * BLOCK_ROWS);
            const __m256 p1 = _mm256_loadu_ps(p + k * BLOCK_ROWS + 8);
            const __m256 p2 = _mm256_loadu_ps(p + k * BLOCK_ROWS + 16);
            for (int i = 0; i < 4; i++) {
                const __m256 vb = _mm256_broadcast_ss(v + k * D + d0 + i);
                acc[i][0] = _mm256_fmadd_ps(p0, vb, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(p1, vb, acc[i][1]);
                acc[i][2] = _mm256_fmadd_ps(p2, vb, acc[i][2]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < 3; g++) _mm256_storeu_ps(o + (g * D + d0 + i) * 8, acc[i][g]);
    }
}

// Online softmax of one lane group over n tile keys from position k0: masks the scores of keys
// a row does not see (only where the causal diagonal crosses the tile), updates the running max
// m and sum l, writes P^T and returns the rescale factor for O^T.
static inline __m256 softmax_lanes(float* s, float* p, int n, int k0, float* m_row, float* l_row,
                                   const int32_t* last_row) {
    const __m256i last = _mm256_loadu_si256((const __m256i*)last_row);
    const __m256i beyond = _mm256_cmpgt_epi32(_mm256_set1_epi32(k0 + n - 1), last);
    if (!_mm256_testz_si256(beyond, beyond)) {
        for (int k = 0; k < n; k++) {  // key k0 + k is seen where last > k0 + k - 1
            const __m256 sees =
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(last, _mm256_set1_epi32(k0 + k - 1)));
            const __m256 score = _mm256_loadu_ps(s + k * BLOCK_ROWS);
            _mm256_storeu_ps(s + k * BLOCK_ROWS,
                             _mm256_blendv_ps(_mm256_set1_ps(UNSEEN), score, sees));
        }
    }
    const __m256 m_old = _mm256_loadu_ps(m_row);
    __m256 m0 = m_old, m1 = m_old;  // two chains: vmaxps latency
    for (int k = 0; k < n; k += 2) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + k * BLOCK_ROWS));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + (k + 1) * BLOCK_ROWS));
    }
    const __m256 m = _mm256_max_ps(m0, m1);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 2) {
        const __m256 e0 = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + k * BLOCK_ROWS), m));
        const __m256 e1 = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + (k + 1) * BLOCK_ROWS), m));
        _mm256_storeu_ps(p + k * BLOCK_ROWS, e0);
        _mm256_storeu_ps(p + (k + 1) * BLOCK_ROWS, e1);
        sum0 = _mm256_add_ps(sum0, e0);
        sum1 = _mm256_add_ps(sum1, e1);
    }
    const __m256 alpha = exp2_256(_mm256_sub_ps(m_old, m));
    _mm256_storeu_ps(m_row, m);
    _mm256_storeu_ps(l_row,
                     _mm256_fmadd_ps(_mm256_loadu_ps(l_row), alpha, _mm256_add_ps(sum0, sum1)));
    return alpha;
}

static void attend(const Problem* pb, const Task* task, Scratch* w) {
    const int D = pb->head_dim;
    const int s = task->seq, nt = task->num_tokens, group = pb->num_heads / pb->num_kv_heads;
    const int q0 = pb->query_start_loc[s] + task->token0;  // first token of the tile in q / out
    const int query_len = pb->query_start_loc[s + 1] - pb->query_start_loc[s];
    const int pos0 = pb->seq_lens[s] - query_len + task->token0;  // position of the first token
    const int rows = group * nt;
    const int padded_rows = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
    const int h0 = task->kv_head * group;
    memset(w->o, 0, (size_t)padded_rows * D * sizeof(float));
    for (int r = 0; r < padded_rows; r++) {  // Q^T: row r in lane r % 8 of lane group r / 8
        const int g = r / nt, t = r % nt;
        float* qt = w->q + (int64_t)(r / 8) * D * 8 + r % 8;
        const uint16_t* src = r < rows ? pb->q + (q0 + t) * pb->q_stride + (h0 + g) * D : NULL;
        for (int d = 0; d < D; d++)
            qt[d * 8] = src ? bf16_to_f32(src[d]) * pb->scale_log2 : 0.0f;
        w->last[r] = r < rows ? pos0 + t : -1;
        w->m[r] = -1e30f;
        w->l[r] = 0.0f;
    }
    const int64_t pack = pb->pack_offset[s] + (int64_t)task->kv_head * pb->padded_len[s] * D;
    const float* k_pack = pb->k_pack + pack;
    const float* v_pack = pb->v_pack + pack;
    const int num_keys = pos0 + nt;  // the tile's last token sees keys 0..num_keys - 1
    for (int k0 = 0; k0 < num_keys; k0 += KEY_TILE) {
        for (int r0 = 0; r0 < padded_rows; r0 += BLOCK_ROWS) {
            int last = -1;  // last key any row of the block sees
            for (int r = r0; r < r0 + BLOCK_ROWS; r++) last = w->last[r] > last ? w->last[r] : last;
            if (last < k0) continue;
            int n = last - k0 + 1;
            n = n > KEY_TILE ? KEY_TILE : (n + 3) / 4 * 4;
            const float* q = w->q + (int64_t)(r0 / 8) * D * 8;
            for (int c = 0; c < n; c += 4)
                qk_kernel(q, k_pack + (int64_t)(k0 + c) * D, w->s + c * BLOCK_ROWS, D);
            __m256 alpha[3];
            for (int g = 0; g < 3; g++)
                alpha[g] = softmax_lanes(w->s + 8 * g, w->p + 8 * g, n, k0, w->m + r0 + 8 * g,
                                         w->l + r0 + 8 * g, w->last + r0 + 8 * g);
            pv_kernel(w->p, v_pack + (int64_t)k0 * D, w->o + (int64_t)(r0 / 8) * D * 8, alpha, n,
                      D);
        }
    }
    for (int r = 0; r < rows; r++) {  // out = O / l
        const int g = r / nt, t = r % nt;
        const float inv = 1.0f / w->l[r];
        const float* o = w->o + (int64_t)(r / 8) * D * 8 + r % 8;
        uint16_t* dst = pb->out + (q0 + t) * pb->out_stride + (h0 + g) * D;
        for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d * 8] * inv);
    }
}

// Keys [k0, k0 + KEY_TILE) of one (request, KV head) as float32 rows into the K and V packs:
// bf16 rows widened exactly; a quantized row as code * scale rounded to bf16 (what the AVX-512
// loop reads); zeros at or past seq_len.
static void pack_tile(const Problem* pb, int s, int kv_head, int k0) {
    const int D = pb->head_dim;
    const int64_t pack = pb->pack_offset[s] + (int64_t)kv_head * pb->padded_len[s] * D;
    for (int j = 0; j < KEY_TILE; j++) {
        float* kp = pb->k_pack + pack + (int64_t)(k0 + j) * D;
        float* vp = pb->v_pack + pack + (int64_t)(k0 + j) * D;
        if (k0 + j >= pb->seq_lens[s]) {
            memset(kp, 0, D * sizeof(float));
            memset(vp, 0, D * sizeof(float));
            continue;
        }
        const int64_t at = row_offset(pb, s, kv_head, k0 + j);
        const char* rows[2] = {pb->k_cache + at, pb->v_cache + at};
        float* dst[2] = {kp, vp};
        for (int e = 0; e < 2; e++) {
            if (pb->kv_kind) {
                kv_dequant_row(pb->kv_kind, (const uint8_t*)rows[e], D, dst[e]);
                for (int d = 0; d < D; d++) dst[e][d] = bf16_to_f32(f32_to_bf16(dst[e][d]));
                continue;
            }
            for (int d = 0; d < D; d += 8) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(rows[e] + 2 * d));
                _mm256_storeu_ps(dst[e] + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                                 _mm256_cvtepu16_epi32(b), 16)));
            }
        }
    }
}

static void run_task(const Problem* pb, const Task* task, Scratch* w) { attend(pb, task, w); }

static int head_dim_supported(int head_dim) {
    return head_dim % 8 == 0 && head_dim >= 8 && head_dim <= 256;
}
#endif

#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)
static int by_work_descending(const void* a, const void* b) {
    const int64_t x = ((const Task*)a)->work, y = ((const Task*)b)->work;
    return (x < y) - (x > y);
}

static void* alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }
#endif

// 1 where S^T and O^T run on AMX tiles: where gemv_bf16 runs on them (the AMX order, gemv.c),
// so that switching AMX off (QUIRE_CPU_AMX=0) gives the AVX-512 BF16 kernels everywhere.
int prefill_attention_uses_amx(void) {
#if defined(QUIRE_PREFILL_AMX)
    return gemv_bf16_uses_amx();
#else
    return 0;
#endif
}

// Which loop the kernel runs in this build: 2 AVX-512 BF16 (or AMX tiles, above), 1 AVX2, 0 none
// (prefill_attention_bf16 returns -2).
int prefill_attention_path(void) {
#if defined(PREFILL_AVX512)
    return 2;
#elif defined(PREFILL_AVX2)
    return 1;
#else
    return 0;
#endif
}

// kv_kind: 0 for a bf16 cache, else its quantized format (kv_quant.h). Returns 0; -1 for an
// unsupported shape, format or inconsistent lengths; -2 when built without AVX-512 BF16; -3
// when out of memory.
int prefill_attention_bf16(const uint16_t* q, const void* k_cache, const void* v_cache,
                           const int32_t* block_tables, const int32_t* query_start_loc,
                           const int32_t* seq_lens, uint16_t* out, int64_t q_stride,
                           int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks, float scale,
                           int kv_kind, int num_threads) {
#if defined(PREFILL_AVX512) || defined(PREFILL_AVX2)
    if (kv_kind < 0 || kv_kind > KV_FP8_E5M2) return -1;
    // At least 8 tokens of the GQA group per task.
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads * 8 > MAX_ROWS ||
        !head_dim_supported(head_dim))
        return -1;
    for (int s = 0; s < num_seqs; s++) {
        const int query_len = query_start_loc[s + 1] - query_start_loc[s];
        if (query_len < 0 || seq_lens[s] < query_len ||
            seq_lens[s] > (int64_t)max_blocks * block_size)
            return -1;
    }
    const int group = num_heads / num_kv_heads;
    // Query tokens per task: fill up to MAX_ROWS rows, fewer when that leaves threads idle.
    int tile_tokens = MAX_ROWS / group < MAX_TILE_TOKENS ? MAX_ROWS / group : MAX_TILE_TOKENS;
    int64_t num_tasks = 0, num_pack_items = 0, pack_elems = 0;
    for (;;) {
        num_tasks = 0;
        for (int s = 0; s < num_seqs; s++) {
            const int query_len = query_start_loc[s + 1] - query_start_loc[s];
            num_tasks += (int64_t)(query_len + tile_tokens - 1) / tile_tokens * num_kv_heads;
        }
        if (num_tasks >= 4 * num_threads || tile_tokens <= 8) break;
        tile_tokens /= 2;
    }
    if (num_tasks == 0) return 0;  // no query tokens
    int64_t* pack_offset = malloc(num_seqs * sizeof *pack_offset);
    int* padded_len = malloc(num_seqs * sizeof *padded_len);
    Task* tasks = malloc(num_tasks * sizeof *tasks);
    if (!pack_offset || !padded_len || !tasks) {
        free(pack_offset), free(padded_len), free(tasks);
        return -3;
    }
    num_tasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int query_len = query_start_loc[s + 1] - query_start_loc[s];
        padded_len[s] = (seq_lens[s] + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
        pack_offset[s] = pack_elems;
        pack_elems += (int64_t)padded_len[s] * num_kv_heads * head_dim;
        num_pack_items += (int64_t)padded_len[s] / KEY_TILE * num_kv_heads;
        for (int t0 = 0; t0 < query_len; t0 += tile_tokens) {
            const int nt = query_len - t0 < tile_tokens ? query_len - t0 : tile_tokens;
            const int64_t keys = seq_lens[s] - query_len + t0 + nt;
            for (int h = 0; h < num_kv_heads; h++)
                tasks[num_tasks++] = (Task){s, h, t0, nt, keys * nt};
        }
    }
    qsort(tasks, num_tasks, sizeof *tasks, by_work_descending);
    Problem pb = {.q = q,
                  .k_cache = k_cache,
                  .v_cache = v_cache,
                  .kv_kind = kv_kind,
                  .block_tables = block_tables,
                  .query_start_loc = query_start_loc,
                  .seq_lens = seq_lens,
                  .out = out,
                  .q_stride = q_stride,
                  .out_stride = out_stride,
                  .num_heads = num_heads,
                  .num_kv_heads = num_kv_heads,
                  .head_dim = head_dim,
                  .block_size = block_size,
                  .max_blocks = max_blocks,
                  .scale_log2 = scale * 1.4426950408889634f,
                  .k_pack = alloc64(pack_elems * sizeof(PackElem)),
                  .v_pack = alloc64(pack_elems * sizeof(PackElem)),
                  .pack_offset = pack_offset,
                  .padded_len = padded_len,
                  .amx = prefill_attention_uses_amx()};
    Scratch* scratch = calloc(num_threads, sizeof *scratch);
    int status = pb.k_pack && pb.v_pack && scratch ? 0 : -3;
    for (int i = 0; status == 0 && i < num_threads; i++) {
        scratch[i].q = alloc64(SCRATCH_Q_BYTES(head_dim));
        scratch[i].o = alloc64((size_t)PADDED_ROWS * head_dim * sizeof(float));
        if (!scratch[i].q || !scratch[i].o) status = -3;
    }
    if (status == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            // Pack items are (request, KV head, KEY_TILE keys), numbered request by request; a
            // thread's items come in increasing order, so it walks the requests forward.
            int s = 0;
            int64_t first = 0;  // first item of request s
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_pack_items; i++) {
                while (i >= first + (int64_t)padded_len[s] / KEY_TILE * num_kv_heads)
                    first += (int64_t)padded_len[s++] / KEY_TILE * num_kv_heads;
                const int tiles = padded_len[s] / KEY_TILE, item = (int)(i - first);
                pack_tile(&pb, s, item / tiles, item % tiles * KEY_TILE);
            }
            Scratch* w = &scratch[omp_get_thread_num()];
#if defined(QUIRE_PREFILL_AMX)
            if (pb.amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_tasks; i++) run_task(&pb, &tasks[i], w);
#if defined(QUIRE_PREFILL_AMX)
            if (pb.amx) _tile_release();
#endif
        }
    }
    for (int i = 0; scratch && i < num_threads; i++) free(scratch[i].q), free(scratch[i].o);
    free(scratch);
    free(pb.k_pack), free(pb.v_pack), free(pack_offset), free(padded_len), free(tasks);
    return status;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)query_start_loc;
    (void)seq_lens, (void)out, (void)q_stride, (void)out_stride, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)max_blocks, (void)scale;
    (void)kv_kind, (void)num_threads;
    return -2;
#endif
}
