// One decoder layer of the Llama family (Llama, Qwen2's qkv bias, Qwen3's q/k norm) for a
// decode-only step, in one call: run as modules, a step spends more time in Python and torch
// dispatch (~20 ops per layer) than in reading the weights at batch 1, and ~6 ms of a 28 ms
// step at batch 16.
//
// The stages are the kernels the module path runs, in the same order with the same rounding:
//   residual += hidden; x = RMSNorm(residual)        add_rms_norm_bf16
//   qkv = x Wqkv^T (+ b)                              gemv_bf16 or qmatmul_bf16
//   q, k = RMSNorm per head (Qwen3); rotary           add_rms_norm_bf16, rotary_bf16
//   K/V stored at the step's slots; paged attention   paged_decode_bf16 (or, quantized cache,
//                                                     store_kv_rows, paged_decode_quant)
//   hidden = attn Wo^T; residual += hidden; x = RMSNorm(residual)
//   hidden = (silu(x Wg^T) * x Wu^T) Wd^T
// so a request's tokens are the module path's with the GEMV kernel for the bf16 projections and
// the int8 kernel for those kept in GGUF blocks (layers/quantized_linear.py).
//
// With adapters (multi-LoRA), each of the four projections may carry the stacked adapter slots of
// its LoRALinear (layers/lora_linear.py): right after the projection, each row with a slot gets
// its adapter's delta from lora_add (lora.c), the kernel the module path's LoRA ops run, under
// the module's rule (every row with a slot, when any of the step's rows has one this projection
// uses; none otherwise), so a row's bits are the module path's, alone or beside other adapters.
// A projection on GGUF blocks at a few rows adds them inside its own parallel region
// (qmatmul_lora_bf16), with lora_add's bits.
//
// Under tensor parallelism each rank runs its shard of every layer (its heads of q|k|v and the
// attention, its rows of gate|up, its columns of o and down) and the all-reduces the modules run
// after o and down, over the group's shared memory (shm_all_reduce.c); the embedding is the
// rank's range of the table summed over the ranks, and the argmax is taken over every rank's
// range of the LM head.
//
// A pipeline stage runs its range of the layers: the first stage from the embedding, the others
// from the hidden states and residual the previous stage sent (in the step's hidden and residual
// scratch); the last stage ends in the final norm (and the LM head), the others leave their
// layers' hidden states and residual in that scratch, for the next stage.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

// The per-row q/k norm is split across threads from this many rows of the step.
#define PARALLEL_ROWS 4

// The adapter slots beside a projection (a LoRALinear's): bf16 stacks, the scale in A.
typedef struct {
    const uint16_t* a;  // [slots, modules * max_rank, in]; NULL: the projection takes no adapter
    const uint16_t* b;  // [slots, max_rank, out] (B transposed)
    const uint8_t* slot_used;  // [slots]: 1 where the slot adds anything to this projection
    const int32_t* out_slices;  // [modules][2]: each fused module's first output column, width
    int32_t modules, max_rank;
} LoRASlots;

// One projection's weight: GEMV-packed bf16 (format 0, gemv.c) or GGUF blocks packed for
// qmatmul.c (format 1..3: Q8_0, Q4_0, Q4_1), and its adapter slots.
typedef struct {
    const void* weight;  // NULL: no such projection
    const uint16_t* bias;  // NULL unless the projection has one (Qwen2's qkv)
    int32_t format;
    int32_t k_block;  // gemv.c's block size, for format 0
    LoRASlots lora;
} Projection;

// y = x W^T (+ b) for M rows by the projection's kernel (see gemv_bf16 for the arguments).
static int project(const Projection* P, const uint16_t* x, int64_t x_stride, uint16_t* y_bf16,
                   float* y_f32, int64_t y_stride, int M, int N, int K, int threads) {
    if (P->format == 0)
        return gemv_bf16(x, x_stride, P->weight, P->bias, y_bf16, y_f32, y_stride, M, N, K,
                         P->k_block, threads);
    return qmatmul_bf16(P->format, x, x_stride, P->weight, P->bias, y_bf16, y_f32, y_stride, M,
                        N, K, threads);
}

// Whether the rows' adapter deltas apply, as LoRALinear.forward adds them: to every row with a
// slot when any row's slot is one this projection uses (`slots`: the step's, NULL without
// adapter rows).
static int lora_applies(const LoRASlots* L, const int32_t* slots, int M) {
    if (!L->a || !slots) return 0;
    int used = 0;
    for (int b = 0; b < M && !used; b++) used = slots[b] >= 0 && L->slot_used[slots[b]];
    return used;
}

// Up to this many rows, a projection on GGUF blocks adds the adapter deltas in its own parallel
// region (qmatmul_lora_bf16): no second region and no barrier of its own, which at batch 1 cost
// more than reading the adapter. Above it (many rows of one adapter), lora_add's row split.
#define LORA_FUSED_ROWS 16

// project into bf16 rows, then the rows' adapter deltas.
static int project_rows(const Projection* P, const int32_t* slots, const uint16_t* x,
                        int64_t x_stride, uint16_t* y, int64_t y_stride, int M, int N, int K,
                        int threads) {
    const LoRASlots* L = &P->lora;
    if (!lora_applies(L, slots, M))
        return project(P, x, x_stride, y, NULL, y_stride, M, N, K, threads);
    if (M <= LORA_FUSED_ROWS && P->format >= 1)  // GGUF blocks (qmatmul.c, qmatmul_k.c)
        return qmatmul_lora_bf16(P->format, x, x_stride, P->weight, P->bias, y, y_stride, M, N,
                                 K, L->a, L->b, slots, L->out_slices, L->modules, L->max_rank,
                                 threads);
    const int status = project(P, x, x_stride, y, NULL, y_stride, M, N, K, threads);
    if (status) return status;
    return lora_add(1, x, x_stride, y, y_stride, L->a, L->b, slots, L->out_slices, L->modules, M,
                    K, N, L->max_rank, threads);
}

// A layer's weights (packed projections) and KV cache; built once, in Python.
typedef struct {
    const uint16_t* input_norm;
    const uint16_t* post_norm;
    const uint16_t* q_norm;  // NULL unless the model normalizes q/k per head (Qwen3)
    const uint16_t* k_norm;
    void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] bf16, or quantized rows
    void* v_cache;  // (kv_quant.h: head_dim codes and a scale each)
    Projection qkv, o, gate_up, down;
    int32_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size;
    int32_t kv_kind;  // 0: bf16 cache; else KV_INT8, KV_FP8_E4M3 or KV_FP8_E5M2
    float eps, qk_eps, scale;
} DecodeLayer;

// What every layer of one step shares.
typedef struct {
    uint16_t* cos;  // [num_seqs, head_dim]: filled by decode_step_bf16 from the positions
    uint16_t* sin;
    const int64_t* slots;  // [num_seqs] cache slot of each sequence's new token
    const int32_t* block_tables;  // [num_seqs, max_blocks]
    const int32_t* seq_lens;  // [num_seqs], the new token included
    const int32_t* lora_slots;  // [num_seqs] each row's adapter slot, -1: none; NULL: no adapters
    const float* silu;  // [65536]: torch's bf16 silu of every bf16 bit pattern, as float32
    uint16_t* x;  // scratch: [num_seqs, hidden_size]
    uint16_t* qkv;  // [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]
    uint16_t* q;  // [num_seqs, num_heads * head_dim]
    uint16_t* attn;  // [num_seqs, num_heads * head_dim]
    uint16_t* gate_up;  // [num_seqs, 2 * intermediate_size]
    uint16_t* act;  // [num_seqs, intermediate_size]
    int32_t num_seqs, max_blocks, num_threads;
} DecodeStep;

// hidden [num_seqs, hidden_size]: in, the previous layer's output (the embeddings when first);
// out, this layer's. residual [num_seqs, hidden_size]: the residual stream, updated in place
// (written from hidden when first). Returns 0, or the failing stage's negative status.
// group: the tensor-parallel ranks to sum o's and down's outputs over, NULL with one rank.
static int decode_layer_bf16(const DecodeLayer* L, const DecodeStep* S, const ShmGroup* group,
                             uint16_t* hidden, uint16_t* residual, int first) {
    const int B = S->num_seqs, H = L->hidden_size, D = L->head_dim, I = L->intermediate_size;
    const int Q = L->num_heads * D, KV = L->num_kv_heads * D, W = Q + 2 * KV;
    const int threads = S->num_threads;
    int status;
    if (first) memcpy(residual, hidden, (size_t)B * H * sizeof(uint16_t));
    status = add_rms_norm_bf16(hidden, H, first ? NULL : residual, L->input_norm, S->x, B, H,
                               L->eps, threads);
    if (status) return status;
    status = project_rows(&L->qkv, S->lora_slots, S->x, H, S->qkv, W, B, W, H, threads);
    if (status) return status;
    if (L->q_norm) {
#pragma omp parallel for num_threads(threads) if (B >= PARALLEL_ROWS) schedule(static)
        for (int b = 0; b < B; b++) {  // in place: the kernel reads a row whole, then writes it
            uint16_t* row = S->qkv + (int64_t)b * W;
            add_rms_norm_bf16(row, D, NULL, L->q_norm, row, L->num_heads, D, L->qk_eps, 1);
            add_rms_norm_bf16(row + Q, D, NULL, L->k_norm, row + Q, L->num_kv_heads, D,
                              L->qk_eps, 1);
        }
    }
    status = rotary_bf16(S->qkv, W, S->cos, S->sin, B, L->num_heads + L->num_kv_heads, D, threads);
    if (status) return status;
    for (int b = 0; b < B; b++) {
        const uint16_t* row = S->qkv + (int64_t)b * W;
        memcpy(S->q + (int64_t)b * Q, row, (size_t)Q * sizeof(uint16_t));
        if (L->kv_kind) continue;
        memcpy((uint16_t*)L->k_cache + S->slots[b] * KV, row + Q, (size_t)KV * sizeof(uint16_t));
        memcpy((uint16_t*)L->v_cache + S->slots[b] * KV, row + Q + KV,
               (size_t)KV * sizeof(uint16_t));
    }
    if (L->kv_kind) {
        status = store_kv_rows(L->kv_kind, S->qkv + Q, S->qkv + Q + KV, W, W, L->k_cache,
                               L->v_cache, S->slots, B, L->num_kv_heads, D, threads);
        if (status) return status;
        status = paged_decode_quant(L->kv_kind, S->q, L->k_cache, L->v_cache, S->block_tables,
                                    S->seq_lens, S->attn, B, L->num_heads, L->num_kv_heads, D,
                                    L->block_size, S->max_blocks, L->scale, threads);
    } else {
        status = paged_decode_bf16(S->q, L->k_cache, L->v_cache, S->block_tables, S->seq_lens,
                                   S->attn, B, L->num_heads, L->num_kv_heads, D, L->block_size,
                                   S->max_blocks, L->scale, threads);
    }
    if (status) return status;
    status = project_rows(&L->o, S->lora_slots, S->attn, Q, hidden, H, B, H, Q, threads);
    if (status) return status;
    if (group && (status = shm_all_reduce_bf16(group, hidden, (int64_t)B * H))) return status;
    status = add_rms_norm_bf16(hidden, H, residual, L->post_norm, S->x, B, H, L->eps, threads);
    if (status) return status;
    status = project_rows(&L->gate_up, S->lora_slots, S->x, H, S->gate_up, 2 * I, B, 2 * I, H,
                          threads);
    if (status) return status;
    status = silu_and_mul_bf16(S->gate_up, S->silu, S->act, B, I, threads);
    if (status) return status;
    status = project_rows(&L->down, S->lora_slots, S->act, I, hidden, H, B, H, I, threads);
    if (status || !group) return status;
    return shm_all_reduce_bf16(group, hidden, (int64_t)B * H);
}

// The model around the layers: the embedding table, the rotary tables, the final norm and the
// LM head. Each rank holds the vocabulary rows [vocab_start, vocab_start + vocab_rows) of the
// table and the LM head (all of them with one rank); rows past vocab_size are padding.
typedef struct {
    const DecodeLayer* layers;
    const uint16_t* embedding;  // [vocab_rows, hidden_size]
    const float* cos_cache;  // [max_position, head_dim], the float32 rotate-half tables
    const float* sin_cache;
    const uint16_t* final_norm;
    Projection lm_head;  // [vocab_rows, hidden]; weight NULL when the step has none
    const ShmGroup* group;  // the tensor-parallel ranks, NULL with one
    int32_t num_layers, vocab_size, vocab_start, vocab_rows, max_position;
    int32_t first_stage, last_stage;  // 1 and 1 without pipeline parallelism
    float final_eps;
} DecodeModel;

// A whole decode-only step up to the LM head, as the module path computes it: each sequence's
// token embedding (zeros outside this rank's rows, then summed over the ranks), the rotary
// tables at its position (float32 rounded to bf16, as `.to(bf16)` rounds), every layer, and the
// final add + norm into out [num_seqs, hidden_size]. hidden and residual are scratch
// [num_seqs, hidden_size]; a pipeline stage other than the first reads the previous stage's
// output from them, one other than the last leaves its own there (and writes nothing to out).
// Returns 0, -4 for a token id or a position out of the tables' range (nothing computed), -6 for
// a step too large for the group's slots, or a layer's negative status.
int decode_step_bf16(const DecodeModel* M, const DecodeStep* S, const int64_t* token_ids,
                     const int64_t* positions, uint16_t* hidden, uint16_t* residual,
                     uint16_t* out) {
    const int B = S->num_seqs, H = M->layers[0].hidden_size, D = M->layers[0].head_dim;
    for (int b = 0; b < B; b++)
        if (token_ids[b] < 0 || token_ids[b] >= M->vocab_size || positions[b] < 0 ||
            positions[b] >= M->max_position)
            return -4;
    for (int b = 0; b < B; b++) {
        const int64_t row = token_ids[b] - M->vocab_start;
        if (!M->first_stage)
            ;  // the previous stage's hidden states are in place
        else if (row >= 0 && row < M->vocab_rows)
            memcpy(hidden + (int64_t)b * H, M->embedding + row * H, (size_t)H * sizeof(uint16_t));
        else
            memset(hidden + (int64_t)b * H, 0, (size_t)H * sizeof(uint16_t));
        const float* c = M->cos_cache + positions[b] * D;
        const float* s = M->sin_cache + positions[b] * D;
        for (int d = 0; d < D; d++) {
            S->cos[(int64_t)b * D + d] = f32_to_bf16(c[d]);
            S->sin[(int64_t)b * D + d] = f32_to_bf16(s[d]);
        }
    }
    int status;
    if (M->first_stage && M->group &&
        (status = shm_all_reduce_bf16(M->group, hidden, (int64_t)B * H)))
        return status;
    for (int i = 0; i < M->num_layers; i++) {
        const int first = i == 0 && M->first_stage;  // the model's first layer: no residual yet
        status = decode_layer_bf16(M->layers + i, S, M->group, hidden, residual, first);
        if (status) return status;
    }
    if (!M->last_stage) return 0;
    return add_rms_norm_bf16(hidden, H, residual, M->final_norm, out, B, H, M->final_eps,
                             S->num_threads);
}

// A thread's LM head columns go through the argmax in blocks of at most this many bytes of
// float32 logits ([rows, block columns]), which stay in its L2 cache: no [rows, vocab] tensor
// is written to memory and read back.
#define LOGITS_BLOCK_BYTES (256 * 1024)

// The best logit of a row so far, and its column: the first NaN, else the first maximum.
typedef struct {
    float value;
    int32_t is_nan;  // told by the bits: the library is built with -ffast-math
    int64_t id;  // -1: no column seen yet
} Best;

// best <- (value, id) where it comes first in torch.argmax's order; ids arrive ascending.
static void keep_best(Best* best, float value, int64_t id) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const int is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    if (best->id < 0 || (!best->is_nan && (is_nan || value > best->value)))
        *best = (Best){value, is_nan, id};
}

// lm_head_argmax_bf16 for a GEMV-packed head (format 0): each thread takes a contiguous range
// of the head's panels, computes it a block of columns at a time for every row into a block
// of its own (the kernel's bits for each logit, whatever the columns of a call), and keeps each
// row's best (argmax_f32_beyond: a block that cannot change a row's answer is not searched); the
// threads' bests are then merged in column order. Where gemv_bf16 runs on AMX tiles, the AMX
// kernel's argmax (matmul_amx.c) takes the thread's range instead: the same logits, searched a
// panel at a time in cache, never stored. Columns past `valid` (the padding) are not computed.
// Returns 0, -3 out of memory, or the kernel's status.
static int lm_head_argmax_blocked(const Projection* P, const uint16_t* x, int B, int H,
                                  int valid, float* values, int64_t* ids, int num_threads) {
    const int panels = (valid + 31) / 32;
    const int threads = panels < 2 * num_threads ? 1 : num_threads;
    // gemv_bf16 hands these calls to the AMX kernel (gemv.c): that order, fused with the search
    const int amx = gemv_bf16_uses_amx() && P->k_block == H;
    int64_t block = LOGITS_BLOCK_BYTES / ((int64_t)B * (int64_t)sizeof(float)) / 32 * 32;
    if (block < 32) block = 32;
    float* best_values = malloc((size_t)threads * (size_t)B * sizeof(float));
    int64_t* best_ids = malloc((size_t)threads * (size_t)B * sizeof(int64_t));
    uint8_t* best_nans = malloc((size_t)threads * (size_t)B);
    float* blocks = amx ? NULL : malloc((size_t)threads * (size_t)B * (size_t)block * sizeof(float));
    if (!best_values || !best_ids || !best_nans || (!blocks && !amx)) {
        free(best_values), free(best_ids), free(best_nans), free(blocks);
        return -3;
    }
    int status = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t c1 = (int64_t)panels * (t + 1) / nt * 32;
        const int64_t end = c1 < valid ? c1 : valid;
        float* value = best_values + (int64_t)t * B;
        int64_t* id = best_ids + (int64_t)t * B;
        uint8_t* nan = best_nans + (int64_t)t * B;
        for (int b = 0; b < B; b++) id[b] = -1, nan[b] = 0, value[b] = 0.0f;
        const int64_t start = (int64_t)panels * t / nt * 32;
        if (amx) {
            const int s = start < end ? matmul_amx_argmax_bf16(
                                            x, H, (const uint16_t*)P->weight + start * H,
                                            P->bias ? P->bias + start : NULL, B, (int)(end - start),
                                            H, start, value, id, nan)
                                      : 0;
            if (s) {
#pragma omp atomic write
                status = s;
            }
        } else {
            float* logits = blocks + (int64_t)t * B * block;
            for (int64_t c0 = start; c0 < end; c0 += block) {
                const int n = (int)(end - c0 < block ? end - c0 : block);
                const int s = gemv_bf16(x, H, (const uint16_t*)P->weight + c0 * H,
                                        P->bias ? P->bias + c0 : NULL, NULL, logits, n, B, n, H,
                                        P->k_block, 1);
                if (s) {
#pragma omp atomic write
                    status = s;
                    break;
                }
                argmax_f32_beyond(logits, B, n, c0, value, id, nan);
            }
        }
    }
    for (int b = 0; b < B && !status; b++) {
        Best row = {0.0f, 0, -1};
        for (int t = 0; t < threads; t++) {
            const int64_t at = (int64_t)t * B + b;
            if (best_ids[at] >= 0) keep_best(&row, best_values[at], best_ids[at]);
        }
        // no column at all (every one padding): the argmax of a row of -inf
        values[b] = row.id < 0 ? -INFINITY : row.value;
        ids[b] = row.id < 0 ? 0 : row.id;
    }
    free(best_values), free(best_ids), free(best_nans), free(blocks);
    return status;
}

// The LM head over rows x [B, H] (the final norm's output) and the argmax of each row into
// next_ids [B]: the argmax of the logits compute_logits gives (float32 holding the bf16-rounded
// values), as the sampler's argmax takes it (the first maximum, the first NaN before any
// number); with several ranks, of the gathered logits. A GEMV-packed head goes through it in
// blocks of columns that stay in cache; a head in GGUF blocks writes this rank's logits into
// logits [B, vocab_rows] (-inf in the padding rows), then takes their argmax. Returns 0, -5
// without an LM head, -3 out of memory, -6 for more rows than the group's slots hold, or the
// projection's status.
int lm_head_argmax_bf16(const DecodeModel* M, const uint16_t* x, int B, float* logits,
                        int64_t* next_ids, int num_threads) {
    if (!M->lm_head.weight) return -5;
    const int H = M->layers[0].hidden_size, V = M->vocab_rows;
    const int past = M->vocab_size - M->vocab_start;  // this rank's rows that are not padding
    const int valid = past < 0 ? 0 : past < V ? past : V;
    float* values = malloc((size_t)B * sizeof(float));  // each row's best logit
    if (!values) return -3;
    int status;
    if (M->lm_head.format == 0) {
        status = lm_head_argmax_blocked(&M->lm_head, x, B, H, valid, values, next_ids,
                                        num_threads);
    } else {
        status = project(&M->lm_head, x, H, NULL, logits, V, B, V, H, num_threads);
        for (int b = 0; b < B && valid < V && !status; b++)
            for (int v = valid; v < V; v++) logits[(int64_t)b * V + v] = -INFINITY;
        if (!status) status = argmax_f32(logits, B, V, next_ids, num_threads);
        for (int b = 0; b < B && !status; b++) values[b] = logits[(int64_t)b * V + next_ids[b]];
    }
    if (!status && M->group)
        status = shm_argmax_rows(M->group, values, M->vocab_start, next_ids, B);
    free(values);
    return status;
}

// decode_step_bf16, then lm_head_argmax_bf16 over its output: the step's greedy tokens.
int decode_step_argmax_bf16(const DecodeModel* M, const DecodeStep* S, const int64_t* token_ids,
                            const int64_t* positions, uint16_t* hidden, uint16_t* residual,
                            uint16_t* out, float* logits, int64_t* next_ids) {
    if (!M->lm_head.weight) return -5;
    const int status = decode_step_bf16(M, S, token_ids, positions, hidden, residual, out);
    if (status) return status;
    return lm_head_argmax_bf16(M, out, S->num_seqs, logits, next_ids, S->num_threads);
}
