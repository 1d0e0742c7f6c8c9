// The integer sums of qmatmul.c (Q8_0, Q4_0, Q4_1 blocks against int8 rows of x) on AMX tiles,
// for prompt chunks on CPUs with AMX-INT8: bit for bit the VNNI loop's results, so qmatmul_bf16
// may hand any number of rows here (it does from QMATMUL_AMX_ROWS on) without a row's bits
// depending on the batch.
//
// Why the bits are the same: a block's sum over its 32 columns is an exact integer either way,
// and the float32 part after it (times d dx, then for Q4_1 plus m dx sx, blocks in order of k) is
// written out here in the VNNI loop's operations and order. tdpbusd multiplies unsigned bytes of
// its first tile by signed bytes of its second, so x goes in as the first (tokens by K; its int8
// codes plus 128: xu = qx ^ 0x80) and the weights as the second (K by outputs; Q4 nibbles 0..15
// as they are, Q8_0 codes as signed bytes), and each block's tile sum is
//   sum((qx + 128) w) = sum(qx w) + 128 W,   W = sum(w) over the block's 32 codes,
// from which the VNNI loop's sum(u qx) (or, for Q8_0, sum(u qx) - 128 sx) is C - 128 W.
//
// A panel's blocks are unpacked once per call into tiles (the weight codes of 32 outputs in
// tdpbusd's layout: row j holds codes 4j..4j+3 of each output) with their W, then every group of
// up to 32 rows of x runs through them: four tile products a block, the float32 part on the
// 32 x 32 sums in AVX-512.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define QPANEL 32
#define QBLOCK 32

enum { Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__)
#include <immintrin.h>

#define ROW_GROUP 32
#define TILE_BYTES 512                        // one unpacked half panel: 8 rows of 64 bytes
#define BLOCK_BYTES (2 * TILE_BYTES + 2 * 64)  // both halves, then W of the 32 outputs

int qmatmul_amx_available(void) { return matmul_amx_available(); }

int64_t qmatmul_amx_scratch_bytes(int K) { return (int64_t)(K / QBLOCK) * BLOCK_BYTES; }

static int codes_bytes(int format) { return format == Q8_0 ? QPANEL * QBLOCK : QPANEL * QBLOCK / 2; }

// The panel's blocks in tdpbusd's layout (see the top), each followed by W of its 32 outputs.
static void unpack_panel(int format, const uint8_t* p, int nb, uint8_t* scratch) {
    const int record = qmatmul_record_bytes(format);
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int b = 0; b < nb; b++, p += record, scratch += BLOCK_BYTES) {
        for (int half = 0; half < 2; half++) {
            uint8_t* tile = scratch + half * TILE_BYTES;
            __m512i w = _mm512_setzero_si512();
            if (format == Q8_0) {
                for (int g = 0; g < 8; g++) {
                    const __m512i q = _mm512_xor_si512(
                        _mm512_loadu_si512(p + g * 128 + half * 64), flip);
                    _mm512_storeu_si512(tile + g * 64, q);
                    w = _mm512_dpbusd_epi32(w, ones, q);
                }
            } else {
                for (int g = 0; g < 4; g++) {
                    const __m512i v = _mm512_loadu_si512(p + g * 128 + half * 64);
                    const __m512i lo = _mm512_and_si512(v, low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    _mm512_storeu_si512(tile + g * 64, lo);
                    _mm512_storeu_si512(tile + (4 + g) * 64, hi);
                    w = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(w, ones, lo), ones, hi);
                }
            }
            _mm512_storeu_si512(scratch + 2 * TILE_BYTES + half * 64, w);
        }
    }
}

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// Tiles 0-3: int32 sums of rows 0-15 / 16-31 by outputs 0-15 / 16-31; 4, 5: rows 0-15 and 16-31
// of xu, a block's 32 bytes; 6, 7: the block's codes of outputs 0-15 and 16-31.
static void configure_tiles(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0;
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)r1;
    c.colsb[0] = c.colsb[1] = 64;
    c.colsb[4] = 32;
    if (r1) {
        c.colsb[2] = c.colsb[3] = 64;
        c.colsb[5] = 32;
    }
    c.rows[6] = c.rows[7] = 8;
    c.colsb[6] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

// `rows` (1..32, as configured) rows of xu against the unpacked panel: out [32][32] float32 sums,
// the VNNI loop's (qmatmul.c, qpanel) operation for operation.
static void amx_rows(int format, int rows, const uint8_t* xu, const float* xd, const int32_t* xs,
                     int K, const uint8_t* scratch, const uint8_t* p, float* out) {
    const int nb = K / QBLOCK, record = qmatmul_record_bytes(format), cb = codes_bytes(format);
    const int two = rows > 16;
    int32_t sums[ROW_GROUP * QPANEL];
    __m512 acc[ROW_GROUP][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, p += record, scratch += BLOCK_BYTES) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, xu + b * QBLOCK, K);
        _tile_loadd(6, scratch, 64);
        _tile_loadd(7, scratch + TILE_BYTES, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_stored(0, sums, QPANEL * sizeof(int32_t));
        _tile_stored(1, sums + 16, QPANEL * sizeof(int32_t));
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(5, xu + (int64_t)16 * K + b * QBLOCK, K);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
            _tile_stored(2, sums + 16 * QPANEL, QPANEL * sizeof(int32_t));
            _tile_stored(3, sums + 16 * QPANEL + 16, QPANEL * sizeof(int32_t));
        }
        const __m512i w128[2] = {
            _mm512_slli_epi32(_mm512_loadu_si512(scratch + 2 * TILE_BYTES), 7),
            _mm512_slli_epi32(_mm512_loadu_si512(scratch + 2 * TILE_BYTES + 64), 7)};
        const uint8_t* sc = p + cb;
        const __m512 d[2] = {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc)),
                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)))};
        __m512 mins[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        if (format == Q4_1) {
            mins[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 64)));
            mins[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 96)));
        }
        for (int m = 0; m < rows; m++) {
            const int32_t sx = xs[m * nb + b];
            const float dx = xd[m * nb + b];
            const __m512i start = _mm512_set1_epi32(format == Q4_0 ? -8 * sx : 0);
            const __m512 dxv = _mm512_set1_ps(dx);
            for (int h = 0; h < 2; h++) {
                const __m512i tile_sum = _mm512_loadu_si512(sums + m * QPANEL + 16 * h);
                const __m512i dot = _mm512_add_epi32(_mm512_sub_epi32(tile_sum, w128[h]), start);
                acc[m][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[h], dxv),
                                            acc[m][h]);
            }
            if (format == Q4_1) {
                const __m512 dsx = _mm512_set1_ps(dx * (float)sx);
                acc[m][0] = _mm512_fmadd_ps(mins[0], dsx, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(mins[1], dsx, acc[m][1]);
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm512_storeu_ps(out + m * QPANEL, acc[m][0]);
        _mm512_storeu_ps(out + m * QPANEL + 16, acc[m][1]);
    }
}

// One panel (outputs n0..n0 + 31 of N) against all M rows: unpacked into `scratch`
// (qmatmul_amx_scratch_bytes), then rows in groups of 32, stored as qmatmul_bf16 stores them.
void qmatmul_amx_panel(int format, const uint8_t* xu, const float* xd, const int32_t* xs, int M,
                       int K, const uint8_t* p, uint8_t* scratch, int n0, int N,
                       const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride) {
    const int nb = K / QBLOCK;
    float out[ROW_GROUP * QPANEL];
    unpack_panel(format, p, nb, scratch);
    int configured = 0;
    for (int m0 = 0; m0 < M; m0 += ROW_GROUP) {
        const int rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
        if (rows != configured) {
            configure_tiles(rows);
            configured = rows;
        }
        amx_rows(format, rows, xu + (int64_t)m0 * K, xd + (int64_t)m0 * nb, xs + (int64_t)m0 * nb,
                 K, scratch, p, out);
        store_panel(out, QPANEL, rows, m0, n0, N, bias, y_bf16, y_f32, y_stride);
    }
    _tile_release();
}
#else
int qmatmul_amx_available(void) { return 0; }

int64_t qmatmul_amx_scratch_bytes(int K) {
    (void)K;
    return 0;
}

void qmatmul_amx_panel(int format, const uint8_t* xu, const float* xd, const int32_t* xs, int M,
                       int K, const uint8_t* p, uint8_t* scratch, int n0, int N,
                       const uint16_t* bias, uint16_t* y_bf16, float* y_f32, int64_t y_stride) {
    (void)format, (void)xu, (void)xd, (void)xs, (void)M, (void)K, (void)p, (void)scratch;
    (void)n0, (void)N, (void)bias, (void)y_bf16, (void)y_f32, (void)y_stride;
}
#endif
