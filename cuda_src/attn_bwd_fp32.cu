// Backward attention for float32 inputs, computed in float64 on the FMA pipes (f64_tile.cuh says
// why float64: the only float32 rounding left is the final one of dQ, dK and dV).
//
// The saved float32 lse is refined: it is within half an ulp of the true value, so exp(s - lse)
// would move every probability by up to |lse| * 2^-24 relative - several float32 ulps of the
// gradients once |lse| >= 8, beyond the accuracy rule. Where it is the lse of this call's keys, the
// exact lse2 and D = sum_j P_ij dP_ij computed here replace it and rowsum(dO * O); where it is over
// more keys (a global lse, the call holding a slice of them) it is used as given (given_row_stats).
// Two kernels, no atomics (bitwise reproducible):
//
//   attn_bwd_f32_dq (one block per query tile, head, batch):
//     pass 1 over the visible key tiles: S = Q K^T, dP = dO V^T; online row max m, row sum
//            l = sum exp2(t - m) and w = sum exp2(t - m) dP in base 2 (t = s * scale * log2 e);
//            then lse2 = m + log2 l and D = w / l, written as float64 for attn_bwd_f32_kv;
//     pass 2: P = exp2(t - lse2), dS = P (dP - D), dQ = scale * dS K.
//   attn_bwd_f32_kv (one block per key tile, K/V head, batch; after attn_bwd_f32_dq):
//     over the group's query heads and the query tiles that see its keys: S^T = K Q^T,
//     dP^T = V dO^T, P^T = exp2(t - lse2), dS^T = P^T (dP^T - D); dV += P^T dO, dK += dS^T Q;
//     dK *= scale. The group's heads are summed in float64, so dK and dV round once.
//
// Both products of a step read float64 tiles in shared memory (f64_tile.cuh's layout: thread
// (ty, tx) owns rows ty + kRowGroups * i and columns tx + 8 * jn). Keys past Nk, query rows past
// Nq and causally invisible pairs are masked (P = 0); zero-filled tile rows never count.
// Tiles are loaded synchronously (no register prefetch as in the forward): this is the exact
// float32 path, not the fast one (float16 / bfloat16 run on tensor cores).
#include "f64_tile.cuh"

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS>
struct F64BwdDqTraits : F64Layout<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS> {
    using L = F64Layout<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>;
    // Q, dO (BLOCK_M rows), K, V (BLOCK_N rows), dS (BLOCK_M x BLOCK_N).
    static constexpr int kSmemBytes = 8 * ((2 * BLOCK_M + 2 * BLOCK_N) * L::kLd + BLOCK_M * L::kLdP);
    static constexpr int kMinBlocks = F64Occupancy<kSmemBytes>::kMinBlocks;
};

template <int HEAD_DIM, int BLOCK_N, int BLOCK_M, int THREADS>
struct F64BwdKvTraits : F64Layout<HEAD_DIM, BLOCK_N, BLOCK_M, THREADS> {
    using L = F64Layout<HEAD_DIM, BLOCK_N, BLOCK_M, THREADS>;
    // K, V (BLOCK_N rows), Q, dO (BLOCK_M rows), P^T and dS^T (BLOCK_N x BLOCK_M), lse2 and D.
    static constexpr int kSmemBytes =
        8 * ((2 * BLOCK_N + 2 * BLOCK_M) * L::kLd + 2 * BLOCK_N * L::kLdP + 2 * BLOCK_M);
    static constexpr int kMinBlocks = F64Occupancy<kSmemBytes>::kMinBlocks;
};

// Round a thread's RM x (2 CH) float64 accumulator times `mul` to float32 rows of g (row stride
// ld), rows < rows_valid and columns < d.
template <int RM, int CH, int RG>
__device__ __forceinline__ void store_rows(float* g, i64 ld, const double (&acc)[RM][2 * CH], double mul, int ty,
                                           int tx, int rows_valid, int d) {
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int row = ty + i * RG;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int ch = 0; ch < CH; ++ch)
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                const int col = 2 * (tx + 8 * ch) + w;
                if (col < d) g[row * ld + col] = (float)(acc[i][2 * ch + w] * mul);
            }
    }
}

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int THREADS, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, (F64BwdDqTraits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>::kMinBlocks))
attn_bwd_f32_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const float* __restrict__ dout, float* __restrict__ dq, double* __restrict__ ws_lse2,
                double* __restrict__ ws_d, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, i64 dq_sb, i64 dq_sh, i64 dq_sn,
                int nq, int nk, int d, int group, int causal_off, double scale_log2, double scale) {
    using Tr = F64BwdDqTraits<HEAD_DIM, BLOCK_M, BLOCK_N, THREADS>;
    constexpr int RM = Tr::kRowsPerThread, RN = Tr::kColsPerThread, DPT = Tr::kDimsPerThread;
    constexpr int CH = Tr::kChunks, RG = Tr::kRowGroups, NL = Tr::kLanes;
    constexpr int LD = Tr::kLd, LDP = Tr::kLdP;
    extern __shared__ __align__(16) double smem_f64[];
    require_dynamic_smem(Tr::kSmemBytes);
    double* sQ = smem_f64;
    double* sdO = sQ + BLOCK_M * LD;
    double* sK = sdO + BLOCK_M * LD;
    double* sV = sK + BLOCK_N * LD;
    double* sdS = sV + BLOCK_N * LD;

    const int m_block = gridDim.x - 1 - blockIdx.x;  // the causal mask's longest tiles first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int tx = threadIdx.x % NL, ty = threadIdx.x / NL;
    const int m0 = m_block * BLOCK_M;
    const int rows_valid = min(BLOCK_M, nq - m0);
    const float* gK = k + b * k_sb + hk * k_sh;
    const float* gV = v + b * v_sb + hk * v_sh;
    int n_end = nk;
    if constexpr (CAUSAL) n_end = max(0, min(nk, m0 + rows_valid + causal_off));
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

    load_tile<HEAD_DIM, THREADS, BLOCK_M, LD>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, d);
    load_tile<HEAD_DIM, THREADS, BLOCK_M, LD>(sdO, dout + b * do_sb + h * do_sh + m0 * do_sn, do_sn, rows_valid, d);

    // S and dP of key tile j for this thread's rows and keys; t = s * scale_log2, masked to -inf.
    double t[RM][RN], dp[RM][RN];
    auto products = [&](int j) {
        const int n0 = j * BLOCK_N;
        __syncthreads();  // the previous tile's readers are done (and Q, dO are stored)
        load_tile<HEAD_DIM, THREADS, BLOCK_N, LD>(sK, gK + n0 * k_sn, k_sn, nk - n0, d);
        load_tile<HEAD_DIM, THREADS, BLOCK_N, LD>(sV, gV + n0 * v_sn, v_sn, nk - n0, d);
        __syncthreads();
        dot_rows<HEAD_DIM, RM, RN, RG * LD, NL * LD>(t, sQ + ty * LD, sK + tx * LD);
        dot_rows<HEAD_DIM, RM, RN, RG * LD, NL * LD>(dp, sdO + ty * LD, sV + tx * LD);
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            const int row = m0 + ty + i * RG;
            const int limit = CAUSAL ? min(nk, row + causal_off + 1) : nk;
#pragma unroll
            for (int jn = 0; jn < RN; ++jn)
                t[i][jn] = n0 + tx + NL * jn < limit ? t[i][jn] * scale_log2 : -INFINITY;
        }
    };

    // Pass 1: the row statistics.
    double m_run[RM], l_run[RM], w_run[RM];  // l and w: this lane's keys, rescaled to m_run
#pragma unroll
    for (int i = 0; i < RM; ++i) m_run[i] = -INFINITY, l_run[i] = 0.0, w_run[i] = 0.0;
    for (int j = 0; j < n_tiles; ++j) {
        products(j);
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            double mx = m_run[i];
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) mx = fmax(mx, t[i][jn]);
            mx = lanes8_max(mx);
            const double base = mx == -INFINITY ? 0.0 : mx;  // no -inf - -inf
            const double alpha = exp2(m_run[i] - base);
            m_run[i] = mx;
            double sum = 0.0, wsum = 0.0;
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) {
                const double p = exp2(t[i][jn] - base);
                sum += p;
                wsum = fma(p, dp[i][jn], wsum);
            }
            l_run[i] = fma(l_run[i], alpha, sum);
            w_run[i] = fma(w_run[i], alpha, wsum);
        }
    }
    double lse2[RM], dsum[RM];
    const i64 stat0 = ((i64)b * gridDim.y + h) * nq + m0;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const double l = lanes8_sum(l_run[i]), w = lanes8_sum(w_run[i]);
        lse2[i] = l > 0.0 ? m_run[i] + log2(l) : -INFINITY;  // -inf: the row sees no key
        dsum[i] = l > 0.0 ? w / l : 0.0;
        const int row = ty + i * RG;
        if (row < rows_valid) given_row_stats(lse2[i], dsum[i], ws_lse2[stat0 + row], ws_d[stat0 + row]);
    }
    __syncwarp();  // a row's 8 lanes (one warp) read the given statistics before lane 0 overwrites them
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int row = ty + i * RG;
        if (tx == 0 && row < rows_valid) {
            ws_lse2[stat0 + row] = lse2[i];
            ws_d[stat0 + row] = dsum[i];
        }
    }

    // Pass 2: dQ = dS K.
    double acc[RM][DPT];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int c = 0; c < DPT; ++c) acc[i][c] = 0.0;
    for (int j = 0; j < n_tiles; ++j) {
        products(j);
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int jn = 0; jn < RN; ++jn) {
                const double p = t[i][jn] == -INFINITY ? 0.0 : exp2(t[i][jn] - lse2[i]);
                sdS[(ty + i * RG) * LDP + tx + NL * jn] = p * (dp[i][jn] - dsum[i]);
            }
        __syncthreads();
        acc_rows<BLOCK_N, RM, CH, RG * LDP, LD>(acc, sdS + ty * LDP, sK + 2 * tx);
    }
    store_rows<RM, CH, RG>(dq + b * dq_sb + h * dq_sh + m0 * dq_sn, dq_sn, acc, scale, ty, tx, rows_valid, d);
}

template <int HEAD_DIM, int BLOCK_N, int BLOCK_M, int THREADS, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, (F64BwdKvTraits<HEAD_DIM, BLOCK_N, BLOCK_M, THREADS>::kMinBlocks))
attn_bwd_f32_kv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const float* __restrict__ dout, const double* __restrict__ ws_lse2,
                const double* __restrict__ ws_d, float* __restrict__ dk, float* __restrict__ dv,
                i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                int hq, int nq, int nk, int d, int group, int causal_off, double scale_log2, double scale) {
    using Tr = F64BwdKvTraits<HEAD_DIM, BLOCK_N, BLOCK_M, THREADS>;
    // Rows are this block's keys, columns the query rows of a tile.
    constexpr int RM = Tr::kRowsPerThread, RN = Tr::kColsPerThread, DPT = Tr::kDimsPerThread;
    constexpr int CH = Tr::kChunks, RG = Tr::kRowGroups, NL = Tr::kLanes;
    constexpr int LD = Tr::kLd, LDP = Tr::kLdP;
    extern __shared__ __align__(16) double smem_f64[];
    require_dynamic_smem(Tr::kSmemBytes);
    double* sK = smem_f64;
    double* sV = sK + BLOCK_N * LD;
    double* sQ = sV + BLOCK_N * LD;
    double* sdO = sQ + BLOCK_M * LD;
    double* sP = sdO + BLOCK_M * LD;  // P^T: key rows, query columns
    double* sdS = sP + BLOCK_N * LDP;
    double* sL = sdS + BLOCK_N * LDP;  // lse2 of the tile's query rows
    double* sD = sL + BLOCK_M;

    const int hk = blockIdx.y, b = blockIdx.z;
    const int tx = threadIdx.x % NL, ty = threadIdx.x / NL;
    const int n0 = blockIdx.x * BLOCK_N;
    const int keys_valid = min(BLOCK_N, nk - n0);
    load_tile<HEAD_DIM, THREADS, BLOCK_N, LD>(sK, k + b * k_sb + hk * k_sh + n0 * k_sn, k_sn, keys_valid, d);
    load_tile<HEAD_DIM, THREADS, BLOCK_N, LD>(sV, v + b * v_sb + hk * v_sh + n0 * v_sn, v_sn, keys_valid, d);

    // Query rows that see a key of this block: row + causal_off >= n0.
    const int m_first = CAUSAL ? max(0, n0 - causal_off) / BLOCK_M : 0;
    const int m_tiles = (nq + BLOCK_M - 1) / BLOCK_M;

    double acc_dk[RM][DPT], acc_dv[RM][DPT];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int c = 0; c < DPT; ++c) acc_dk[i][c] = 0.0, acc_dv[i][c] = 0.0;

    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const i64 stat0 = ((i64)b * hq + h) * nq;
        for (int mt = m_first; mt < m_tiles; ++mt) {
            const int m0 = mt * BLOCK_M;
            const int rows_valid = min(BLOCK_M, nq - m0);
            __syncthreads();  // the previous tile's readers are done (and K, V are stored)
            load_tile<HEAD_DIM, THREADS, BLOCK_M, LD>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, d);
            load_tile<HEAD_DIM, THREADS, BLOCK_M, LD>(sdO, dout + b * do_sb + h * do_sh + m0 * do_sn, do_sn,
                                                      rows_valid, d);
            for (int r = threadIdx.x; r < BLOCK_M; r += THREADS) {
                sL[r] = r < rows_valid ? ws_lse2[stat0 + m0 + r] : 0.0;
                sD[r] = r < rows_valid ? ws_d[stat0 + m0 + r] : 0.0;
            }
            __syncthreads();
            double s[RM][RN], dp[RM][RN];
            dot_rows<HEAD_DIM, RM, RN, RG * LD, NL * LD>(s, sK + ty * LD, sQ + tx * LD);
            dot_rows<HEAD_DIM, RM, RN, RG * LD, NL * LD>(dp, sV + ty * LD, sdO + tx * LD);
#pragma unroll
            for (int i = 0; i < RM; ++i) {
                const int key = n0 + ty + i * RG;
#pragma unroll
                for (int jn = 0; jn < RN; ++jn) {
                    const int col = tx + NL * jn, row = m0 + col;
                    // A visible pair's row saw this key in attn_bwd_f32_dq, so its lse2 is finite.
                    const bool visible = key < nk && col < rows_valid && (!CAUSAL || key <= row + causal_off);
                    const double p = visible ? exp2(s[i][jn] * scale_log2 - sL[col]) : 0.0;
                    sP[(ty + i * RG) * LDP + col] = p;
                    sdS[(ty + i * RG) * LDP + col] = p * (dp[i][jn] - sD[col]);
                }
            }
            __syncthreads();
            acc_rows<BLOCK_M, RM, CH, RG * LDP, LD>(acc_dv, sP + ty * LDP, sdO + 2 * tx);
            acc_rows<BLOCK_M, RM, CH, RG * LDP, LD>(acc_dk, sdS + ty * LDP, sQ + 2 * tx);
        }
    }
    store_rows<RM, CH, RG>(dk + b * dk_sb + hk * dk_sh + n0 * dk_sn, dk_sn, acc_dk, scale, ty, tx, keys_valid, d);
    store_rows<RM, CH, RG>(dv + b * dv_sb + hk * dv_sh + n0 * dv_sn, dv_sn, acc_dv, 1.0, ty, tx, keys_valid, d);
}
