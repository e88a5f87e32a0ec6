// Tiled forward attention for float32 inputs, computed in float64 on the FMA pipes.
//
// Why float64: the accuracy rule compares against the naive formula with every primitive op
// (each matmul included) evaluated exactly and rounded once to float32. A float32 dot product
// over d terms, or a float32 sum over Nk keys, accumulates many roundings and misses that rule by
// 1.5-4x on random inputs (TF32 tensor cores by orders of magnitude). float32 -> float64 is exact,
// and float64 products and sums are exact to far below float32's rounding, so the only float32
// rounding left is the final one of O and lse.
//
// Tiling: one block per (query tile, head, batch); the threads form kLanes (8) columns x
// kRowGroups rows. Thread (ty, tx) owns query rows ty + kRowGroups * i (i < kRowsPerThread) in
// both phases, so its softmax statistics only meet the 8 lanes of its row group:
//   S phase:  keys tx + 8 * jn of the K tile (jn < kKeysPerThread);
//   PV phase: head-dim columns 2 * (tx + 8 * ch) and +1 of O (ch < kDimsPerThread / 2).
// Q, K, V and P are float64 tiles in shared memory; global float32 tiles are converted once on
// the way in. The next tile is fetched into registers while the current one is used (V_j during
// S_j, K_{j+1} during P V_j), then stored after the barrier that frees its slot.
// Softmax in base 2: t = s * scale_log2, running max in that domain, p = exp2(t - m) (float64).
// Keys past Nk and causally invisible keys get t = -inf (zero-filled tile rows are never scored).
#include "common.cuh"

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS>
struct F64Traits {
    static constexpr int kLanes = 8;                        // threads across keys / head dim
    static constexpr int kRowGroups = THREADS / kLanes;     // threads down the query rows
    static constexpr int kRowsPerThread = BLOCK_M / kRowGroups;
    static constexpr int kKeysPerThread = BLOCK_N / kLanes;
    static constexpr int kDimsPerThread = HEAD_DIM / kLanes;
    static constexpr int kChunks = kDimsPerThread / 2;      // 16-byte (2 x double) V loads per key
    // Row strides in doubles. +2 (16 bytes) shifts consecutive rows by 4 banks, so the 8 lanes of
    // a row group read 8 different K rows (or 4 row groups read 4 different Q/P rows) at once
    // without conflicts, and rows stay 16-byte aligned.
    static constexpr int kLd = HEAD_DIM + 2;
    static constexpr int kLdP = BLOCK_N + 2;
    static constexpr int kSmemDoubles = (BLOCK_M + 2 * BLOCK_N) * kLd + BLOCK_M * kLdP;
    static constexpr int kSmemBytes = kSmemDoubles * 8;
    // Elements of one K or V tile each thread fetches (held in registers between barriers).
    static constexpr int kTileLoads = BLOCK_N * HEAD_DIM / THREADS;
    // Blocks per SM the launch bounds promise: as many as shared memory allows (228 KiB per SM,
    // 1 KiB reserved per block), at most 2 (128 registers a thread, enough for every tile here).
    static constexpr int kSmemBlocks = (228 * 1024) / (kSmemBytes + 1024);
    static constexpr int kMinBlocks = kSmemBlocks >= 2 ? 2 : 1;
    static_assert(THREADS % 32 == 0 && 32 % kLanes == 0, "whole warps of 8-lane row groups");
    static_assert(BLOCK_M % kRowGroups == 0, "query rows split evenly over the row groups");
    static_assert(BLOCK_N % (2 * kLanes) == 0, "keys split evenly, P read 2 keys at a time");
    static_assert(HEAD_DIM % (2 * kLanes) == 0, "head dim split evenly, V read 2 columns at a time");
    static_assert((BLOCK_M * HEAD_DIM) % THREADS == 0 && (BLOCK_N * HEAD_DIM) % THREADS == 0,
                  "tile loads split evenly over the threads");
};

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
// read as 0 (zero columns add nothing to dot products, zero V rows meet p = 0).
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

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, (F64Traits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>::kMinBlocks))
attn_fwd_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
             float* __restrict__ o, float* __restrict__ lse,
             i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
             i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
             int nq, int nk, int d, int group, int causal_off, double scale_log2) {
    using Tr = F64Traits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>;
    constexpr int RM = Tr::kRowsPerThread, RN = Tr::kKeysPerThread, DPT = Tr::kDimsPerThread;
    constexpr int CH = Tr::kChunks, RG = Tr::kRowGroups, NL = Tr::kLanes;
    constexpr int LD = Tr::kLd, LDP = Tr::kLdP;
    extern __shared__ __align__(16) double smem_f64[];

    // The launch must provide the shared memory this instantiation lays out (Python mirrors the
    // formula): fail loudly rather than write past the allocation.
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)Tr::kSmemBytes) __trap();
    }
    double* sQ = smem_f64;
    double* sK = sQ + BLOCK_M * LD;
    double* sV = sK + BLOCK_N * LD;
    double* sP = sV + BLOCK_N * LD;

    // Blocks with the most key tiles (the last query tiles under a causal mask) start first.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int tx = threadIdx.x % NL, ty = threadIdx.x / NL;
    const int m0 = m_block * BLOCK_M;
    const int rows_valid = min(BLOCK_M, nq - m0);

    const float* gQ = q + b * q_sb + h * q_sh + m0 * q_sn;
    const float* gK = k + b * k_sb + hk * k_sh;
    const float* gV = v + b * v_sb + hk * v_sh;

    // Keys this tile can see: all of them, or up to the last valid row's causal limit; tiles past
    // it are fully masked and skipped.
    int n_end = nk;
    if constexpr (CAUSAL) n_end = max(0, min(nk, m0 + rows_valid + causal_off));
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

    double acc[RM][DPT];  // unnormalized O of the thread's rows and columns
    double m_run[RM];     // running max of t = s * scale_log2; -inf until a visible key
    double l_run[RM];     // running sum of exp2(t - m) over this thread's keys
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        m_run[i] = -INFINITY;
        l_run[i] = 0.0;
#pragma unroll
        for (int c = 0; c < DPT; ++c) acc[i][c] = 0.0;
    }

    if (n_tiles > 0) {
        {
            float r[BLOCK_M * HEAD_DIM / THREADS];
            fetch_tile<HEAD_DIM, THREADS>(r, gQ, q_sn, rows_valid, d);
            store_tile<HEAD_DIM, THREADS, LD>(sQ, r);
        }
        float r[Tr::kTileLoads];
        fetch_tile<HEAD_DIM, THREADS>(r, gK, k_sn, nk, d);
        store_tile<HEAD_DIM, THREADS, LD>(sK, r);
        __syncthreads();
    }

    // A double from the host: scale * log2(e) rounded to float32 moved every score, and lse by up
    // to an ulp beyond its one rounding (tools/repeat_case.py: 4% of seeds failed the lse bound).
    const double scale = scale_log2;
    const double* q_row = sQ + ty * LD;  // row i of this thread: q_row + i * RG * LD
    const double* k_row = sK + tx * LD;  // key jn of this thread: k_row + jn * NL * LD
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        float next[Tr::kTileLoads];  // V_j now, K_{j+1} after the barrier
        fetch_tile<HEAD_DIM, THREADS>(next, gV + n0 * v_sn, v_sn, nk - n0, d);

        // S = Q K_j^T: RM x RN dot products, 2 head-dim columns per 16-byte load.
        double s[RM][RN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) s[i][jn] = 0.0;
        // Hold the smaller operand set (Q rows or K rows) of a 2-column step, stream the other.
#pragma unroll 4
        for (int kk = 0; kk < HEAD_DIM; kk += 2) {
            if constexpr (RM <= RN) {
                double2 qv[RM];
#pragma unroll
                for (int i = 0; i < RM; ++i) qv[i] = *reinterpret_cast<const double2*>(q_row + i * RG * LD + kk);
#pragma unroll
                for (int jn = 0; jn < RN; ++jn) {
                    const double2 kv = *reinterpret_cast<const double2*>(k_row + jn * NL * LD + kk);
#pragma unroll
                    for (int i = 0; i < RM; ++i) {
                        s[i][jn] = fma(qv[i].x, kv.x, s[i][jn]);
                        s[i][jn] = fma(qv[i].y, kv.y, s[i][jn]);
                    }
                }
            } else {
                double2 kv[RN];
#pragma unroll
                for (int jn = 0; jn < RN; ++jn) kv[jn] = *reinterpret_cast<const double2*>(k_row + jn * NL * LD + kk);
#pragma unroll
                for (int i = 0; i < RM; ++i) {
                    const double2 qv = *reinterpret_cast<const double2*>(q_row + i * RG * LD + kk);
#pragma unroll
                    for (int jn = 0; jn < RN; ++jn) {
                        s[i][jn] = fma(qv.x, kv[jn].x, s[i][jn]);
                        s[i][jn] = fma(qv.y, kv[jn].y, s[i][jn]);
                    }
                }
            }
        }

        // Scale into base 2; mask keys past the end and, under causality, after each row's
        // diagonal (only tiles that straddle a boundary pay for it). P goes to shared memory.
        const bool need_mask = (n0 + BLOCK_N > nk) || (CAUSAL && n0 + BLOCK_N - 1 > m0 + causal_off);
        double alpha[RM];
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            const int row = m0 + ty + i * RG;
            const int limit = CAUSAL ? min(nk, row + causal_off + 1) : nk;
            double mx = m_run[i];
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) {
                double t = s[i][jn] * scale;
                if (need_mask && n0 + tx + NL * jn >= limit) t = -INFINITY;
                s[i][jn] = t;
                mx = fmax(mx, t);
            }
            mx = lanes8_max(mx);
            // A row with every key so far masked keeps max -inf; subtract 0 so -inf - -inf never forms.
            const double base = mx == -INFINITY ? 0.0 : mx;
            alpha[i] = exp2(m_run[i] - base);  // 0 on the first visible tile, 1 if the max stayed
            m_run[i] = mx;
            double sum = 0.0;
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) {
                const double p = exp2(s[i][jn] - base);
                sP[(ty + i * RG) * LDP + tx + NL * jn] = p;
                sum += p;
            }
            l_run[i] = fma(l_run[i], alpha[i], sum);
        }
        // P V_{j-1} finished before the last barrier of iteration j-1, so V's slot is free.
        store_tile<HEAD_DIM, THREADS, LD>(sV, next);
        __syncthreads();  // P and V_j visible; every thread is done with K_j
        if (j + 1 < n_tiles) {
            const int n1 = n0 + BLOCK_N;
            fetch_tile<HEAD_DIM, THREADS>(next, gK + n1 * k_sn, k_sn, nk - n1, d);
        }

        // O = O * alpha + P V_j.
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int c = 0; c < DPT; ++c) acc[i][c] *= alpha[i];
#pragma unroll 2
        for (int kk = 0; kk < BLOCK_N; kk += 2) {
            double2 pv[RM];
#pragma unroll
            for (int i = 0; i < RM; ++i) pv[i] = *reinterpret_cast<const double2*>(sP + (ty + i * RG) * LDP + kk);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const double* v_row = sV + (kk + e) * LD + 2 * tx;
#pragma unroll
                for (int ch = 0; ch < CH; ++ch) {
                    const double2 vv = *reinterpret_cast<const double2*>(v_row + ch * 2 * NL);
#pragma unroll
                    for (int i = 0; i < RM; ++i) {
                        const double p = e == 0 ? pv[i].x : pv[i].y;
                        acc[i][2 * ch] = fma(p, vv.x, acc[i][2 * ch]);
                        acc[i][2 * ch + 1] = fma(p, vv.y, acc[i][2 * ch + 1]);
                    }
                }
            }
        }
        if (j + 1 < n_tiles) store_tile<HEAD_DIM, THREADS, LD>(sK, next);  // K_j's readers passed the barrier
        __syncthreads();  // K_{j+1} visible; nobody reads P or V_j any more
    }

    // Normalize once, round to float32 once; rows that saw no key give O = 0 and lse = -inf.
    constexpr double kLn2 = 0.69314718055994530942;
    float* gO = o + b * o_sb + h * o_sh + m0 * o_sn;
    float* gL = lse + ((i64)b * gridDim.y + h) * nq + m0;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int row = ty + i * RG;
        const double l = lanes8_sum(l_run[i]);
        if (row < rows_valid) {
#pragma unroll
            for (int ch = 0; ch < CH; ++ch)
#pragma unroll
                for (int w = 0; w < 2; ++w) {
                    const int col = 2 * (tx + NL * ch) + w;
                    if (col < d) gO[row * o_sn + col] = l > 0.0 ? (float)(acc[i][2 * ch + w] / l) : 0.f;
                }
            if (tx == 0) gL[row] = l > 0.0 ? (float)((m_run[i] + log2(l)) * kLn2) : -INFINITY;
        }
    }
}
