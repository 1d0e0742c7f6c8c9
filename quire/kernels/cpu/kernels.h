// The entry points of the CPU kernels that other kernels call (decode_layer.c composes them).
// Each .c file that defines one includes this header, so the compiler checks the signatures.
#ifndef QUIRE_KERNELS_H
#define QUIRE_KERNELS_H
#include <stdint.h>

// The AMX tile configuration _tile_loadconfig reads (palette 1: 8 tiles of up to 16 rows x 64
// bytes), for the kernels that run on AMX tiles (matmul_amx.c, prefill_attention.c).
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

int add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, uint16_t* residual,
                      const uint16_t* weight, uint16_t* out, int rows, int dim, float eps,
                      int num_threads);
int silu_and_mul_bf16(const uint16_t* gate_up, const float* silu, uint16_t* out, int rows, int d,
                      int num_threads);
int rotary_bf16(uint16_t* x, int64_t row_stride, const uint16_t* cos, const uint16_t* sin,
                int tokens, int num_heads, int head_dim, int num_threads);
int paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int32_t* block_tables, const int32_t* seq_lens, uint16_t* out,
                      int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      int max_blocks, float scale, int num_threads);
int paged_decode_quant(int kind, const uint16_t* q, const uint8_t* k_cache, const uint8_t* v_cache,
                       const int32_t* block_tables, const int32_t* seq_lens, uint16_t* out,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int max_blocks, float scale, int num_threads);
int store_kv_rows(int kind, const uint16_t* key, const uint16_t* value, int64_t key_stride,
                  int64_t value_stride, uint8_t* k_cache, uint8_t* v_cache, const int64_t* slots,
                  int num_tokens, int num_kv_heads, int head_dim, int num_threads);
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
              uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M, int N, int K, int k_block,
              int num_threads);
int gemv_bf16_uses_amx(void);
int prefill_attention_uses_amx(void);
int matmul_amx_available(void);
int matmul_amx_argmax_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                           const uint16_t* bias, int M, int N, int K, int64_t first,
                           float* best_value, int64_t* best_id, uint8_t* best_nan);
int matmul_amx_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                    const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                    int N, int K, int num_threads);
// Work a matmul runs inside its parallel region, with the barrier it has anyway: `before` (or
// NULL), split by each thread's index t of nt, ahead of the barrier that precedes the matmul's
// columns; then `after`, each thread on the output columns [c0, c1) it has just written (every
// row), which no other thread touches.
typedef struct {
    void (*before)(const void* ctx, int t, int nt);
    void (*after)(const void* ctx, int c0, int c1);
    const void* ctx;
} ColumnEpilogue;

int qmatmul_bf16_then(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                      int M, int N, int K, int num_threads, const ColumnEpilogue* then);
int qmatmul_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                 const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                 int N, int K, int num_threads);
int qmatmul_record_bytes(int format);
int qmatmul_dequantize_bf16(int format, const uint8_t* packed, int64_t b0, int64_t b1,
                            uint16_t* out);
int qmatmul_dequantizes(int format, int K);
int qmatmul_k_dequantize_bf16(int format, const uint8_t* packed, int64_t b0, int64_t b1,
                              uint16_t* out);
int qmatmul_parts_rows_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                            const uint16_t* bias, uint16_t* y_bf16, float* y_f32,
                            int64_t y_stride, int M, int N, int K, int first_prompt,
                            int num_threads);
int qmatmul_k_record_bytes(int format);
int qmatmul_amx_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                     const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                     int M, int N, int K, int num_threads);
int qmatmul_amx_silu_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                          const float* silu, uint16_t* y, int64_t y_stride, int M, int N, int K,
                          int num_threads);
int qmatmul_rows_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                      int M, int N, int K, int first_prompt, int num_threads);
int qmatmul_k_bf16_then(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                        const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                        int M, int N, int K, int num_threads, const ColumnEpilogue* then);
int qmatmul_k_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                   const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                   int N, int K, int num_threads);
int quantize_rows_q8_bf16(const uint16_t* x, int64_t x_stride, int M, int K, int8_t* q, float* d,
                          int32_t* s);
int lora_add(int is_bf16, const void* x, int64_t x_stride, void* out, int64_t out_stride,
             const void* lora_a, const void* lora_b, const int32_t* token_slots,
             const int32_t* out_slices, int modules, int64_t tokens, int in, int out_features,
             int max_rank, int num_threads);

int qmatmul_lora_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                      const uint16_t* bias, uint16_t* y, int64_t y_stride, int M, int N, int K,
                      const uint16_t* lora_a, const uint16_t* lora_b, const int32_t* token_slots,
                      const int32_t* out_slices, int modules, int max_rank, int num_threads);
int argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t* out, int num_threads);
void argmax_f32_beyond(const float* x, int64_t rows, int64_t cols, int64_t first,
                       float* best_value, int64_t* best_id, uint8_t* best_nan);

// A tensor-parallel group's shared-memory file, mapped by quire/distributed/shm_all_reduce.py
// (shm_all_reduce.c: the protocol).
typedef struct {
    void* base;  // the mapped file: the ranks' flags, then two sets of slots
    int64_t slot_bytes;
    int32_t rank, world_size;
} ShmGroup;

int shm_all_reduce_bf16(const ShmGroup* g, uint16_t* x, int64_t n);
int shm_argmax_rows(const ShmGroup* g, const float* values, int64_t vocab_start, int64_t* ids,
                    int rows);

#endif
