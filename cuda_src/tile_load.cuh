// Global -> shared tile copies shared by every kernel.
#pragma once
#include "common.cuh"

// Copy a ROWS x COLS tile (row stride `ld` elements) into swizzled shared memory with THREADS
// threads (tid = this thread's index among them: threadIdx.x for a block, the lane for a warp).
// Rows >= rows_valid and columns >= d are zero-filled: zero K rows get masked to -inf later,
// zero V rows meet p = 0, and zero columns add nothing to the dot products.
// VEC: 16-byte cp.async (d % 8 == 0, 16-byte aligned rows), asynchronous; otherwise element
// loads and one 16-byte shared store per chunk, synchronous. L2_PREFETCH: cp_async16's hint.
template <int COLS, int ROWS, int THREADS, bool VEC, int L2_PREFETCH = 0>
__device__ __forceinline__ void load_tile_rows(u16* smem, const u16* gmem, i64 ld, int rows_valid, int d, int tid) {
    using Swz = Swizzle<COLS>;
    constexpr int kChunks = COLS / 8;
    constexpr int kIters = ROWS * kChunks / THREADS;
    constexpr bool kFixedCol = THREADS % kChunks == 0;  // each thread keeps one column
    constexpr int kRowStep = THREADS / kChunks;         // rows advanced per iteration
    static_assert((ROWS * kChunks) % THREADS == 0, "tile loads split evenly over the threads");
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        int row, col;
        if constexpr (kFixedCol) {
            row = tid / kChunks + it * kRowStep;
            col = (tid % kChunks) * 8;
        } else {
            const int i = it * THREADS + tid;
            row = i / kChunks;
            col = (i % kChunks) * 8;
        }
        u16* dst = smem + Swz::offset(row, col);
        if constexpr (VEC) {
            const bool ok = row < rows_valid && col < d;
            cp_async16<L2_PREFETCH>(dst, ok ? gmem + row * ld + col : gmem, ok);
        } else {
            u32 w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c0 = col + 2 * e;
                const u32 lo = (row < rows_valid && c0 < d) ? gmem[row * ld + c0] : 0u;
                const u32 hi = (row < rows_valid && c0 + 1 < d) ? gmem[row * ld + c0 + 1] : 0u;
                w[e] = lo | (hi << 16);
            }
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// load_tile_rows for a tile wholly in range (ROWS rows from gmem, d == COLS, 16-byte aligned
// rows): no predicates, and one 64-bit source offset per thread advanced by a fixed row step, where
// the general copy recomputes row * ld and both bounds for every chunk (ncu, H200, MQA decode at
// d=128: our wide kernel ran 35% more instructions than FA2's; the step's copy was ~27% of the
// step loop's PTX). Each thread keeps one column, and the row step is a multiple of the swizzle's
// 8-row period, so the shared offset advances by a constant too.
template <int COLS, int ROWS, int THREADS, int L2_PREFETCH = 0>
__device__ __forceinline__ void load_tile_rows_full(u16* smem, const u16* gmem, i64 ld, int tid) {
    using Swz = Swizzle<COLS>;
    constexpr int kChunks = COLS / 8;
    constexpr int kRowStep = THREADS / kChunks;
    static_assert(COLS >= 64 && THREADS % kChunks == 0 && kRowStep % 8 == 0 && ROWS % kRowStep == 0,
                  "a fixed column per thread and a row step of whole swizzle periods");
    const int row = tid / kChunks, col = (tid % kChunks) * 8;
    u16* dst = smem + Swz::offset(row, col);
    const u16* src = gmem + row * ld + col;
    const i64 step = kRowStep * ld;
#pragma unroll
    for (int it = 0; it < ROWS / kRowStep; ++it) cp_async16<L2_PREFETCH>(dst + it * kRowStep * COLS, src + it * step, true);
}

// Whether load_tile_rows_full applies to a COLS x ROWS tile copied by THREADS threads.
template <int COLS, int ROWS, int THREADS>
__host__ __device__ constexpr bool tile_rows_full_fits() {
    return COLS >= 64 && THREADS % (COLS / 8) == 0 && (THREADS / (COLS / 8)) % 8 == 0 &&
           ROWS % (THREADS / (COLS / 8)) == 0;
}
