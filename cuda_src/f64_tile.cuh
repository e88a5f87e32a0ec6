// Float64 tiles of float32 inputs: what the float32 kernels (attn_fwd_fp32.cu, attn_bwd_fp32.cu)
// share. They compute in float64 on the FMA pipes: float32 -> float64 is exact and float64 sums
// and products are exact to far below float32's rounding, so the only float32 rounding left is
// the final one of each output (the accuracy rule holds every dtype to twice the error of the
// naive formula with each primitive op rounded once; float32 FMA chains or TF32 miss it).
//
// Thread layout of a ROWS x COLS product tile (A B^T, e.g. S = Q K^T): kLanes (8) threads across
// the columns, THREADS / 8 row groups down the rows. Thread (ty, tx) owns rows ty + kRowGroups * i
// (i < kRowsPerThread) and columns tx + 8 * jn (jn < kColsPerThread); in a P V-like product
// (ROWS x HEAD_DIM) the same rows and head-dim columns 2 * (tx + 8 * ch) and +1 (ch < kChunks).
// So a thread's row statistics only meet the 8 lanes of its row group.
#pragma once
#include "common.cuh"

template <int HEAD_DIM, int ROWS, int COLS, int THREADS>
struct F64Layout {
    static constexpr int kLanes = 8;                        // threads across columns / head dim
    static constexpr int kRowGroups = THREADS / kLanes;     // threads down the rows
    static constexpr int kRowsPerThread = ROWS / kRowGroups;
    static constexpr int kColsPerThread = COLS / kLanes;
    static constexpr int kDimsPerThread = HEAD_DIM / kLanes;
    static constexpr int kChunks = kDimsPerThread / 2;      // 16-byte (2 x double) loads per P V row
    // Row strides in doubles. +2 (16 bytes) shifts consecutive rows by 4 banks, so the 8 lanes of
    // a row group read 8 different column rows (or 4 row groups read 4 different rows) at once
    // without conflicts, and rows stay 16-byte aligned.
    static constexpr int kLd = HEAD_DIM + 2;   // head-dim tiles (Q, K, V, dO)
    static constexpr int kLdP = COLS + 2;      // product tiles (P, dS)
    static_assert(THREADS % 32 == 0 && 32 % kLanes == 0, "whole warps of 8-lane row groups");
    static_assert(ROWS % kRowGroups == 0, "rows split evenly over the row groups");
    static_assert(COLS % (2 * kLanes) == 0, "columns split evenly, product tiles read 2 at a time");
    static_assert(HEAD_DIM % (2 * kLanes) == 0, "head dim split evenly, read 2 columns at a time");
    static_assert((ROWS * HEAD_DIM) % THREADS == 0 && (COLS * HEAD_DIM) % THREADS == 0,
                  "tile loads split evenly over the threads");
};

// Blocks per SM a kernel's launch bounds promise: as many as shared memory allows (228 KiB per
// SM, 1 KiB reserved per block), at most 2 (128 registers a thread).
template <int SMEM_BYTES>
struct F64Occupancy {
    static constexpr int kSmemBlocks = (228 * 1024) / (SMEM_BYTES + 1024);
    static constexpr int kMinBlocks = kSmemBlocks >= 2 ? 2 : 1;
};

// The launch must provide the shared memory the kernel lays out (Python mirrors the formula):
// fail loudly rather than write past the allocation.
__device__ __forceinline__ void require_dynamic_smem(u32 bytes) {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
}

// This thread's share of a ROWS x HEAD_DIM tile: elements tid + it * THREADS in row-major order,
// so consecutive threads take consecutive columns and each warp reads whole row segments. The
// position is walked incrementally from an opaque copy of threadIdx.x: otherwise the compiler
// hoists every element's 64-bit offset out of the key loop and holds them all in registers.
template <int HEAD_DIM, int THREADS>
struct TileWalk {
    int row, col;
    __device__ __forceinline__ TileWalk() {
        int tid = threadIdx.x;
        asm volatile("" : "+r"(tid));
        row = tid / HEAD_DIM;
        col = tid % HEAD_DIM;
    }
    __device__ __forceinline__ void next() {
        row += THREADS / HEAD_DIM;
        if constexpr (THREADS % HEAD_DIM != 0) {
            col += THREADS % HEAD_DIM;
            if (col >= HEAD_DIM) {
                col -= HEAD_DIM;
                ++row;
            }
        }
    }
};

// Fetch this thread's share of a tile from global memory; rows >= rows_valid and columns >= d
// read as 0 (zero columns add nothing to dot products; zero rows are masked or meet p = 0).
template <int HEAD_DIM, int THREADS, int N>
__device__ __forceinline__ void fetch_tile(float (&r)[N], const float* gmem, i64 ld, int rows_valid, int d) {
    TileWalk<HEAD_DIM, THREADS> w;
#pragma unroll
    for (int it = 0; it < N; ++it, w.next())
        r[it] = (w.row < rows_valid && w.col < d) ? gmem[w.row * ld + w.col] : 0.f;
}

// Store a fetched share into a float64 shared tile (row stride LD); the conversion is exact.
template <int HEAD_DIM, int THREADS, int LD, int N>
__device__ __forceinline__ void store_tile(double* smem, const float (&r)[N]) {
    TileWalk<HEAD_DIM, THREADS> w;
#pragma unroll
    for (int it = 0; it < N; ++it, w.next()) smem[w.row * LD + w.col] = (double)r[it];
}

__device__ __forceinline__ double lanes8_max(double x) {
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ double lanes8_sum(double x) {
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// s = A B^T over HEAD_DIM for this thread's RM rows (a + i * A_STEP) and RN columns (b + jn *
// B_STEP) of float64 shared tiles, 2 head-dim columns per 16-byte load; the smaller operand set of
// a 2-column step is held in registers, the other streamed.
template <int HEAD_DIM, int RM, int RN, int A_STEP, int B_STEP>
__device__ __forceinline__ void dot_rows(double (&s)[RM][RN], const double* a, const double* b) {
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int jn = 0; jn < RN; ++jn) s[i][jn] = 0.0;
#pragma unroll 4
    for (int kk = 0; kk < HEAD_DIM; kk += 2) {
        if constexpr (RM <= RN) {
            double2 av[RM];
#pragma unroll
            for (int i = 0; i < RM; ++i) av[i] = *reinterpret_cast<const double2*>(a + i * A_STEP + kk);
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) {
                const double2 bv = *reinterpret_cast<const double2*>(b + jn * B_STEP + kk);
#pragma unroll
                for (int i = 0; i < RM; ++i) {
                    s[i][jn] = fma(av[i].x, bv.x, s[i][jn]);
                    s[i][jn] = fma(av[i].y, bv.y, s[i][jn]);
                }
            }
        } else {
            double2 bv[RN];
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) bv[jn] = *reinterpret_cast<const double2*>(b + jn * B_STEP + kk);
#pragma unroll
            for (int i = 0; i < RM; ++i) {
                const double2 av = *reinterpret_cast<const double2*>(a + i * A_STEP + kk);
#pragma unroll
                for (int jn = 0; jn < RN; ++jn) {
                    s[i][jn] = fma(av.x, bv[jn].x, s[i][jn]);
                    s[i][jn] = fma(av.y, bv[jn].y, s[i][jn]);
                }
            }
        }
    }
}

// acc += P V for this thread's RM rows: P rows at p + i * P_STEP (K columns, a float64 shared
// tile), V rows LD apart with v at this thread's first column pair (tile + 2 * tx); the thread's
// column pairs are 16 doubles (8 lanes x 2) apart.
template <int K, int RM, int CH, int P_STEP, int LD>
__device__ __forceinline__ void acc_rows(double (&acc)[RM][2 * CH], const double* p, const double* v) {
#pragma unroll 2
    for (int kk = 0; kk < K; kk += 2) {
        double2 pv[RM];
#pragma unroll
        for (int i = 0; i < RM; ++i) pv[i] = *reinterpret_cast<const double2*>(p + i * P_STEP + kk);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const double* v_row = v + (kk + e) * LD;
#pragma unroll
            for (int ch = 0; ch < CH; ++ch) {
                const double2 vv = *reinterpret_cast<const double2*>(v_row + ch * 16);
#pragma unroll
                for (int i = 0; i < RM; ++i) {
                    const double pe = e == 0 ? pv[i].x : pv[i].y;
                    acc[i][2 * ch] = fma(pe, vv.x, acc[i][2 * ch]);
                    acc[i][2 * ch + 1] = fma(pe, vv.y, acc[i][2 * ch + 1]);
                }
            }
        }
    }
}
