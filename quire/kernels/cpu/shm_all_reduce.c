// The collectives of tensor-parallel ranks on one host, in C, for the decode step
// (decode_layer.c): the protocol of quire/distributed/shm_all_reduce.py over the same mapped
// file, so a step's C calls and the modules' Python calls take turns on one sequence of calls.
//
// The file: one flag per rank (an int64 call number, 64 bytes apart), then two sets of one slot
// per rank. A call is numbered one past the rank's own flag; the rank copies its data into its
// slot of the set the number's parity picks, publishes the number in its flag, and waits until
// every flag has reached it. Every rank then reads the slots in rank order, so all get the same
// bits. A rank reuses a set two calls later, after every rank has published the call between,
// which each does only after reading the set.
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define FLAG_STRIDE 8  // int64s per rank's flag (shm_all_reduce.py's _FLAG_STRIDE)
// Checks before a waiting rank yields its core: ranks on cores of their own meet within them;
// with more ranks than free cores the one waited for needs the core.
#define SPINS_BEFORE_YIELD 4096

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t* flag_of(const ShmGroup* g, int rank) {
    return (int64_t*)g->base + (int64_t)rank * FLAG_STRIDE;
}

// The slot set of this rank's next call (rank r's slot at r * slot_bytes); *call: its number.
static uint8_t* next_slots(const ShmGroup* g, int64_t* call) {
    *call = __atomic_load_n(flag_of(g, g->rank), __ATOMIC_RELAXED) + 1;
    return (uint8_t*)g->base + (int64_t)g->world_size * FLAG_STRIDE * 8 +
           (*call & 1) * g->world_size * g->slot_bytes;
}

// Publishes the call (this rank's slot written) and returns once every rank has.
static void publish_and_wait(const ShmGroup* g, int64_t call) {
    __atomic_store_n(flag_of(g, g->rank), call, __ATOMIC_RELEASE);
    for (int r = 0; r < g->world_size; r++) {
        const int64_t* flag = flag_of(g, r);
        for (int spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < call; spins++) {
            if (spins < SPINS_BEFORE_YIELD)
                cpu_relax();
            else
                sched_yield();
        }
    }
}

// x [n] bf16, in place: the sum over the ranks, added in rank order and rounded to bf16 after
// each addition (torch.add of bf16 tensors, as the Python all-reduce sums). Returns 0, or -6
// when x is larger than a slot.
int shm_all_reduce_bf16(const ShmGroup* g, uint16_t* x, int64_t n) {
    const int64_t bytes = n * (int64_t)sizeof(uint16_t);
    if (bytes > g->slot_bytes) return -6;
    int64_t call;
    uint8_t* slots = next_slots(g, &call);
    memcpy(slots + g->rank * g->slot_bytes, x, (size_t)bytes);
    publish_and_wait(g, call);
    const uint16_t* first = (const uint16_t*)slots;
    memcpy(x, first, (size_t)bytes);
    for (int r = 1; r < g->world_size; r++) {
        const uint16_t* part = (const uint16_t*)(slots + r * g->slot_bytes);
        for (int64_t i = 0; i < n; i++)
            x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(part[i]));
    }
    return 0;
}

// One rank's best logit of a row over its vocabulary range; NaN ranks above every number, as
// in torch.argmax (told by its bits: the library is built with -ffast-math).
typedef struct {
    float value;
    int32_t is_nan;
    int64_t id;  // in the whole vocabulary
} RowBest;

// ids [rows]: in, the argmax of each row over this rank's range of the vocabulary (from
// vocab_start on, as argmax_f32 takes it), whose logit is values [rows]; out, the argmax over
// every rank's range as a vocabulary id, the same on every rank: the first in vocabulary order
// among equal maxima (the ranks hold contiguous ranges in rank order), the first NaN before any
// number, as torch.argmax over the gathered logits. Returns 0, or -6 when the rows do not fit a
// slot.
int shm_argmax_rows(const ShmGroup* g, const float* values, int64_t vocab_start, int64_t* ids,
                    int rows) {
    if ((int64_t)rows * (int64_t)sizeof(RowBest) > g->slot_bytes) return -6;
    int64_t call;
    uint8_t* slots = next_slots(g, &call);
    RowBest* own = (RowBest*)(slots + g->rank * g->slot_bytes);
    for (int b = 0; b < rows; b++) {
        const float* value = values + b;
        uint32_t bits;
        memcpy(&bits, value, sizeof bits);
        own[b] = (RowBest){*value, (bits & 0x7FFFFFFFu) > 0x7F800000u, vocab_start + ids[b]};
    }
    publish_and_wait(g, call);
    for (int b = 0; b < rows; b++) {
        RowBest win = ((const RowBest*)slots)[b];
        for (int r = 1; r < g->world_size && !win.is_nan; r++) {
            const RowBest other = ((const RowBest*)(slots + r * g->slot_bytes))[b];
            if (other.is_nan || other.value > win.value) win = other;
        }
        ids[b] = win.id;
    }
    return 0;
}
