// Hopper (sm_90a) building blocks: the 128-byte-swizzled shared-memory tile wgmma reads, its
// matrix descriptors, and the fences/commit/wait protocol of the asynchronous tensor cores.
#pragma once
#include "common.cuh"
#include "wgmma_ops.cuh"

// ---- the tile layout: [COLS / 64][ROWS][64], each 128-byte row's 16-byte chunks XOR (row % 8) ----
// This is the canonical 128B-swizzle layout of wgmma for both majors: a K-major operand (Q, K)
// reads 64-element column blocks of its rows; an N-major operand (V) reads the same rows as K
// steps. The tile base must be 1024-byte aligned (the XOR pattern repeats every 8 rows).
template <int COLS, int ROWS>
struct Sw128Tile {
    static_assert(COLS % 64 == 0, "128-byte swizzle atoms are 64 16-bit elements wide");
    static constexpr int kChunks = COLS / 8;           // 16-byte chunks per logical row
    static constexpr int kBlockBytes = ROWS * 128;     // one 64-column block of every row
    static constexpr int kBytes = COLS * ROWS * 2;
    // Byte offset of logical (row, 16-byte chunk c).
    static __device__ __forceinline__ u32 offset(int row, int c) {
        return (c >> 3) * kBlockBytes + row * 128 + (((c & 7) ^ (row & 7)) << 4);
    }
};

// Per-lane ldmatrix addresses over a [COLS / 64][ROWS][64] 128B-swizzled tile (the layout a TMA
// box with 128-byte swizzle writes), with LaneAddr's interface: the lane's row and chunk are
// fixed, a fragment adds row_c (a multiple of 8) and an even chunk_c.
template <int ROWS>
struct Sw128LaneAddr {
    u32 base;  // shared byte address of the lane's row in column block 0
    int key;   // chunk_lane ^ (row % 8)
    __device__ __forceinline__ Sw128LaneAddr(u32 tile, int row_lane, int chunk_lane) {
        base = tile + row_lane * 128;
        key = chunk_lane ^ (row_lane & 7);
    }
    __device__ __forceinline__ u32 at(int row_c, int chunk_c) const {
        return base + (chunk_c >> 3) * (ROWS * 128) + row_c * 128 + (((chunk_c & 7) ^ key) << 4);
    }
};

// Copy a ROWS x COLS tile (row stride ld elements) with 16-byte cp.async by THREADS threads.
// Rows >= rows_valid and columns >= d are zero-filled (they are masked or multiply zeros).
// UNROLL = false keeps the loop rolled: a warp-specialized producer has ~40 registers.
template <int COLS, int ROWS, int THREADS, bool UNROLL = true>
__device__ __forceinline__ void load_sw128(u32 smem, const u16* gmem, i64 ld, int rows_valid, int d, int tid) {
    using L = Sw128Tile<COLS, ROWS>;
    constexpr int kTotal = ROWS * L::kChunks;
#pragma unroll(UNROLL ? (kTotal + THREADS - 1) / THREADS : 1)
    for (int it = 0; it < (kTotal + THREADS - 1) / THREADS; ++it) {
        const int i = it * THREADS + tid;
        if (kTotal % THREADS != 0 && i >= kTotal) break;
        const int row = i / L::kChunks, c = i % L::kChunks;
        const bool ok = row < rows_valid && c * 8 < d;
        const u16* src = ok ? gmem + row * ld + c * 8 : gmem;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem + L::offset(row, c)), "l"(src),
                     "r"(ok ? 16 : 0));
    }
}

// ---- matrix descriptors (PTX "matrix descriptor format"), 128-byte swizzle ----
// Addresses and byte offsets are stored in 16-byte units. For a K-major operand, `stride` is the
// distance between 8-row groups (1024 in this layout) and `leading` is unused; for an N-major
// operand, `leading` is the distance between 64-column blocks and `stride` between 8-row (K) groups.
__device__ __forceinline__ unsigned long long sw128_desc(u32 addr, u32 leading, u32 stride) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((leading >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// ---- the asynchronous protocol ----
// fence: registers written by ordinary instructions (accumulators being rescaled, A fragments)
// are ready for the next wgmma; commit: close a group of issued wgmmas; wait<N>: at most N groups
// still in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pin registers at this point of the program: the compiler may not move their reads above a
// wait (an accumulator still being written) nor reuse them before it (an A fragment still read).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// Shared memory written through the generic proxy (cp.async, ordinary stores) is read by wgmma
// through the async proxy: each writing thread fences before the barrier that publishes it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- mbarriers (shared-memory arrive/wait barriers with phases) ----
// A warp-specialized kernel's producer and consumers hand tiles over through them instead of
// block-wide barriers: "full" when a tile has landed, "empty" when its slot may be refilled.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrive once this thread's cp.async copies issued so far have landed (the count was set at init).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase with this parity has completed (a fresh barrier counts parity 1 as done).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// A barrier over the first `threads` threads of the block (id 0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrive at named barrier `id` without waiting (the other side's bar.sync counts this warp).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
