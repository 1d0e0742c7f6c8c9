// bf16 matmul on AMX tiles: y = x W^T (+ bias) for any number of rows of x, over the weight that
// gemv.c reads (packed[N_pad / 32][K / 2][32][2]), for CPUs with AMX-BF16 (Intel Xeon from
// Sapphire Rapids on). gemv_bf16 hands its work here when the AMX order is on (gemv_bf16_set_amx).
//
// Why a kernel of our own: oneDNN's AMX matmuls block K differently for different row counts, so
// a request's bits would change with the batch. Here every output is one chain of tdpbf16ps over
// the first K - K % 32 columns in order, 32 columns an instruction into one float32 accumulator
// tile, then the last K % 32 columns by vdpbf16ps pairs, then the bias and one rounding to bf16.
// The tile unit sums each row by itself (checked: the same bits for a row whatever the tile's row
// count, 0 differences in 435k outputs), so neither the other rows nor the thread count change a
// row's result. tdpbf16ps sums more precisely than a float32 chain of its products (its bits are
// neither gemv.c's nor any sequential float32 order), so on a CPU with AMX this order replaces
// gemv.c's everywhere the kernel runs: decode steps and prompt chunks alike.
//
// Blocking: rows in groups of 32 (two A tiles), a panel's 32 columns as two B tiles, four C tiles;
// a thread takes a contiguous range of panels, in chunks that fit L2 so that the later row groups
// read the chunk from cache.
//
// matmul_amx_argmax_bf16 runs the same sums for the fused LM head's greedy argmax
// (decode_layer.c): each panel's logits are searched as they leave the tiles and never stored.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define PANEL 32

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROW_GROUP 32
#define CHUNK_BYTES (1 << 20)  // panels a thread streams through its row groups: half an L2
#define DEQUANTIZED_BYTES (256 << 10)  // qmatmul_amx_bf16's chunk: two of them, in L2

// Linux hands out AMX's tile state only to a process that asks (once, for all its threads).
int matmul_amx_available(void) {
    static int available = -1;
    if (available < 0)
        available = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return available;
}

// Tiles 0-3: the float32 sums of rows 0-15 / 16-31 by columns 0-15 / 16-31; 4, 5: rows 0-15 and
// 16-31 of x; 6, 7: the panel's columns 0-15 and 16-31 (16 pairs of K each).
static void configure_tiles(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0;
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)r1;
    c.rows[6] = c.rows[7] = 16;
    if (!r1) c.colsb[2] = c.colsb[3] = c.colsb[5] = 0;
    _tile_loadconfig(&c);
}

// One panel against `rows` (1..32, as configured) rows of x: the sums over the first
// K - K % 32 columns into tiles 0-3 (amx_panel_store takes them out).
static inline void amx_panel_sums(int rows, const uint16_t* x, int64_t x_stride,
                                  const uint16_t* p, int K) {
    const int two = rows > 16, k_tiles = K - K % 32;
    const int64_t stride = x_stride * (int64_t)sizeof(uint16_t);
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int k = 0; k < k_tiles; k += 32) {
        const uint16_t* w = p + (int64_t)k * PANEL;  // pair row k / 2: 64 bf16 a pair row
        _tile_loadd(4, x + k, stride);
        _tile_loadd(6, w, 2 * PANEL * sizeof(uint16_t));
        _tile_loadd(7, w + PANEL, 2 * PANEL * sizeof(uint16_t));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * x_stride + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

// amx_panel_sums' tiles into out [32][32] float32, with the last K % 32 columns added.
static inline void amx_panel_store(int rows, const uint16_t* x, int64_t x_stride,
                                   const uint16_t* p, int K, float* out) {
    const int two = rows > 16, k_tiles = K - K % 32;
    _tile_stored(0, out, PANEL * sizeof(float));
    _tile_stored(1, out + 16, PANEL * sizeof(float));
    if (two) {
        _tile_stored(2, out + 16 * PANEL, PANEL * sizeof(float));
        _tile_stored(3, out + 16 * PANEL + 16, PANEL * sizeof(float));
    }
    for (int m = 0; m < rows && k_tiles < K; m++) {  // the last K % 32 columns, a pair a step
        __m512 lo = _mm512_loadu_ps(out + m * PANEL), hi = _mm512_loadu_ps(out + m * PANEL + 16);
        for (int k = k_tiles; k < K; k += 2) {
            int32_t pair;
            memcpy(&pair, x + m * x_stride + k, sizeof(pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            const uint16_t* w = p + (int64_t)k * PANEL;
            lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_loadu_si512(w), xv);
            hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_loadu_si512(w + PANEL), xv);
        }
        _mm512_storeu_ps(out + m * PANEL, lo);
        _mm512_storeu_ps(out + m * PANEL + 16, hi);
    }
}

// One panel against `rows` (1..32, as configured) rows of x: out [32][32] float32 sums.
static void amx_panel(int rows, const uint16_t* x, int64_t x_stride, const uint16_t* p, int K,
                      float* out) {
    amx_panel_sums(rows, x, x_stride, p, K);
    amx_panel_store(rows, x, x_stride, p, K, out);
}

// Arguments as gemv_bf16's (K even); returns 0, or -2 where AMX cannot run.
int matmul_amx_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                    const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                    int N, int K, int num_threads) {
    if (!matmul_amx_available()) return -2;
    const int panels = (N + PANEL - 1) / PANEL;
    const int threads = panels < 2 * num_threads ? 1 : num_threads;
    const int64_t panel_bytes = (int64_t)K * PANEL * sizeof(uint16_t);
    const int chunk = panel_bytes >= CHUNK_BYTES ? 1 : (int)(CHUNK_BYTES / panel_bytes);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p0 = (int)((int64_t)panels * t / nt);
        const int p1 = (int)((int64_t)panels * (t + 1) / nt);
        float out[ROW_GROUP * PANEL];
        int configured = 0;
        for (int c0 = p0; c0 < p1; c0 += chunk) {
            const int c1 = c0 + chunk < p1 ? c0 + chunk : p1;
            for (int m0 = 0; m0 < M; m0 += ROW_GROUP) {
                const int rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                for (int pi = c0; pi < c1; pi++) {
                    amx_panel(rows, x + (int64_t)m0 * x_stride, x_stride,
                              packed + (int64_t)pi * PANEL * K, K, out);
                    store_panel(out, PANEL, rows, m0, pi * PANEL, N, bias, y_bf16, y_f32,
                                y_stride);
                }
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}

// silu(g) * u for 32 columns of `rows` rows, from the gate's and the up projection's float32
// sums [rows][32]: each rounded to bf16 as store_panel rounds, then silu_and_mul_bf16's bits
// (torch's bf16 SiLU from its table, times u exactly, rounded once), into y.
static void store_gated(const float* gate, const float* up, const float* silu, int rows, int m0,
                        int n0, uint16_t* y, int64_t y_stride) {
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int m = 0; m < rows; m++) {
        for (int c = 0; c < PANEL; c += 16) {
            const __m512i g = _mm512_castps_si512(_mm512_loadu_ps(gate + m * PANEL + c));
            const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(up + m * PANEL + c));
            const __m512i g16 = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(g, half),
                                 _mm512_and_si512(_mm512_srli_epi32(g, 16), one)), 16);
            const __m512i u32 = _mm512_slli_epi32(
                _mm512_srli_epi32(
                    _mm512_add_epi32(_mm512_add_epi32(u, half),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16), 16);
            const __m512 p =
                _mm512_mul_ps(_mm512_i32gather_ps(g16, silu, 4), _mm512_castsi512_ps(u32));
            const __m512i pb = _mm512_castps_si512(p);
            const __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(pb, half),
                                 _mm512_and_si512(_mm512_srli_epi32(pb, 16), one)), 16);
            _mm256_storeu_si256((__m256i*)(y + (int64_t)(m0 + m) * y_stride + n0 + c),
                                _mm512_cvtepi32_epi16(r));
        }
    }
}

// y = x W^T (+ bias) for the prompt rows of a step (qmatmul.c's qmatmul_rows_bf16), W in
// qmatmul.c's blocks (Q8_0 / Q4_0 / Q4_1), dequantized to bf16 (qmatmul_dequantize_bf16) a chunk
// of a thread's panels at a time; every row group runs over the chunk as in matmul_amx_bf16, so
// a row's bits are matmul_amx_bf16's on the dequantized weight. The next chunk is dequantized
// into a second buffer in slices issued between a panel's tile products and their store: the
// vector units convert weights while the tiles multiply.
// With `silu` (torch's bf16 SiLU table, silu_and_mul_bf16's), W is a gate|up projection of 2 N
// rows and y [M, N] = silu(x Wg^T) * (x Wu^T), each product rounded to bf16 first: the bits of
// qmatmul then silu_and_mul_bf16, without writing the products (a unit is gate panel i with up
// panel N / 32 + i; N a multiple of 32, no bias). Returns 0, -1 for a shape it does not take, -2
// where AMX cannot run, -3 out of memory.
static int amx_dequantized(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                           const uint16_t* bias, const float* silu, uint16_t* y_bf16,
                           float* y_f32, int64_t y_stride, int M, int N, int K, int num_threads) {
    if (!matmul_amx_available()) return -2;
    if (M < 1 || N < 1 || !qmatmul_dequantizes(format, K)) return -1;
    if (silu && (N % PANEL || bias || !y_bf16)) return -1;
    const int per_unit = silu ? 2 : 1;  // panels a unit of work multiplies
    const int units = (N + PANEL - 1) / PANEL, blocks = K / 32;
    const int threads = units < 2 * num_threads ? 1 : num_threads;
    const int64_t panel_elems = (int64_t)K * PANEL;  // bf16 of a dequantized panel
    const int64_t unit_bytes = per_unit * panel_elems * (int64_t)sizeof(uint16_t);
    const int chunk = unit_bytes >= DEQUANTIZED_BYTES ? 1 : (int)(DEQUANTIZED_BYTES / unit_bytes);
    uint16_t* buffers =
        aligned_alloc(64, (size_t)(threads * 2 * chunk * per_unit * panel_elems * 2));
    if (!buffers) return -3;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int u0 = (int)((int64_t)units * t / nt);
        const int u1 = (int)((int64_t)units * (t + 1) / nt);
        const int64_t buffer_elems = (int64_t)chunk * per_unit * panel_elems;
        uint16_t* buffer[2] = {buffers + (int64_t)t * 2 * buffer_elems,
                               buffers + ((int64_t)t * 2 + 1) * buffer_elems};
        float out[ROW_GROUP * PANEL], up[ROW_GROUP * PANEL];
        int configured = 0, current = 0;
        for (int c0 = u0; c0 < u1; c0 += chunk, current ^= 1) {
            const int c1 = c0 + chunk < u1 ? c0 + chunk : u1;
            if (c0 == u0) {
                const int64_t all = (int64_t)(c1 - c0) * per_unit * blocks;
                for (int64_t v = 0; v < all; v += blocks) {
                    const int unit = c0 + (int)(v / blocks / per_unit);
                    const int panel = (int)(v / blocks % per_unit) ? units + unit : unit;
                    qmatmul_dequantize_bf16(format, packed, (int64_t)panel * blocks,
                                            (int64_t)(panel + 1) * blocks,
                                            buffer[current] + v * 32 * PANEL);
                }
            }
            const int n1 = c1 + chunk < u1 ? c1 + chunk : u1;  // the next chunk: [c1, n1)
            const int64_t next = (int64_t)(n1 - c1) * per_unit * blocks;
            const int64_t calls = (int64_t)(M + ROW_GROUP - 1) / ROW_GROUP * (c1 - c0);
            const int64_t slice = (next + calls - 1) / calls;
            int64_t done = 0;
            const uint16_t* w = buffer[current];
            for (int m0 = 0; m0 < M; m0 += ROW_GROUP) {
                const int rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                const uint16_t* xg = x + (int64_t)m0 * x_stride;
                for (int ui = c0; ui < c1; ui++) {
                    const uint16_t* p = w + (int64_t)(ui - c0) * per_unit * panel_elems;
                    amx_panel_sums(rows, xg, x_stride, p, K);
                    // while the tiles work: the next slice of the next chunk, a panel's blocks
                    // at a time (a unit's panels are apart in `packed`)
                    for (int64_t end = done + slice < next ? done + slice : next; done < end;) {
                        const int unit = c1 + (int)(done / blocks / per_unit);
                        const int panel = (int)(done / blocks % per_unit) ? units + unit : unit;
                        const int64_t b = done % blocks;
                        const int64_t n = blocks - b < end - done ? blocks - b : end - done;
                        qmatmul_dequantize_bf16(format, packed, (int64_t)panel * blocks + b,
                                                (int64_t)panel * blocks + b + n,
                                                buffer[current ^ 1] + done * 32 * PANEL);
                        done += n;
                    }
                    amx_panel_store(rows, xg, x_stride, p, K, out);
                    if (!silu) {
                        store_panel(out, PANEL, rows, m0, ui * PANEL, N, bias, y_bf16, y_f32,
                                    y_stride);
                        continue;
                    }
                    amx_panel(rows, xg, x_stride, p + panel_elems, K, up);
                    store_gated(out, up, silu, rows, m0, ui * PANEL, y_bf16, y_stride);
                }
            }
        }
        if (configured) _tile_release();
    }
    free(buffers);
    return 0;
}

int qmatmul_amx_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                     const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                     int M, int N, int K, int num_threads) {
    return amx_dequantized(format, x, x_stride, packed, bias, NULL, y_bf16, y_f32, y_stride, M,
                           N, K, num_threads);
}

// y [M, N] = silu(x Wg^T) * (x Wu^T) for a gate|up weight of 2 N rows (amx_dequantized).
int qmatmul_amx_silu_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                          const float* silu, uint16_t* y, int64_t y_stride, int M, int N, int K,
                          int num_threads) {
    return amx_dequantized(format, x, x_stride, packed, NULL, silu, y, NULL, y_stride, M, N, K,
                           num_threads);
}

// One panel's sums out [rows][32] (columns n0.., `cols` of them) into the rows' running bests.
static void panel_rows_argmax(const float* out, int rows, int cols, int n0, int64_t first,
                              const uint16_t* bias, float* best_value, int64_t* best_id,
                              uint8_t* best_nan) {
    const uint16_t* panel_bias = bias ? bias + n0 : NULL;
    __m512 bias_lo = _mm512_setzero_ps(), bias_hi = bias_lo;
    if (panel_bias && cols == PANEL) {
        bias_lo = widen_16(panel_bias);
        bias_hi = widen_16(panel_bias + 16);
    }
    float logits[PANEL];
    for (int m = 0; m < rows; m++) {
        if (best_id[m] >= 0 && cols == PANEL) {
            // Rounding to bf16 never lifts a value above a bf16 best it does not exceed: a row
            // none of whose sums is above its best (or NaN) is done.
            const __m512 b = _mm512_set1_ps(best_value[m]);
            const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(out + m * PANEL), bias_lo);
            const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(out + m * PANEL + 16), bias_hi);
            if (!(_mm512_cmp_ps_mask(lo, b, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(hi, b, _CMP_NLE_UQ)))
                continue;
        }
        store_panel(out + m * PANEL, PANEL, 1, 0, 0, cols, panel_bias, NULL, logits, PANEL);
        argmax_f32_beyond(logits, 1, cols, first + n0, best_value + m, best_id + m, best_nan + m);
    }
}

// The argmax of each of M rows of y = x W^T (+ bias) over columns [0, N) of `packed` (a thread's
// range of a GEMV-packed LM head: its first column is `first`), merged into each row's running
// best (best_value / best_id / best_nan [M], as argmax_f32_beyond keeps them), without writing
// the logits: each panel's sums are rounded to bf16 exactly as matmul_amx_bf16 stores them,
// then searched while in cache, while the tiles compute the next panel. One thread; the caller
// splits the columns. Returns 0, or -2 where AMX cannot run.
int matmul_amx_argmax_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                           const uint16_t* bias, int M, int N, int K, int64_t first,
                           float* best_value, int64_t* best_id, uint8_t* best_nan) {
    if (!matmul_amx_available()) return -2;
    const int panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)K * PANEL * sizeof(uint16_t);
    const int chunk = panel_bytes >= CHUNK_BYTES ? 1 : (int)(CHUNK_BYTES / panel_bytes);
    float out[2][ROW_GROUP * PANEL];
    int configured = 0;
    for (int c0 = 0; c0 < panels; c0 += chunk) {
        const int c1 = c0 + chunk < panels ? c0 + chunk : panels;
        for (int m0 = 0; m0 < M; m0 += ROW_GROUP) {
            const int rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
            const uint16_t* xg = x + (int64_t)m0 * x_stride;
            if (rows != configured) {
                configure_tiles(rows);
                configured = rows;
            }
            for (int pi = c0; pi < c1; pi++) {
                const uint16_t* p = packed + (int64_t)pi * PANEL * K;
                amx_panel_sums(rows, xg, x_stride, p, K);
                if (pi > c0) {  // the last panel's search, while the tiles sum this one
                    const int n0 = (pi - 1) * PANEL;
                    panel_rows_argmax(out[(pi - 1) & 1], rows, N - n0 < PANEL ? N - n0 : PANEL,
                                      n0, first, bias, best_value + m0, best_id + m0,
                                      best_nan + m0);
                }
                amx_panel_store(rows, xg, x_stride, p, K, out[pi & 1]);
            }
            const int n0 = (c1 - 1) * PANEL;
            panel_rows_argmax(out[(c1 - 1) & 1], rows, N - n0 < PANEL ? N - n0 : PANEL, n0, first,
                              bias, best_value + m0, best_id + m0, best_nan + m0);
        }
    }
    if (configured) _tile_release();
    return 0;
}
#else
int matmul_amx_available(void) { return 0; }

int matmul_amx_argmax_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                           const uint16_t* bias, int M, int N, int K, int64_t first,
                           float* best_value, int64_t* best_id, uint8_t* best_nan) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)M, (void)N, (void)K, (void)first;
    (void)best_value, (void)best_id, (void)best_nan;
    return -2;  // built without AMX-BF16
}

int qmatmul_amx_silu_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                          const float* silu, uint16_t* y, int64_t y_stride, int M, int N, int K,
                          int num_threads) {
    (void)format, (void)x, (void)x_stride, (void)packed, (void)silu, (void)y, (void)y_stride;
    (void)M, (void)N, (void)K, (void)num_threads;
    return -2;
}

int qmatmul_amx_bf16(int format, const uint16_t* x, int64_t x_stride, const uint8_t* packed,
                     const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride,
                     int M, int N, int K, int num_threads) {
    (void)format, (void)x, (void)x_stride, (void)packed, (void)bias, (void)y_bf16, (void)y_f32;
    (void)y_stride, (void)M, (void)N, (void)K, (void)num_threads;
    return -2;
}

int matmul_amx_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                    const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride, int M,
                    int N, int K, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y_bf16, (void)y_f32;
    (void)y_stride, (void)M, (void)N, (void)K, (void)num_threads;
    return -2;  // built without AMX-BF16
}
#endif
