// cuflash device library: element types, conversions, and the PTX wrappers every kernel uses.
// Self-contained on purpose (no cuda_fp16.h / cuda_bf16.h): NVRTC then needs no include path,
// so the CPU compile check and the GPU run compile byte-identical sources.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Element type tags: 16-bit storage, the tensor-core instruction's type name picked at compile time.
struct Fp16 { static constexpr bool is_bf16 = false; };
struct Bf16 { static constexpr bool is_bf16 = true; };

// Two floats -> packed 16-bit pair (lo in the low half), round to nearest even.
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (T::is_bf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

template <typename T>
__device__ __forceinline__ float to_float(u16 x) {
    if constexpr (T::is_bf16) {
        return __uint_as_float(((u32)x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
}

template <typename T>
__device__ __forceinline__ u16 from_float(float f) {
    u16 r;
    if constexpr (T::is_bf16) {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    }
    return r;
}

// 2^x on the special-function unit; the softmax works in base 2 with log2(e) folded into the scale.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x, which the caller knows to be the same in every lane (a warp or warpgroup index), as ptxas can
// see it: read from lane 0. Derived from threadIdx, it counts as per-thread, so everything computed
// from it (shared-memory addresses, wgmma descriptors, ring slots) stays in vector registers and
// reaches the uniform datapath through R2UR (CUTLASS's canonical_warp_group_idx does the same).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- asynchronous global -> shared copies (cp.async, sm_80+) ----
// 16 bytes; when `valid` is false the destination is zero-filled and nothing is read.
// L2_PREFETCH (0, 64, 128 or 256): let L2 fetch that many bytes around the line from DRAM - a
// hint for the streaming reads of decoding, where larger DRAM requests may keep more in flight.
template <int L2_PREFETCH = 0>
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    static_assert(L2_PREFETCH == 0 || L2_PREFETCH == 64 || L2_PREFETCH == 128 || L2_PREFETCH == 256,
                  "PTX prefetch sizes are 64, 128 or 256 bytes");
    const int src_bytes = valid ? 16 : 0;
    if constexpr (L2_PREFETCH == 0) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                     "r"(src_bytes));
    } else if constexpr (L2_PREFETCH == 64) {
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                     "r"(src_bytes));
    } else if constexpr (L2_PREFETCH == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                     "r"(src_bytes));
    } else {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                     "r"(src_bytes));
    }
}
// 4 bytes (a float of the per-row statistics); cached in L1 (.ca: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- ldmatrix: four 8x8 16-bit matrices, one row address per lane ----
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- tensor-core product: D(16x8, f32) += A(16x16, row) * B(16x8, col) ----
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (T::is_bf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Accumulator (C) fragments of two adjacent 8-column tiles, 2*kk and 2*kk+1, rounded into the A
// fragment of one 16-deep mma step: the C layout of m16n8 equals the A layout of m16n8k16, so P
// (or dS) feeds the next product straight from registers.
template <typename T, int NS>
__device__ __forceinline__ void acc_to_a(u32 (&a)[4], const float (&acc)[NS][4], int kk) {
    a[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// ---- quad reductions: the four lanes that hold one accumulator row (lane = 4*row + t) ----
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- swizzled shared-memory tiles ----
// A tile of ROWS x COLS 16-bit elements, rows contiguous, stored in 16-byte chunks whose index is
// XOR-ed with the row so that the 8 row addresses of one ldmatrix hit 8 different bank groups.
// COLS must be a multiple of 64 (8 chunks), or exactly 32 (4 chunks, two rows per 128 bytes).
// The XOR key depends only on row % 8, so a lane whose rows differ by multiples of 8 keeps one
// key, and every address it needs is its base plus compile-time offsets (few live registers).
template <int COLS>
struct Swizzle {
    static_assert(COLS % 64 == 0 || COLS == 32, "tile width must be 32 or a multiple of 64");
    static constexpr int kChunks = COLS / 8;
    static __device__ __forceinline__ int row_key(int row) {
        if constexpr (COLS == 32) return (row >> 1) & 3;
        else return row & 7;
    }
    // Physical chunk of logical chunk c in a row with key `key`.
    static __device__ __forceinline__ int phys(int c, int key) {
        if constexpr (COLS == 32) return c ^ key;
        else return (c & ~7) | ((c ^ key) & 7);
    }
    // Element offset of (row, col), col a multiple of 8.
    static __device__ __forceinline__ int offset(int row, int col) {
        return row * COLS + phys(col >> 3, row_key(row)) * 8;
    }
};

// Per-lane ldmatrix address generator over a swizzled tile. The lane's own row and chunk
// (row_lane, chunk_lane) are fixed; a fragment adds row_c (multiple of 8) and chunk_c whose
// bits are disjoint from chunk_lane's (even when chunk_lane is 0 or 1).
template <int COLS>
struct LaneAddr {
    using Swz = Swizzle<COLS>;
    u32 base;  // shared byte address of the lane's row, chunk 0
    int key;   // chunk_lane ^ row key: XOR distributes over the disjoint bits of chunk_c
    // tile: shared byte address of the tile. Pass one kernel-wide base plus a compile-time
    // offset, so that lanes with the same (row_lane, chunk_lane) share registers across tiles.
    __device__ __forceinline__ LaneAddr(u32 tile, int row_lane, int chunk_lane) {
        base = tile + row_lane * COLS * 2;
        key = chunk_lane ^ Swz::row_key(row_lane);
    }
    __device__ __forceinline__ u32 at(int row_c, int chunk_c) const {
        return base + (row_c * COLS + Swz::phys(chunk_c, key) * 8) * 2;
    }
};

// One 16-deep step of ACC += P B: P's A fragments are rounded from the accumulator tile p
// (acc_to_a), B's come from `b` by transposed ldmatrix at rows row_c and chunks chunk0 + 0..NO.
// The P V product of the forward and decode kernels, and dQ = dS K of the backward.
// `b` is a LaneAddr or any lane address generator with the same at(row_c, chunk_c).
template <typename T, int MMA_M, int NP, int NO, typename Addr>
__device__ __forceinline__ void mma_acc_times_bt(float (&acc)[MMA_M][NO][4], const float (&p)[MMA_M][NP][4], int kk,
                                                 const Addr& b, int row_c, int chunk0, u32 off) {
    u32 a[MMA_M][4];
#pragma unroll
    for (int mi = 0; mi < MMA_M; ++mi) acc_to_a<T>(a[mi], p[mi], kk);
#pragma unroll
    for (int di = 0; di < NO; di += 2) {
        u32 bv[4];
        ldmatrix_x4_trans(bv, b.at(row_c, chunk0 + di) + off);
#pragma unroll
        for (int mi = 0; mi < MMA_M; ++mi) {
            mma_16816<T>(acc[mi][di], a[mi], bv[0], bv[1]);
            mma_16816<T>(acc[mi][di + 1], a[mi], bv[2], bv[3]);
        }
    }
}

// One 16-deep step of ACC += A K^T: A's fragments a (one per 16-row tile), K's B fragments by
// ldmatrix from `b` (key rows 8 ni, chunks 2 kk; 16 keys per load) plus byte offset `off`.
// S = Q K^T of the mma.sync forward and of split-KV decode.
template <typename T, int MMA_M, int NS, typename Addr>
__device__ __forceinline__ void mma_a_times_kt(float (&acc)[MMA_M][NS][4], const u32 (&a)[MMA_M][4], const Addr& b, int kk,
                                               u32 off) {
#pragma unroll
    for (int ni = 0; ni < NS; ni += 2) {
        u32 bk[4];
        ldmatrix_x4(bk, b.at(ni * 8, kk * 2) + off);
#pragma unroll
        for (int mi = 0; mi < MMA_M; ++mi) {
            mma_16816<T>(acc[mi][ni], a[mi], bk[0], bk[1]);
            mma_16816<T>(acc[mi][ni + 1], a[mi], bk[2], bk[3]);
        }
    }
}

// Vector atomic add of two adjacent floats, no return value: the backward kernels' dQ accumulation.
__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// Zero an array of mma accumulator fragments (unrolled: the array stays in registers).
template <int ROWS, int COLS>
__device__ __forceinline__ void zero_acc(float (&acc)[ROWS][COLS][4]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}
// Two arrays of one shape in one loop (as the kernels wrote it: zeroing them one after the other
// changed the d = 256 backward kernel's code).
template <int ROWS, int COLS>
__device__ __forceinline__ void zero_acc(float (&a)[ROWS][COLS][4], float (&b)[ROWS][COLS][4]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) a[i][j][e] = b[i][j][e] = 0.f;
}

// The backward kernels' per-row statistics of one query tile into buffer `buf` of sL and sD (ROWS
// floats each): lse * log2(e) and D of the rows from index stat on. Rows past `rows` or with no
// visible key (lse = -inf) must give p = 0: they store +inf. (Indexed as buf * ROWS + i: the form
// the kernels had inline, so their code is unchanged.)
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_row_stats(float* sL, float* sD, int buf, const float* __restrict__ lse,
                                               const float* __restrict__ dsum, i64 stat, int rows, int tid) {
    constexpr float kLog2e = 1.4426950408889634f;
    for (int i = tid; i < ROWS; i += THREADS) {
        const float l = i < rows ? lse[stat + i] : -INFINITY;
        sL[buf * ROWS + i] = l == -INFINITY ? INFINITY : l * kLog2e;
        sD[buf * ROWS + i] = i < rows ? dsum[stat + i] : 0.f;
    }
}

// threadIdx.x through a volatile read: code after it cannot be computed ahead of it, where the
// compiler would otherwise hoist per-thread address arithmetic out of a loop and keep it live.
__device__ __forceinline__ int thread_index_volatile() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// load_row_stats without the wait: rows < `rows` are copied raw by cp.async (in the caller's next
// commit group), the others get their final +inf / 0 at once. Once that group has been waited
// for, the same threads call fix_row_stats (before the barrier that publishes the tile), which
// turns lse into the stored form. The loads then overlap the step's GEMMs instead of stalling
// the warps that issue them (a global load's latency per step, and a block barrier behind it).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_row_stats_async(float* sL, float* sD, int buf, const float* __restrict__ lse,
                                                     const float* __restrict__ dsum, i64 stat, int rows, int tid) {
    for (int i = tid; i < ROWS; i += THREADS) {
        if (i < rows) {
            cp_async4(sL + buf * ROWS + i, lse + stat + i);
            cp_async4(sD + buf * ROWS + i, dsum + stat + i);
        } else {
            sL[buf * ROWS + i] = INFINITY;
            sD[buf * ROWS + i] = 0.f;
        }
    }
}
template <int ROWS, int THREADS>
__device__ __forceinline__ void fix_row_stats(float* sL, int buf, int rows, int tid) {
    constexpr float kLog2e = 1.4426950408889634f;
    for (int i = tid; i < min(rows, ROWS); i += THREADS) {
        const float l = sL[buf * ROWS + i];
        sL[buf * ROWS + i] = l == -INFINITY ? INFINITY : l * kLog2e;
    }
}

// ---- launch order under a causal mask: longest blocks first within groups of heads ----
// Blocks of a causal grid differ in length (the tiles on one side of the diagonal see more). For
// the grid's `lin`-th block in launch order (x fastest, then y, z), over `tiles` tiles per head and
// `heads` (head, batch) pairs: its head (y + gridDim.y z) and its rank among that head's tiles by
// length (0: the longest), launched rank-major within groups of G heads. The grid's end then has
// only short blocks left, and a group's K/V or Q/dO and dQ stay in L2 (all heads at once do not).
struct LptPos {
    int rank, head;
};
template <int G>
__device__ __forceinline__ LptPos lpt_head_groups(int tiles, int heads, int lin) {
    const int g0 = lin / (G * tiles) * G, gsz = min(G, heads - g0);
    const int r = lin - g0 * tiles;
    return {r / gsz, g0 + r % gsz};
}
__device__ __forceinline__ int grid_linear_block() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// Programmatic dependent launch (cuflash/pdl.py; sm_90): launch_dependents lets the kernel
// launched after this one as its programmatic dependent start once every block of this grid has
// executed it or left; wait blocks until the grid before this one has completed and its writes
// are visible. Both are no-ops without such a dependency.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
