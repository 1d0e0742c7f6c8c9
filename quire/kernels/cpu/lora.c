// LoRA deltas beside a linear: each token row t with an adapter slot s (-1: none) gets
//   out[t] += B[s] (A[s] x[t])
// for the fused modules of the layer (q|k|v, gate|up: A's ranks one under the other, B's output
// columns side by side), summed in float32 and rounded once into out. x, out and the stacks are
// all bf16 or all float32 (the model's dtype); A carries the adapter's scale.
//
// Batch invariance: every number is computed in an order fixed by the shapes alone. u[t][j]
// (shrink) is x[t] . A[s][j], 16 float32 lanes along the input, then the lanes, then the tail;
// each output column (expand) sums u[t][r] B[s][r][col] over the ranks in order, then is added
// to out. So a row's bits do not depend on the other rows, the thread count, or the slot.
//
// Speed: decode is bound by the bytes read, so each slot's stacks are read once per call,
// whatever the number of its rows: the rows are grouped by slot, and the threads split a
// group's ranks (shrink) and output columns (expand), not its rows, so a lone row (batch 1)
// streams its adapter on every thread.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#define COLS 64  // output columns of one expand work item: 4 vectors

// x . a over n floats: 16 lanes summed along the input, then the lanes, then the tail.
static float dot(const float* x, const float* a, int n) {
    f32x16 acc = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        f32x16 xv, av;
        memcpy(&xv, x + k, sizeof xv);
        memcpy(&av, a + k, sizeof av);
        acc += xv * av;
    }
    float lanes[16], sum = 0.0f;
    memcpy(lanes, &acc, sizeof lanes);
    for (int l = 0; l < 16; l++) sum += lanes[l];
    for (; k < n; k++) sum += x[k] * a[k];
    return sum;
}

// n values of a bf16 (is_bf16) or float32 row, widened to float32 (exactly) into dst.
static void widen(float* dst, const void* src, int64_t n, int is_bf16) {
    if (!is_bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t* s = src;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        u16x16 h;
        memcpy(&h, s + k, sizeof h);
        const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
        memcpy(dst + k, &w, sizeof w);
    }
    for (; k < n; k++) dst[k] = bf16_to_f32(s[k]);
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

// x [tokens, in] (row stride x_stride), out [tokens, out] (row stride out_stride);
// lora_a [slots, modules * max_rank, in], lora_b [slots, max_rank, out] (B transposed); all
// bf16 (is_bf16) or all float32. token_slots [tokens]; out_slices [modules][2]: each module's
// first output column and width. Returns 0, or -1 for shapes it does not take or no memory.
int lora_add(int is_bf16, const void* x, int64_t x_stride, void* out, int64_t out_stride,
             const void* lora_a, const void* lora_b, const int32_t* token_slots,
             const int32_t* out_slices, int modules, int64_t tokens, int in, int out_features,
             int max_rank, int num_threads) {
    const int ranks = modules * max_rank;
    if (in < 1 || out_features < 1 || ranks < 1 || tokens < 0) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
    int64_t* order = malloc(sizeof(int64_t) * (tokens + 1));
    int64_t* group_start = malloc(sizeof(int64_t) * (tokens + 1));
    int32_t* group_slot = malloc(sizeof(int32_t) * (tokens + 1));
    int* item_module = malloc(sizeof(int) * (out_features / COLS + 2 * modules + 1));
    int* item_first = malloc(sizeof(int) * (out_features / COLS + 2 * modules + 1));
    if (!order || !group_start || !group_slot || !item_module || !item_first) {
        free(order), free(group_start), free(group_slot), free(item_module), free(item_first);
        return -1;
    }
    const int groups = group_rows(token_slots, tokens, order, group_start, group_slot);
    const int64_t rows = group_start[groups];
    // expand's work items per group: each module's columns in pieces of COLS
    int items = 0;
    for (int m = 0; m < modules; m++)
        for (int c = 0; c < out_slices[2 * m + 1]; c += COLS) {
            item_module[items] = m;
            item_first[items++] = out_slices[2 * m] + c;
        }
    // x's rows with a slot in float32, in group order; then u [rows, ranks]
    float* xf = aligned_floats(rows * (int64_t)in);
    float* u = aligned_floats(rows * (int64_t)ranks);
    int failed = !xf || !u;
    const int threads = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 0 && !failed)
    {
        float* a_row = aligned_floats(in);
        float* b_tile = aligned_floats((int64_t)max_rank * COLS);
        if (!a_row || !b_tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++)
            if (xf) widen(xf + i * in, (const char*)x + order[i] * x_stride * elem, in, is_bf16);
        // shrink: the threads split each group's ranks; a rank's row of A is read once
#pragma omp for schedule(static) collapse(2)
        for (int g = 0; g < groups; g++)
            for (int j = 0; j < ranks; j++) {
                if (!a_row || !xf || !u) continue;
                const int64_t at = ((int64_t)group_slot[g] * ranks + j) * in;
                widen(a_row, (const char*)lora_a + at * elem, in, is_bf16);
                for (int64_t i = group_start[g]; i < group_start[g + 1]; i++)
                    u[i * ranks + j] = dot(xf + i * in, a_row, in);
            }
        // expand: the threads split each group's output columns; B's tile is read once
#pragma omp for schedule(static) collapse(2)
        for (int g = 0; g < groups; g++)
            for (int item = 0; item < items; item++) {
                if (!b_tile || !u) continue;
                const int m = item_module[item], first = item_first[item];
                const int end = out_slices[2 * m] + out_slices[2 * m + 1];
                const int cols = end - first < COLS ? end - first : COLS;
                for (int r = 0; r < max_rank; r++) {
                    const int64_t at = ((int64_t)group_slot[g] * max_rank + r) * out_features;
                    widen(b_tile + r * COLS, (const char*)lora_b + (at + first) * elem, cols,
                          is_bf16);
                }
                for (int64_t i = group_start[g]; i < group_start[g + 1]; i++) {
                    const float* ur = u + i * ranks + m * max_rank;
                    float delta[COLS] __attribute__((aligned(64)));
                    int o = 0;
                    for (; o + 16 <= cols; o += 16) {
                        f32x16 acc = {0};
                        for (int r = 0; r < max_rank; r++) {
                            f32x16 b;
                            memcpy(&b, b_tile + r * COLS + o, sizeof b);
                            acc += ur[r] * b;
                        }
                        memcpy(delta + o, &acc, sizeof acc);
                    }
                    for (; o < cols; o++) {
                        float acc = 0.0f;
                        for (int r = 0; r < max_rank; r++) acc += ur[r] * b_tile[r * COLS + o];
                        delta[o] = acc;
                    }
                    const int64_t y_at = order[i] * out_stride + first;
                    if (is_bf16) {
                        uint16_t* y = (uint16_t*)out + y_at;
                        for (o = 0; o < cols; o++) y[o] = f32_to_bf16(bf16_to_f32(y[o]) + delta[o]);
                    } else {
                        float* y = (float*)out + y_at;
                        for (o = 0; o < cols; o++) y[o] += delta[o];
                    }
                }
            }
        free(a_row);
        free(b_tile);
    }
    free(xf), free(u), free(order), free(group_start), free(group_slot);
    free(item_module), free(item_first);
    return failed ? -1 : 0;
}
