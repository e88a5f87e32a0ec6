// Tiled forward attention for float32 inputs, computed in float64 on the FMA pipes.
//
// Why float64: the accuracy rule compares against the naive formula with every primitive op
// (each matmul included) evaluated exactly and rounded once to float32. A float32 dot product
// over d terms, or a float32 sum over Nk keys, accumulates many roundings and misses that rule by
// 1.5-4x on random inputs (TF32 tensor cores by orders of magnitude). float32 -> float64 is exact,
// and float64 products and sums are exact to far below float32's rounding, so the only float32
// rounding left is the final one of O and lse.
//
// Tiling (f64_tile.cuh): one block per (query tile, head, batch); the threads form kLanes (8) columns x
// kRowGroups rows. Thread (ty, tx) owns query rows ty + kRowGroups * i (i < kRowsPerThread) in
// both phases, so its softmax statistics only meet the 8 lanes of its row group:
//   S phase:  keys tx + 8 * jn of the K tile (jn < kColsPerThread);
//   PV phase: head-dim columns 2 * (tx + 8 * ch) and +1 of O (ch < kDimsPerThread / 2).
// Q, K, V and P are float64 tiles in shared memory; global float32 tiles are converted once on
// the way in. The next tile is fetched into registers while the current one is used (V_j during
// S_j, K_{j+1} during P V_j), then stored after the barrier that frees its slot.
// Softmax in base 2: t = s * scale_log2, running max in that domain, p = exp2(t - m) (float64).
// Keys past Nk and causally invisible keys get t = -inf (zero-filled tile rows are never scored).
#include "f64_tile.cuh"

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS>
struct F64Traits : F64Layout<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS> {
    using L = F64Layout<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>;
    static constexpr int kSmemDoubles = (BLOCK_M + 2 * BLOCK_N) * L::kLd + BLOCK_M * L::kLdP;
    static constexpr int kSmemBytes = kSmemDoubles * 8;
    // Elements of one K or V tile each thread fetches (held in registers between barriers).
    static constexpr int kTileLoads = BLOCK_N * HEAD_DIM / THREADS;
    static constexpr int kMinBlocks = F64Occupancy<kSmemBytes>::kMinBlocks;
};

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, (F64Traits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>::kMinBlocks))
attn_fwd_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
             float* __restrict__ o, float* __restrict__ lse,
             i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
             i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
             int nq, int nk, int d, int group, int causal_off, double scale_log2) {
    using Tr = F64Traits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>;
    constexpr int RM = Tr::kRowsPerThread, RN = Tr::kColsPerThread, DPT = Tr::kDimsPerThread;
    constexpr int CH = Tr::kChunks, RG = Tr::kRowGroups, NL = Tr::kLanes;
    constexpr int LD = Tr::kLd, LDP = Tr::kLdP;
    extern __shared__ __align__(16) double smem_f64[];

    require_dynamic_smem(Tr::kSmemBytes);
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
    // to an ulp beyond its one rounding (4% of random seeds failed the lse bound).
    const double scale = scale_log2;
    const double* q_row = sQ + ty * LD;  // row i of this thread: q_row + i * RG * LD
    const double* k_row = sK + tx * LD;  // key jn of this thread: k_row + jn * NL * LD
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        float next[Tr::kTileLoads];  // V_j now, K_{j+1} after the barrier
        fetch_tile<HEAD_DIM, THREADS>(next, gV + n0 * v_sn, v_sn, nk - n0, d);

        // S = Q K_j^T: RM x RN dot products.
        double s[RM][RN];
        dot_rows<HEAD_DIM, RM, RN, RG * LD, NL * LD>(s, q_row, k_row);

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
        acc_rows<BLOCK_N, RM, CH, RG * LDP, LD>(acc, sP + ty * LDP, sV + 2 * tx);
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
