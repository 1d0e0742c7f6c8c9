// LoRA deltas beside a linear: each token row t with an adapter slot s (-1: none) gets
//   out[t] += B[s] (A[s] x[t])
// for the fused modules of the layer (q|k|v, gate|up: A's ranks one under the other, B's output
// columns side by side), summed in float32 and rounded once into out. x, out and the stacks are
// all bf16 or all float32 (the model's dtype); A carries the adapter's scale.
//
// Batch invariance: every number is computed in an order fixed by the shapes alone. u[t][j]
// (shrink) is x[t] . A[s][j]: 16 float32 lanes along the input, a tree over the lanes, then
// the tail; each output column (expand) sums u[t][r] B[s][r][col] over the ranks in order, then
// is added to out. So a row's bits do not depend on the other rows, the thread count, or the
// slot.
//
// Speed: decode is bound by the bytes read, so each slot's stacks are read once per call,
// whatever the number of its rows: the rows are grouped by slot, and the threads split a
// group's ranks (shrink) and output columns (expand), not its rows, so a lone row (batch 1)
// streams its adapter on every thread. Blocks of ROWS rows by RANKS ranks (shrink) or VECS
// column vectors (expand) share each load and keep independent sums in registers; a leftover
// row or rank goes through the same sums alone. One barrier between the two phases.
//
// At a few rows a decode step's projection on GGUF blocks runs its deltas in its own parallel
// region (qmatmul_lora_bf16): the same shrink and expand, split as here, with no region or
// barrier of their own.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

#define COLS 64  // output columns of one expand work item
#define VECS (COLS / 16)  // its vectors, which one expand block writes at once
#define ROWS 4  // rows that share each load of A or B
#define RANKS 4  // rows of A (ranks) one shrink block reads at once

// 16 values at p[i..i+16) of a bf16 (is_bf16) or float32 array, as float32 (exactly).
static inline f32x16 load_16(const void* p, int64_t i, int is_bf16) {
    f32x16 v;
#if defined(__AVX512F__)
    // one zero-extension and a shift (the generic conversion below compiles to five steps)
    if (is_bf16) return (f32x16)widen_16((const uint16_t*)p + i);
#endif
    if (is_bf16) {
        u16x16 h;
        memcpy(&h, (const uint16_t*)p + i, sizeof h);
        const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
        memcpy(&v, &w, sizeof v);
    } else {
        memcpy(&v, (const float*)p + i, sizeof v);
    }
    return v;
}

static inline float load_1(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// The 16 lanes' sum as a tree: the halves added, 4 times.
static inline float lanes_sum(f32x16 v) {
    const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

// sums[i][j] = x_i . a_j over n values, for `rows` rows of x (x_i = x + order[i] * x_stride)
// and `ranks` rows of a (row stride n), x and a both bf16 or both float32: 16 lanes summed
// along the input, then the lanes (lanes_sum), then the tail. Called with constant rows (ROWS
// or 1) and ranks (RANKS or 1), so the sums stay in registers; each sum is in the same order
// whatever the block.
static inline __attribute__((always_inline)) void dot_block(const void* x, int64_t x_stride,
                                                            const int64_t* order, const void* a,
                                                            int n, int is_bf16, int rows,
                                                            int ranks, float sums[][RANKS]) {
    f32x16 acc[ROWS][RANKS] = {{{0}}};
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        f32x16 xv[ROWS];
        for (int i = 0; i < rows; i++) xv[i] = load_16(x, order[i] * x_stride + k, is_bf16);
        for (int j = 0; j < ranks; j++) {
            const f32x16 av = load_16(a, (int64_t)j * n + k, is_bf16);
            for (int i = 0; i < rows; i++) acc[i][j] += xv[i] * av;
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < ranks; j++) {
            float sum = lanes_sum(acc[i][j]);
            for (int t = k; t < n; t++)
                sum += load_1(x, order[i] * x_stride + t, is_bf16) *
                       load_1(a, (int64_t)j * n + t, is_bf16);
            sums[i][j] = sum;
        }
}

// delta[i][v] = the sum over r of u_i[r] b[r][16 v .. 16 v + 16) in order of r, for `rows`
// rows (ROWS or 1; u_i = u + i * u_stride) and `vecs` vectors of columns (VECS or 1); b (bf16
// or float32) rows b_stride apart. Constant blocks, as dot_block.
static inline __attribute__((always_inline)) void expand_block(const float* u, int64_t u_stride,
                                                               const void* b, int64_t b_stride,
                                                               int max_rank, int is_bf16,
                                                               int rows, int vecs,
                                                               f32x16 delta[][VECS]) {
    f32x16 acc[ROWS][VECS] = {{{0}}};
    for (int r = 0; r < max_rank; r++)
        for (int v = 0; v < vecs; v++) {
            const f32x16 bv = load_16(b, r * b_stride + 16 * v, is_bf16);
            for (int i = 0; i < rows; i++) acc[i][v] += u[i * u_stride + r] * bv;
        }
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < vecs; v++) delta[i][v] = acc[i][v];
}

// y[0..n) = y + d, rounded once to y's dtype (bf16 as f32_to_bf16 rounds, 16 at a time).
static inline void add_rounded(void* y, const float* d, int n, int is_bf16) {
    int o = 0;
    if (is_bf16) {
        uint16_t* yb = y;
        for (; o + 16 <= n; o += 16) {
            f32x16 dv;
            memcpy(&dv, d + o, sizeof dv);
            const f32x16 sum = load_16(yb, o, 1) + dv;
            u32x16 bits;
            memcpy(&bits, &sum, sizeof bits);
            const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
            const u16x16 h = __builtin_convertvector(rounded, u16x16);
            memcpy(yb + o, &h, sizeof h);
        }
        for (; o < n; o++) yb[o] = f32_to_bf16(bf16_to_f32(yb[o]) + d[o]);
    } else {
        float* yf = y;
        for (; o < n; o++) yf[o] += d[o];
    }
}

// Asks for bytes [p, p + n) in L2 (prefetcht1) without waiting: a call's reads are short and
// cold (the base weights streamed through since the last step), so they are asked for at once.
static inline void prefetch(const void* p, int64_t n) {
    for (int64_t k = 0; k < n; k += 64) __builtin_prefetch((const char*)p + k, 0, 2);
}

static float* aligned_floats(int64_t n) {
    const size_t bytes = ((sizeof(float) * (size_t)n + 63) / 64) * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

// The rows with a slot, grouped by slot (by first appearance; rows in order inside a group):
// order [rows], group_start [groups + 1]. Returns the group count.
static int group_rows(const int32_t* token_slots, int64_t tokens, int64_t* order,
                      int64_t* group_start, int32_t* group_slot) {
    int groups = 0;
    int64_t rows = 0;
    for (int64_t t = 0; t < tokens; t++) {
        const int slot = token_slots[t];
        if (slot < 0) continue;
        int seen = 0;
        for (int g = 0; g < groups && !seen; g++) seen = group_slot[g] == slot;
        if (seen) continue;
        group_slot[groups] = slot;
        group_start[groups++] = rows;
        for (int64_t r = t; r < tokens; r++)
            if (token_slots[r] == slot) order[rows++] = r;
    }
    group_start[groups] = rows;
    return groups;
}

// The expand of `n` rows (ROWS at a time) by one column piece: delta[i] = u_i B[:, cols] for
// u_i = u + i * ranks + module's ranks, its columns [lo, hi) added to out row order[i] (rounded
// once; a column's delta does not depend on lo and hi).
static void expand_rows(const float* u, int ranks, int max_rank, const void* b, int64_t b_stride,
                        int b_bf16, int cols, int lo, int hi, const int64_t* order, int64_t n,
                        void* out, int64_t out_stride, int first, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4, b_elem = b_bf16 ? 2 : 4;
    for (int64_t i = 0; i < n;) {
        const int rows = i + ROWS <= n ? ROWS : 1;
        const float* ui = u + i * ranks;
        float delta[ROWS][COLS] __attribute__((aligned(64)));
        f32x16 d[ROWS][VECS];
        int o = 0;
        if (cols == COLS) {
            if (rows == ROWS)
                expand_block(ui, ranks, b, b_stride, max_rank, b_bf16, ROWS, VECS, d);
            else
                expand_block(ui, ranks, b, b_stride, max_rank, b_bf16, 1, VECS, d);
            for (int k = 0; k < rows; k++) memcpy(delta[k], d[k], sizeof d[k]);
            o = COLS;
        }
        for (; o + 16 <= cols; o += 16) {
            const void* bo = (const char*)b + o * b_elem;
            if (rows == ROWS)
                expand_block(ui, ranks, bo, b_stride, max_rank, b_bf16, ROWS, 1, d);
            else
                expand_block(ui, ranks, bo, b_stride, max_rank, b_bf16, 1, 1, d);
            for (int k = 0; k < rows; k++) memcpy(&delta[k][o], &d[k][0], sizeof d[k][0]);
        }
        for (; o < cols; o++)
            for (int k = 0; k < rows; k++) {
                float acc = 0.0f;
                for (int r = 0; r < max_rank; r++)
                    acc += ui[k * ranks + r] * load_1(b, r * b_stride + o, b_bf16);
                delta[k][o] = acc;
            }
        for (int k = 0; k < rows; k++)
            add_rounded((char*)out + (order[i + k] * out_stride + first + lo) * elem,
                        delta[k] + lo, hi - lo, is_bf16);
        i += rows;
    }
}

// The shrink of `n` rows (x_i = x + order[i] * x_stride) by ranks [j0, j1) of a (rows `in`
// apart) into u [n, ranks]: RANKS ranks by ROWS rows at a time.
static void shrink_rows(const void* x, int64_t x_stride, const int64_t* order, int64_t n,
                        const void* a, int in, int is_bf16, int j0, int j1, float* u, int ranks) {
    const size_t elem = is_bf16 ? 2 : 4;
    for (int j = j0; j < j1;) {
        const int nj = j + RANKS <= j1 ? RANKS : 1;
        const void* aj = (const char*)a + (int64_t)j * in * elem;
        for (int64_t i = 0; i < n;) {
            const int ni = i + ROWS <= n ? ROWS : 1;
            float sums[ROWS][RANKS];
            if (ni == ROWS && nj == RANKS)
                dot_block(x, x_stride, order + i, aj, in, is_bf16, ROWS, RANKS, sums);
            else if (ni == ROWS)
                dot_block(x, x_stride, order + i, aj, in, is_bf16, ROWS, 1, sums);
            else if (nj == RANKS)
                dot_block(x, x_stride, order + i, aj, in, is_bf16, 1, RANKS, sums);
            else
                dot_block(x, x_stride, order + i, aj, in, is_bf16, 1, 1, sums);
            for (int k = 0; k < ni; k++)
                for (int r = 0; r < nj; r++) u[(i + k) * ranks + j + r] = sums[k][r];
            i += ni;
        }
        j += nj;
    }
}

// values [n] of a bf16 (is_bf16) or float32 array as float32 into w (exactly).
static void widen(const void* v, int64_t n, int is_bf16, float* w) {
    if (is_bf16)
        for (int64_t i = 0; i < n; i++) w[i] = bf16_to_f32(((const uint16_t*)v)[i]);
    else
        memcpy(w, v, sizeof(float) * (size_t)n);
}

// Groups of at least this many rows (a prompt chunk, or many decode rows of one adapter) are
// split by rows between the threads, TILE rows at a time: see lora_add.
#define SPLIT_ROWS 24
#define TILE 64

// x [tokens, in] (row stride x_stride), out [tokens, out] (row stride out_stride);
// lora_a [slots, modules * max_rank, in], lora_b [slots, max_rank, out] (B transposed); all
// bf16 (is_bf16) or all float32. token_slots [tokens]; out_slices [modules][2]: each module's
// first output column and width. Returns 0, or -1 for shapes it does not take or no memory.
//
// Two kinds of group. A small one (decode rows, up to SPLIT_ROWS) is bound by the bytes of its
// adapter: the threads split its ranks (shrink), then, after a barrier, its column pieces
// (expand). A large one is bound by arithmetic: each thread takes a contiguous share of its rows,
// widens the slot's A and B to float32 once (so the inner loops convert nothing; the sums are
// the same), and goes through its rows a tile at a time, widened too, the tile's shrink and
// expand back to back while its x, u and out rows are in cache.
int lora_add(int is_bf16, const void* x, int64_t x_stride, void* out, int64_t out_stride,
             const void* lora_a, const void* lora_b, const int32_t* token_slots,
             const int32_t* out_slices, int modules, int64_t tokens, int in, int out_features,
             int max_rank, int num_threads) {
    const int ranks = modules * max_rank;
    if (in < 1 || out_features < 1 || ranks < 1 || tokens < 0) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
    const int max_items = out_features / COLS + modules;
    int64_t* order = malloc(sizeof(int64_t) * (tokens + 1));
    int64_t* group_start = malloc(sizeof(int64_t) * (tokens + 1));
    int32_t* group_slot = malloc(sizeof(int32_t) * (tokens + 1));
    int32_t* small = malloc(sizeof(int32_t) * (tokens + 1));  // the small groups
    int* item_module = malloc(sizeof(int) * max_items);
    int* item_first = malloc(sizeof(int) * max_items);
    float* u = NULL;
    int failed = !order || !group_start || !group_slot || !small || !item_module || !item_first;
    int groups = 0, items = 0, smalls = 0, larges = 0;
    int64_t rows = 0;
    if (!failed) {
        groups = group_rows(token_slots, tokens, order, group_start, group_slot);
        rows = group_start[groups];
        for (int g = 0; g < groups; g++) {
            if (group_start[g + 1] - group_start[g] < SPLIT_ROWS)
                small[smalls++] = g;
            else
                larges++;
        }
        // expand's work items per group: each module's columns in pieces of COLS
        for (int m = 0; m < modules; m++)
            for (int c = 0; c < out_slices[2 * m + 1]; c += COLS) {
                item_module[items] = m;
                item_first[items++] = out_slices[2 * m] + c;
            }
        u = aligned_floats(rows * ranks);  // [rows, ranks] in group order
        failed = !u;
    }
    const int threads = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 0 && !failed)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        // the small groups: this thread's shares, (group, rank) pairs of the shrink and (group,
        // column piece) pairs of the expand; their rows of A and pieces of B are asked for first
        const int64_t pairs = failed ? 0 : (int64_t)smalls * ranks;
        const int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
        const int64_t pieces = failed ? 0 : (int64_t)smalls * items;
        const int64_t q0 = pieces * t / nt, q1 = pieces * (t + 1) / nt;
        for (int64_t p = p0; p < p1; p++)
            prefetch((const char*)lora_a +
                         ((int64_t)group_slot[small[p / ranks]] * ranks + p % ranks) * in * elem,
                     in * elem);
        for (int64_t q = q0; q < q1; q++) {
            const int m = item_module[q % items], first = item_first[q % items];
            const int end = out_slices[2 * m] + out_slices[2 * m + 1];
            const int64_t at =
                (int64_t)group_slot[small[q / items]] * max_rank * out_features + first;
            for (int r = 0; r < max_rank; r++)
                prefetch((const char*)lora_b + (at + (int64_t)r * out_features) * elem,
                         (end - first < COLS ? end - first : COLS) * elem);
        }
        // shrink: each rank's row of A read once for its group's rows, RANKS at a time
        for (int64_t p = p0; p < p1;) {
            const int g = small[p / ranks], j = p % ranks;
            const int j1 = j + RANKS <= ranks && p + RANKS <= p1 ? j + RANKS : j + 1;
            const void* a = (const char*)lora_a + (int64_t)group_slot[g] * ranks * in * elem;
            const int64_t g0 = group_start[g];
            shrink_rows(x, x_stride, order + g0, group_start[g + 1] - g0, a, in, is_bf16, j, j1,
                        u + g0 * ranks, ranks);
            p += j1 - j;
        }
        // the large groups, which need no barrier: a thread expands only the rows it shrank
        float *aw = NULL, *bw = NULL, *xw = NULL;
        int64_t* tile_order = NULL;
        if (larges && !failed) {
            aw = aligned_floats((int64_t)ranks * in);
            bw = aligned_floats((int64_t)max_rank * out_features);
            xw = aligned_floats((int64_t)TILE * in);
            tile_order = malloc(sizeof(int64_t) * TILE);
        }
        const int large_ok = aw && bw && xw && tile_order;
        if (larges && !failed && !large_ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int g = 0; g < groups && large_ok; g++) {
            const int64_t g0 = group_start[g], n = group_start[g + 1] - g0;
            if (n < SPLIT_ROWS) continue;
            const int64_t r0 = g0 + n * t / nt, r1 = g0 + n * (t + 1) / nt;
            widen((const char*)lora_a + (int64_t)group_slot[g] * ranks * in * elem,
                  (int64_t)ranks * in, is_bf16, aw);
            widen((const char*)lora_b + (int64_t)group_slot[g] * max_rank * out_features * elem,
                  (int64_t)max_rank * out_features, is_bf16, bw);
            for (int64_t i = 0; i < TILE; i++) tile_order[i] = i;
            for (int64_t r = r0; r < r1; r += TILE) {
                const int64_t m = r1 - r < TILE ? r1 - r : TILE;
                for (int64_t i = 0; i < m; i++)
                    widen((const char*)x + order[r + i] * x_stride * elem, in, is_bf16,
                          xw + i * in);
                float* ur = u + r * ranks;
                shrink_rows(xw, in, tile_order, m, aw, in, 0, 0, ranks, ur, ranks);
                for (int q = 0; q < items; q++) {
                    const int mod = item_module[q], first = item_first[q];
                    const int end = out_slices[2 * mod] + out_slices[2 * mod + 1];
                    const int cols = end - first < COLS ? end - first : COLS;
                    expand_rows(ur + mod * max_rank, ranks, max_rank, bw + first, out_features,
                                0, cols, 0, cols, order + r, m, out, out_stride, first, is_bf16);
                }
            }
        }
        free(aw), free(bw), free(xw), free(tile_order);
#pragma omp barrier
        // expand of the small groups: this thread's (group, column piece) pairs, each piece of
        // B read once for its group's rows
        for (int64_t q = q0; q < q1 && !failed; q++) {
            const int g = small[q / items], m = item_module[q % items];
            const int first = item_first[q % items];
            const int end = out_slices[2 * m] + out_slices[2 * m + 1];
            const void* b = (const char*)lora_b +
                            ((int64_t)group_slot[g] * max_rank * out_features + first) * elem;
            const int64_t g0 = group_start[g];
            const int cols = end - first < COLS ? end - first : COLS;
            expand_rows(u + g0 * ranks + m * max_rank, ranks, max_rank, b, out_features, is_bf16,
                        cols, 0, cols, order + g0, group_start[g + 1] - g0, out, out_stride,
                        first, is_bf16);
        }
    }
    free(u), free(order), free(group_start), free(group_slot), free(small);
    free(item_module), free(item_first);
    return failed ? -1 : 0;
}

// lora_add's deltas as the ColumnEpilogue of the projection they sit beside: its arguments, the
// rows grouped by slot once, and the rows' shrink.
typedef struct {
    const void *x, *lora_a, *lora_b;
    void* out;
    const int32_t* out_slices;
    int64_t x_stride, out_stride;
    int64_t* order;  // [rows] the rows with a slot, grouped by slot
    int64_t* group_start;  // [groups + 1]
    int32_t* group_slot;  // [groups]
    float* u;  // [rows, modules * max_rank], the shrink
    int is_bf16, modules, in, out_features, max_rank, groups;
} LoRAColumns;

static void lora_columns_free(LoRAColumns* L) {
    free(L->order), free(L->group_start), free(L->group_slot), free(L->u);
    L->order = L->group_start = NULL, L->group_slot = NULL, L->u = NULL;
}

// lora_add's grouping and shrink buffer for lora_shrink_part and lora_expand_columns. Returns 0,
// or -1 for shapes lora_add does not take or no memory.
static int lora_columns_init(LoRAColumns* L, int is_bf16, const void* x, int64_t x_stride,
                             void* out, int64_t out_stride, const void* lora_a,
                             const void* lora_b, const int32_t* token_slots,
                             const int32_t* out_slices, int modules, int64_t tokens, int in,
                             int out_features, int max_rank) {
    const int ranks = modules * max_rank;
    *L = (LoRAColumns){.x = x, .lora_a = lora_a, .lora_b = lora_b, .out = out,
                       .out_slices = out_slices, .x_stride = x_stride, .out_stride = out_stride,
                       .is_bf16 = is_bf16, .modules = modules, .in = in,
                       .out_features = out_features, .max_rank = max_rank};
    if (in < 1 || out_features < 1 || ranks < 1 || tokens < 0) return -1;
    L->order = malloc(sizeof(int64_t) * (tokens + 1));
    L->group_start = malloc(sizeof(int64_t) * (tokens + 1));
    L->group_slot = malloc(sizeof(int32_t) * (tokens + 1));
    if (!L->order || !L->group_start || !L->group_slot) return lora_columns_free(L), -1;
    L->groups = group_rows(token_slots, tokens, L->order, L->group_start, L->group_slot);
    L->u = aligned_floats(L->group_start[L->groups] * ranks);
    if (!L->u) return lora_columns_free(L), -1;
    return 0;
}

// Thread t of nt's share of the shrink, as lora_add splits a small group's: (group, rank) pairs.
static void lora_shrink_part(const void* ctx, int t, int nt) {
    const LoRAColumns* L = ctx;
    const int ranks = L->modules * L->max_rank;
    const size_t elem = L->is_bf16 ? 2 : 4;
    const int64_t pairs = (int64_t)L->groups * ranks;
    const int64_t p1 = pairs * (t + 1) / nt;
    for (int64_t p = pairs * t / nt; p < p1;) {
        const int g = (int)(p / ranks), j = (int)(p % ranks);
        const int j1 = (int)(j + (p1 - p) < ranks ? j + (p1 - p) : ranks);
        const int64_t g0 = L->group_start[g];
        shrink_rows(L->x, L->x_stride, L->order + g0, L->group_start[g + 1] - g0,
                    (const char*)L->lora_a + L->group_slot[g] * (int64_t)ranks * L->in * elem,
                    L->in, L->is_bf16, j, j1, L->u + g0 * ranks, ranks);
        p += j1 - j;
    }
}

// The expand of lora_add for the output columns [c0, c1) alone, on the calling thread, once
// every part of the shrink is done: each piece is lora_add's piece, computed as lora_add
// computes it, and only its columns in [c0, c1) added, so the bits are lora_add's whatever the
// columns.
static void lora_expand_columns(const void* ctx, int c0, int c1) {
    const LoRAColumns* L = ctx;
    const int ranks = L->modules * L->max_rank, max_rank = L->max_rank;
    const size_t elem = L->is_bf16 ? 2 : 4;
    for (int m = 0; m < L->modules; m++) {
        const int first = L->out_slices[2 * m], end = first + L->out_slices[2 * m + 1];
        if (end <= c0 || first >= c1) continue;
        const int piece0 = first + (c0 > first ? (c0 - first) / COLS * COLS : 0);
        for (int g = 0; g < L->groups; g++) {
            const int64_t g0 = L->group_start[g], n = L->group_start[g + 1] - g0;
            const int64_t slot = L->group_slot[g];
            for (int p = piece0; p < end && p < c1; p += COLS) {
                const int cols = end - p < COLS ? end - p : COLS;
                const int lo = c0 > p ? c0 - p : 0, hi = c1 - p < cols ? c1 - p : cols;
                const void* b =
                    (const char*)L->lora_b + (slot * max_rank * L->out_features + p) * elem;
                expand_rows(L->u + g0 * ranks + m * max_rank, ranks, max_rank, b,
                            L->out_features, L->is_bf16, cols, lo, hi, L->order + g0, n, L->out,
                            L->out_stride, p, L->is_bf16);
            }
        }
    }
}

// A projection on GGUF blocks (qmatmul_bf16_then: every format, in parts too) with its rows'
// adapter deltas (lora_add's arguments) in one parallel region: the shrink split between the
// threads before the barrier the matmul has anyway, then each thread's expand on the columns it
// has just written. y = x W^T (+ b) + each row's delta, with lora_add's bits whatever the
// threads. Where rows of one adapter are many, lora_add (its row split, on widened stacks) does
// more per byte. Returns 0, -3 out of memory, or qmatmul_bf16_then's failure.
int qmatmul_lora_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y, int64_t y_stride, int M, int N, int K,
                      const uint16_t* lora_a, const uint16_t* lora_b, const int32_t* token_slots,
                      const int32_t* out_slices, int modules, int max_rank, int num_threads) {
    LoRAColumns deltas;
    if (lora_columns_init(&deltas, 1, x, x_stride, y, y_stride, lora_a, lora_b, token_slots,
                          out_slices, modules, M, K, N, max_rank))
        return -3;
    const ColumnEpilogue then = {lora_shrink_part, lora_expand_columns, &deltas};
    const int status = qmatmul_bf16_then(format, x, x_stride, packed, bias, y, NULL, y_stride, M,
                                         N, K, num_threads, &then);
    lora_columns_free(&deltas);
    return status;
}
