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

// The row a source row k takes in a tile stored "8-permuted": within each group of 8 rows, source
// row k sits at row 2 (k % 4) + (k % 8) / 4, i.e. row r holds source row r / 2 + 4 (r % 2). An mma
// whose B operand reads rows g = 0..7 of such a tile as its n columns leaves, in C's columns 2t and
// 2t + 1, the source rows t and t + 4 - exactly the k elements of an A fragment (mma_f64 below).
__device__ __forceinline__ int slot8(int k) { return (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1); }

// Store a fetched share into a float64 shared tile (row stride LD); the conversion is exact.
template <int HEAD_DIM, int THREADS, int LD, int N>
__device__ __forceinline__ void store_tile(double* smem, const float (&r)[N]) {
    TileWalk<HEAD_DIM, THREADS> w;
#pragma unroll
    for (int it = 0; it < N; ++it, w.next()) smem[w.row * LD + w.col] = (double)r[it];
}

// store_tile with the 8-permuted row order (slot8).
template <int HEAD_DIM, int THREADS, int LD, int N>
__device__ __forceinline__ void store_tile_perm8(double* smem, const float (&r)[N]) {
    TileWalk<HEAD_DIM, THREADS> w;
#pragma unroll
    for (int it = 0; it < N; ++it, w.next()) smem[slot8(w.row) * LD + w.col] = (double)r[it];
}

// A ROWS x HEAD_DIM float32 tile into a float64 shared tile (rows >= rows_valid read as 0), in
// source order or (PERM8) 8-permuted.
template <int HEAD_DIM, int THREADS, int ROWS, int LD, bool PERM8 = false>
__device__ __forceinline__ void load_tile(double* smem, const float* gmem, i64 ld, int rows_valid, int d) {
    float r[ROWS * HEAD_DIM / THREADS];
    fetch_tile<HEAD_DIM, THREADS>(r, gmem, ld, rows_valid, d);
    if constexpr (PERM8) store_tile_perm8<HEAD_DIM, THREADS, LD>(smem, r);
    else store_tile<HEAD_DIM, THREADS, LD>(smem, r);
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

// ---------------------------------------------------------------------------------------------
// Float64 tensor cores: mma.sync m16n8k8 .f64 (sm_90: 66 TFLOP/s on the H200, twice the DFMA
// pipe's and twice m8n8k4's, measured). Exact products of float32 values, float64 sums.
// Fragments, g = lane / 4, t = lane % 4 (checked on the H200):
//   A (16 x 8):  {A[g][t], A[g + 8][t], A[g][t + 4], A[g + 8][t + 4]}
//   B (8 x 8, k x n): {B[t][g], B[t + 4][g]}
//   C (16 x 8):  {C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1]}
__device__ __forceinline__ void mma_f64(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}

// The A fragment of rows r0 + g, r0 + g + 8 and k-step kk of a row-major float64 tile X (row
// stride LD): x = X + (r0 + g) * LD + t.
template <int LD>
__device__ __forceinline__ void frag_a(double (&a)[4], const double* x, int kk) {
    a[0] = x[8 * kk];
    a[1] = x[8 * LD + 8 * kk];
    a[2] = x[8 * kk + 4];
    a[3] = x[8 * LD + 8 * kk + 4];
}

// The B fragment of A Y^T (Y's rows are the n columns): rows 8 nt + g, k-step kk; y = Y + g * LD + t.
template <int LD>
__device__ __forceinline__ void frag_b_rows_n(double (&b)[2], const double* y, int nt, int kk) {
    b[0] = y[8 * nt * LD + 8 * kk];
    b[1] = y[8 * nt * LD + 8 * kk + 4];
}

// The B fragment of P Y (Y's rows are the k index), k-step kk, column tile dt; PERM8: Y stored
// 8-permuted (source row t at 2t, t + 4 at 2t + 1). y = Y + g.
template <int LD, bool PERM8>
__device__ __forceinline__ void frag_b_rows_k(double (&b)[2], const double* y, int t, int kk, int dt) {
    const int r0 = PERM8 ? 8 * kk + 2 * t : 8 * kk + t;
    const int r1 = PERM8 ? r0 + 1 : r0 + 4;
    b[0] = y[r0 * LD + 8 * dt];
    b[1] = y[r1 * LD + 8 * dt];
}

// c[nt] = X Y^T over the head dim (KT k-steps) for this warp's 16 rows and its 8-column tiles
// nt0 + nt of Y's rows: x = X + (r0 + g) * LD + t, y = Y + g * LD + t.
template <int KT, int NT, int LD>
__device__ __forceinline__ void mma_rows_by_rows(double (&c)[NT][4], const double* x, const double* y, int nt0 = 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0;
#pragma unroll 2
    for (int kk = 0; kk < KT; ++kk) {
        double a[4];
        frag_a<LD>(a, x, kk);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            double bb[2];
            frag_b_rows_n<LD>(bb, y, nt0 + nt, kk);
            mma_f64(c[nt], a, bb);
        }
    }
}

// C of an S-like product whose B rows were 8-permuted, as the A fragment of the next product
// (its k index = the permuted rows' source order).
__device__ __forceinline__ void c_as_a(double (&a)[4], const double (&c)[4]) {
    a[0] = c[0];
    a[1] = c[2];
    a[2] = c[1];
    a[3] = c[3];
}

// acc += C Y for one 8-deep k-step kk: C (this warp's 16 rows, from an S-like product whose B
// rows were 8-permuted) as the A fragment, Y's rows kk * 8 .. + 7 across its DT column tiles
// (y = Y + g; PERM8: Y stored 8-permuted).
template <int DT, int LD, bool PERM8>
__device__ __forceinline__ void mma_c_by_rows(double (&acc)[DT][4], const double (&c)[4], const double* y, int t, int kk) {
    double a[4];
    c_as_a(a, c);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        double bb[2];
        frag_b_rows_k<LD, PERM8>(bb, y, t, kk, dt);
        mma_f64(acc[dt], a, bb);
    }
}

// Round (acc + part) * mul (C fragments of a warp's rows r0 + g, + 8; part, if given, in the same
// order as 4 * dt + i) to float32 rows of g_out (row stride ld), rows < rows_valid, columns < d.
template <int DT, bool ADD = false>
__device__ __forceinline__ void store_c_rows(float* g_out, i64 ld, const double (&acc)[DT][4], double mul, int r0,
                                             int g, int t, int rows_valid, int d, const double* part = nullptr) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = r0 + g + 8 * hf;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dt + 2 * t + e;
                if (col < d) {
                    if constexpr (ADD) g_out[row * ld + col] = (float)((acc[dt][2 * hf + e] + part[4 * dt + 2 * hf + e]) * mul);
                    else g_out[row * ld + col] = (float)(acc[dt][2 * hf + e] * mul);
                }
            }
    }
}

__device__ __forceinline__ double quad_max(double x) {
    x = fmax(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmax(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ double quad_sum(double x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The caller's row statistics, prefilled in ws_lse2 (its float32 lse in base 2) and ws_d (rowsum(dO * O)
// of its O): the exact ones computed here replace them only where the given lse is within a few
// float32 roundings of this call's own (2^-21 |lse|), i.e. the call holds all the keys the row saw.
// A given lse over more keys (a merged, global one: context parallelism passes a slice of the keys)
// is used as given, with its D; a given -inf with keys visible here gives P = 0 (lse2 = +inf).
__device__ __forceinline__ void given_row_stats(double& lse2, double& dsum, double g_lse2, double g_d) {
    const double tol = ldexp(fmax(fabs(g_lse2), 1.4426950408889634), -21);
    if (isfinite(lse2) && isfinite(g_lse2) && fabs(lse2 - g_lse2) <= tol) return;
    if (lse2 == -INFINITY && g_lse2 == -INFINITY) return;  // the row sees no key at all
    lse2 = g_lse2 == -INFINITY ? INFINITY : g_lse2;
    dsum = g_d;
}
