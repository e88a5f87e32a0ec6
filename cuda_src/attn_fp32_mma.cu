// Float32 attention on the float64 tensor cores (mma.sync m16n8k8 .f64, sm_90), head dims up to
// 128: the same arithmetic as attn_fwd_fp32.cu / attn_bwd_fp32.cu (exact products of float32
// values, float64 sums, one final rounding to float32) at twice the FMA pipe's peak.
//
// Each warp owns 16 rows of its block's tile (m16). Products whose result feeds another product
// (S -> P V, dS -> dS K, P^T -> P^T dO, dS^T -> dS^T Q) read their B operand from a tile stored
// 8-permuted (f64_tile.cuh, slot8), so that C's fragment is the next product's A fragment as it
// stands (c_as_a): no shuffles and no trip through shared memory.
//
//   attn_fwd_f32_mma:    one block (WARPS warps, 16 WARPS query rows) per query tile, as attn_fwd_f32.
//   attn_bwd_f32_mma_dq: one block (8 warps, 64 query rows; two warps per 16 rows, each on half
//                        of every key tile) per query tile: the exact row statistics lse2 and D in
//                        a first pass (as attn_bwd_f32_dq), dQ in a second.
//   attn_bwd_f32_mma_kv: one block (8 warps, 64 keys) per key tile; warps pair up on 16 keys:
//                        the even warp forms P^T and adds dV, the odd one dP^T, dS^T and dK
//                        (P^T handed over in shared memory), so neither computes a product twice.
// Keys past Nk, query rows past Nq and causally invisible pairs are masked (P = 0).
#include "f64_tile.cuh"

// The two warps of a pair (64 threads) meet at barrier `id` (1-4; __syncthreads is barrier 0).
__device__ __forceinline__ void pair_barrier(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

template <int HEAD_DIM>
struct MmaF64Layout {
    static constexpr int kLd = HEAD_DIM + 4;  // doubles; = 4 (mod 16): A fragments and row-as-n B fragments hit 16 banks pairs
    static constexpr int kKT = HEAD_DIM / 8;  // k-steps over the head dim
    static constexpr int kDT = HEAD_DIM / 8;  // 8-column tiles of a head-dim-wide result
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "head dims 32, 64, 128 (the accumulators live in registers)");
};

template <int HEAD_DIM, int BLOCK_N, int WARPS>
struct MmaFwdTraits : MmaF64Layout<HEAD_DIM> {
    static constexpr int kThreads = 32 * WARPS, kBlockM = 16 * WARPS;
    static constexpr int kSmemBytes = 8 * (kBlockM + 2 * BLOCK_N) * MmaF64Layout<HEAD_DIM>::kLd;  // Q, K, V
};

// Scale a row's S fragment into base 2 and mask it: C element (row, nt, e) of a product whose B
// rows were 8-permuted holds column n0 + 8 nt + t + 4 e; columns >= limit get -inf.
template <int NT>
__device__ __forceinline__ void scale_mask_row(double (&s)[NT][4], int hf, double scale_log2, bool need_mask, int n0,
                                               int t, int limit) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const double x = s[nt][2 * hf + e] * scale_log2;
            s[nt][2 * hf + e] = (need_mask && n0 + 8 * nt + t + 4 * e >= limit) ? -INFINITY : x;
        }
}

template <int HEAD_DIM, int BLOCK_N, int WARPS, bool CAUSAL>
__global__ void __launch_bounds__(32 * WARPS, 1)
attn_fwd_f32_mma(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 float* __restrict__ o, float* __restrict__ lse,
                 i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                 i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                 int nq, int nk, int d, int group, int causal_off, double scale_log2) {
    using Tr = MmaFwdTraits<HEAD_DIM, BLOCK_N, WARPS>;
    constexpr int LD = Tr::kLd, KT = Tr::kKT, DT = Tr::kDT, NT = BLOCK_N / 8, BM = Tr::kBlockM, TH = Tr::kThreads;
    extern __shared__ __align__(16) double smem_f64[];
    require_dynamic_smem(Tr::kSmemBytes);
    double* sQ = smem_f64;
    double* sK = sQ + BM * LD;  // 8-permuted
    double* sV = sK + BLOCK_N * LD;

    const int m_block = gridDim.x - 1 - blockIdx.x;  // the causal mask's longest tiles first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = m_block * BM;
    const int rows_valid = min(BM, nq - m0);
    const float* gK = k + b * k_sb + hk * k_sh;
    const float* gV = v + b * v_sb + hk * v_sh;
    int n_end = nk;
    if constexpr (CAUSAL) n_end = max(0, min(nk, m0 + rows_valid + causal_off));
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

    double acc[DT][4];  // unnormalized O, C fragments of rows g and g + 8
    double m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0, 0.0};
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0;

    if (n_tiles > 0) {
        load_tile<HEAD_DIM, TH, BM, LD>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, d);
        load_tile<HEAD_DIM, TH, BLOCK_N, LD, true>(sK, gK, k_sn, nk, d);
        __syncthreads();
    }
    const double* qa = sQ + (warp * 16 + g) * LD + t;
    const double* kb = sK + g * LD + t;
    const double* vb = sV + g;
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        float next[BLOCK_N * HEAD_DIM / TH];  // V_j now, K_{j+1} after the barrier
        fetch_tile<HEAD_DIM, TH>(next, gV + n0 * v_sn, v_sn, nk - n0, d);

        double s[NT][4];
        mma_rows_by_rows<KT, NT, LD>(s, qa, kb);
        const bool need_mask = (n0 + BLOCK_N > nk) || (CAUSAL && n0 + BLOCK_N - 1 > m0 + causal_off);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = m0 + warp * 16 + g + 8 * hf;
            scale_mask_row<NT>(s, hf, scale_log2, need_mask, n0, t, CAUSAL ? min(nk, row + causal_off + 1) : nk);
            double mx = m_run[hf];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmax(mx, fmax(s[nt][2 * hf], s[nt][2 * hf + 1]));
            mx = quad_max(mx);
            const double base = mx == -INFINITY ? 0.0 : mx;  // no -inf - -inf
            const double alpha = exp2(m_run[hf] - base);
            m_run[hf] = mx;
            double sum = 0.0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const double p = exp2(s[nt][2 * hf + e] - base);
                    s[nt][2 * hf + e] = p;
                    sum += p;
                }
            l_run[hf] = fma(l_run[hf], alpha, sum);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) acc[dt][2 * hf] *= alpha, acc[dt][2 * hf + 1] *= alpha;
        }
        // P V_{j-1} finished before the last barrier of iteration j-1, so V's slot is free.
        store_tile<HEAD_DIM, TH, LD>(sV, next);
        __syncthreads();  // V_j visible; every warp is done with K_j
        if (j + 1 < n_tiles) {
            const int n1 = n0 + BLOCK_N;
            fetch_tile<HEAD_DIM, TH>(next, gK + n1 * k_sn, k_sn, nk - n1, d);
        }
        // O += P V_j: S's C fragments of key tile nt are P's A fragments of k-step nt.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_c_by_rows<DT, LD, false>(acc, s[nt], vb, t, nt);
        if (j + 1 < n_tiles) store_tile_perm8<HEAD_DIM, TH, LD>(sK, next);  // K_j's readers passed the barrier
        __syncthreads();
    }

    constexpr double kLn2 = 0.69314718055994530942;
    float* gO = o + b * o_sb + h * o_sh + m0 * o_sn;
    float* gL = lse + ((i64)b * gridDim.y + h) * nq + m0;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = warp * 16 + g + 8 * hf;
        const double l = quad_sum(l_run[hf]);
        if (row < rows_valid) {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * dt + 2 * t + e;
                    if (col < d) gO[row * o_sn + col] = l > 0.0 ? (float)(acc[dt][2 * hf + e] / l) : 0.f;
                }
            if (t == 0) gL[row] = l > 0.0 ? (float)((m_run[hf] + log2(l)) * kLn2) : -INFINITY;
        }
    }
}

template <int HEAD_DIM, int BLOCK_N>
struct MmaBwdDqTraits : MmaF64Layout<HEAD_DIM> {
    // 8 warps: warps w and w + 4 own the same 16 query rows and split each key tile in halves, so
    // that 64 query rows (Q, dO as float64) and a K/V tile fit with 8 warps on the SM.
    static constexpr int kThreads = 256, kBlockM = 64;
    static_assert(BLOCK_N % 16 == 0, "two halves of whole 8-key column tiles");
    static constexpr int kSmemBytes = 8 * (2 * kBlockM + 2 * BLOCK_N) * MmaF64Layout<HEAD_DIM>::kLd;  // Q, dO, K, V
    // The halves' row statistics meet in the K/V tiles' space after pass 1, their dQ in the Q and
    // dO tiles' space after pass 2.
    static_assert(2 * BLOCK_N * MmaF64Layout<HEAD_DIM>::kLd >= 2 * kBlockM * 3, "the K/V tiles hold the statistics");
    static_assert(2 * kBlockM * MmaF64Layout<HEAD_DIM>::kLd >= 4 * 32 * 4 * (HEAD_DIM / 8), "Q and dO hold one half's dQ");
};

// Rows m0 + 16 (warp % 4) + g (+ 8) of dQ = scale * dS K over the keys of this warp's half of
// each tile, after the exact row statistics (written to ws_lse2 / ws_d for attn_bwd_f32_mma_kv);
// the two halves' statistics and dQ are combined in shared memory. Arguments as attn_bwd_f32_dq.
template <int HEAD_DIM, int BLOCK_N, bool CAUSAL>
__global__ void __launch_bounds__(256, 1)
attn_bwd_f32_mma_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    const float* __restrict__ dout, float* __restrict__ dq, double* __restrict__ ws_lse2,
                    double* __restrict__ ws_d, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, i64 dq_sb, i64 dq_sh, i64 dq_sn,
                    int nq, int nk, int d, int group, int causal_off, double scale_log2, double scale) {
    using Tr = MmaBwdDqTraits<HEAD_DIM, BLOCK_N>;
    constexpr int LD = Tr::kLd, KT = Tr::kKT, DT = Tr::kDT, NH = BLOCK_N / 16, BM = Tr::kBlockM, TH = Tr::kThreads;
    extern __shared__ __align__(16) double smem_f64[];
    require_dynamic_smem(Tr::kSmemBytes);
    double* sQ = smem_f64;
    double* sdO = sQ + BM * LD;
    double* sK = sdO + BM * LD;  // 8-permuted (the B operand of S, then of dS K)
    double* sV = sK + BLOCK_N * LD;  // 8-permuted

    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rw = warp & 3, half = warp >> 2;  // 16-row group; which NH column tiles of a key tile
    const int m0 = m_block * BM;
    const int rows_valid = min(BM, nq - m0);
    const float* gK = k + b * k_sb + hk * k_sh;
    const float* gV = v + b * v_sb + hk * v_sh;
    int n_end = nk;
    if constexpr (CAUSAL) n_end = max(0, min(nk, m0 + rows_valid + causal_off));
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

    load_tile<HEAD_DIM, TH, BM, LD>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, d);
    load_tile<HEAD_DIM, TH, BM, LD>(sdO, dout + b * do_sb + h * do_sh + m0 * do_sn, do_sn, rows_valid, d);
    const double* qa = sQ + (rw * 16 + g) * LD + t;
    const double* da = sdO + (rw * 16 + g) * LD + t;
    const int nt0 = half * NH;  // this warp's first 8-key column tile

    // S (scaled to base 2, masked) and dP of this warp's half of key tile j.
    double s[NH][4], dp[NH][4];
    auto products = [&](int j) {
        const int n0 = j * BLOCK_N;
        __syncthreads();  // the previous tile's readers are done (and Q, dO are stored)
        load_tile<HEAD_DIM, TH, BLOCK_N, LD, true>(sK, gK + n0 * k_sn, k_sn, nk - n0, d);
        load_tile<HEAD_DIM, TH, BLOCK_N, LD, true>(sV, gV + n0 * v_sn, v_sn, nk - n0, d);
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < NH; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.0;
#pragma unroll 2
        for (int kk = 0; kk < KT; ++kk) {
            double a[4], ad[4];
            frag_a<LD>(a, qa, kk);
            frag_a<LD>(ad, da, kk);
#pragma unroll
            for (int nt = 0; nt < NH; ++nt) {
                double bb[2];
                frag_b_rows_n<LD>(bb, sK + g * LD + t, nt0 + nt, kk);
                mma_f64(s[nt], a, bb);
                frag_b_rows_n<LD>(bb, sV + g * LD + t, nt0 + nt, kk);
                mma_f64(dp[nt], ad, bb);
            }
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = m0 + rw * 16 + g + 8 * hf;
            scale_mask_row<NH>(s, hf, scale_log2, true, n0 + 8 * nt0, t, CAUSAL ? min(nk, row + causal_off + 1) : nk);
        }
    };

    // Pass 1: online row max m, sum l = sum exp2(t - m) and w = sum exp2(t - m) dP (this thread's keys).
    double m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0, 0.0}, w_run[2] = {0.0, 0.0};
    for (int j = 0; j < n_tiles; ++j) {
        products(j);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            double mx = m_run[hf];
#pragma unroll
            for (int nt = 0; nt < NH; ++nt) mx = fmax(mx, fmax(s[nt][2 * hf], s[nt][2 * hf + 1]));
            mx = quad_max(mx);
            const double base = mx == -INFINITY ? 0.0 : mx;
            const double alpha = exp2(m_run[hf] - base);
            m_run[hf] = mx;
            double sum = 0.0, wsum = 0.0;
#pragma unroll
            for (int nt = 0; nt < NH; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const double p = exp2(s[nt][2 * hf + e] - base);
                    sum += p;
                    wsum = fma(p, dp[nt][2 * hf + e], wsum);
                }
            l_run[hf] = fma(l_run[hf], alpha, sum);
            w_run[hf] = fma(w_run[hf], alpha, wsum);
        }
    }
    // The halves' (m, l, w) of each row meet in the K/V tiles' space: both warps of a row group
    // combine them in the same order-free way (max, then two products summed), so they agree bitwise.
    double* stats = sK;  // [half][64 rows][3]
    __syncthreads();     // every warp is done with the last K/V tile
    double lse2[2], dsum[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const double l = quad_sum(l_run[hf]), w = quad_sum(w_run[hf]);
        const int r = rw * 16 + g + 8 * hf;
        if (t == 0) {
            stats[(half * BM + r) * 3 + 0] = m_run[hf];
            stats[(half * BM + r) * 3 + 1] = l;
            stats[(half * BM + r) * 3 + 2] = w;
        }
    }
    __syncthreads();
    const i64 stat0 = ((i64)b * gridDim.y + h) * nq + m0;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = rw * 16 + g + 8 * hf;
        const double m_a = stats[r * 3], m_b = stats[(BM + r) * 3];
        const double mx = fmax(m_a, m_b);
        const double base = mx == -INFINITY ? 0.0 : mx;
        const double a_a = exp2(m_a - base), a_b = exp2(m_b - base);
        const double l = stats[r * 3 + 1] * a_a + stats[(BM + r) * 3 + 1] * a_b;
        const double w = stats[r * 3 + 2] * a_a + stats[(BM + r) * 3 + 2] * a_b;
        lse2[hf] = l > 0.0 ? mx + log2(l) : -INFINITY;  // -inf: the row sees no key
        dsum[hf] = l > 0.0 ? w / l : 0.0;
        if (r < rows_valid) given_row_stats(lse2[hf], dsum[hf], ws_lse2[stat0 + r], ws_d[stat0 + r]);
    }
    __syncthreads();  // both halves read the given statistics before half 0 overwrites them
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = rw * 16 + g + 8 * hf;
        if (half == 0 && t == 0 && r < rows_valid) {
            ws_lse2[stat0 + r] = lse2[hf];
            ws_d[stat0 + r] = dsum[hf];
        }
    }

    // Pass 2: dS = P (dP - D), dQ += dS K over this warp's keys (dS's C fragments are its A
    // fragments; K 8-permuted).
    double acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0;
    for (int j = 0; j < n_tiles; ++j) {
        products(j);
#pragma unroll
        for (int nt = 0; nt < NH; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int hf = i >> 1;
                const double p = s[nt][i] == -INFINITY ? 0.0 : exp2(s[nt][i] - lse2[hf]);
                s[nt][i] = p * (dp[nt][i] - dsum[hf]);
            }
            mma_c_by_rows<DT, LD, true>(acc, s[nt], sK + g, t, nt0 + nt);
        }
    }
    // The second half's dQ through the Q and dO tiles' space (C-fragment order), added by the first.
    double* part = sQ + rw * 32 * (4 * DT) + lane * (4 * DT);
    __syncthreads();  // every warp is done with Q, dO and the last K/V tile
    if (half == 1) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[4 * dt + i] = acc[dt][i];
    }
    __syncthreads();
    if (half == 1) return;
    store_c_rows<DT, true>(dq + b * dq_sb + h * dq_sh + m0 * dq_sn, dq_sn, acc, scale, rw * 16, g, t, rows_valid, d, part);
}

template <int HEAD_DIM, int BLOCK_M>
struct MmaBwdKvTraits : MmaF64Layout<HEAD_DIM> {
    static constexpr int kThreads = 256, kBlockN = 64, kPairs = 4;
    static constexpr int kMT = BLOCK_M / 8;  // 8-query column tiles of S^T
    // K, V (64 rows), Q, dO (BLOCK_M rows, 8-permuted), P^T handed over in C-fragment order, lse2, D.
    static constexpr int kSmemBytes = 8 * ((2 * kBlockN + 2 * BLOCK_M) * MmaF64Layout<HEAD_DIM>::kLd
                                           + kPairs * kMT * 32 * 4 + 2 * BLOCK_M);
};

// dK and dV of keys n0 .. n0 + 63 (warp pair p: keys 16 p + g, + 8), over the group's query heads
// and the query tiles that see them. Arguments as attn_bwd_f32_kv.
template <int HEAD_DIM, int BLOCK_M, bool CAUSAL>
__global__ void __launch_bounds__(256, 1)
attn_bwd_f32_mma_kv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    const float* __restrict__ dout, const double* __restrict__ ws_lse2,
                    const double* __restrict__ ws_d, float* __restrict__ dk, float* __restrict__ dv,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                    i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                    int hq, int nq, int nk, int d, int group, int causal_off, double scale_log2, double scale) {
    using Tr = MmaBwdKvTraits<HEAD_DIM, BLOCK_M>;
    constexpr int LD = Tr::kLd, KT = Tr::kKT, DT = Tr::kDT, MT = Tr::kMT, BN = Tr::kBlockN, TH = Tr::kThreads;
    extern __shared__ __align__(16) double smem_f64[];
    require_dynamic_smem(Tr::kSmemBytes);
    double* sK = smem_f64;
    double* sV = sK + BN * LD;
    double* sQ = sV + BN * LD;   // 8-permuted
    double* sdO = sQ + BLOCK_M * LD;  // 8-permuted
    double* sP = sdO + BLOCK_M * LD;  // [pair][mt][lane][4]: the even warp's P^T for the odd one
    double* sL = sP + Tr::kPairs * MT * 32 * 4;
    double* sD = sL + BLOCK_M;

    const int hk = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pair = warp >> 1;
    const bool dk_warp = warp & 1;  // odd: dP^T, dS^T, dK; even: P^T, dV
    const int n0 = blockIdx.x * BN;
    const int keys_valid = min(BN, nk - n0);
    load_tile<HEAD_DIM, TH, BN, LD>(sK, k + b * k_sb + hk * k_sh + n0 * k_sn, k_sn, keys_valid, d);
    load_tile<HEAD_DIM, TH, BN, LD>(sV, v + b * v_sb + hk * v_sh + n0 * v_sn, v_sn, keys_valid, d);
    const double* xa = (dk_warp ? sV : sK) + (pair * 16 + g) * LD + t;  // A: K (for S^T) or V (for dP^T)
    const double* yb = (dk_warp ? sdO : sQ) + g * LD + t;               // B: Q^T or dO^T
    const double* zb = (dk_warp ? sQ : sdO) + g;                        // B of the accumulated product
    double* handover = sP + (pair * MT * 32 + lane) * 4;                // + mt * 128

    const int m_first = CAUSAL ? max(0, n0 - causal_off) / BLOCK_M : 0;
    const int m_tiles = (nq + BLOCK_M - 1) / BLOCK_M;
    double acc[DT][4];  // dV (even warp) or dK (odd warp) of keys 16 pair + g, + 8
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0;

    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const i64 stat0 = ((i64)b * hq + h) * nq;
        for (int mt0 = m_first; mt0 < m_tiles; ++mt0) {
            const int m0 = mt0 * BLOCK_M;
            const int rows_valid = min(BLOCK_M, nq - m0);
            __syncthreads();  // the previous tile's readers are done (and K, V are stored)
            load_tile<HEAD_DIM, TH, BLOCK_M, LD, true>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, d);
            load_tile<HEAD_DIM, TH, BLOCK_M, LD, true>(sdO, dout + b * do_sb + h * do_sh + m0 * do_sn, do_sn,
                                                       rows_valid, d);
            for (int r = threadIdx.x; r < BLOCK_M; r += TH) {
                sL[r] = r < rows_valid ? ws_lse2[stat0 + m0 + r] : 0.0;
                sD[r] = r < rows_valid ? ws_d[stat0 + m0 + r] : 0.0;
            }
            __syncthreads();
            // S^T = K Q^T (even) or dP^T = V dO^T (odd): rows = keys, columns = queries (8-permuted).
            double x[MT][4];
            mma_rows_by_rows<KT, MT, LD>(x, xa, yb);
            if (!dk_warp) {  // P^T, handed to the odd warp
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int key = n0 + pair * 16 + g + 8 * (i >> 1);
                        const int col = 8 * mt + t + 4 * (i & 1), row = m0 + col;
                        // A visible pair's row saw this key in attn_bwd_f32_mma_dq: its lse2 is finite.
                        const bool visible = key < nk && col < rows_valid && (!CAUSAL || key <= row + causal_off);
                        x[mt][i] = visible ? exp2(x[mt][i] * scale_log2 - sL[col]) : 0.0;
                        handover[mt * 128 + i] = x[mt][i];
                    }
            }
            pair_barrier(1 + pair);  // P^T written (even) / about to be read (odd)
            if (dk_warp) {  // dS^T = P^T (dP^T - D)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) x[mt][i] = handover[mt * 128 + i] * (x[mt][i] - sD[8 * mt + t + 4 * (i & 1)]);
            }
            // dV += P^T dO (even) or dK += dS^T Q (odd): x's C fragments are the A fragments.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_c_by_rows<DT, LD, true>(acc, x[mt], zb, t, mt);
        }
    }
    float* gout = dk_warp ? dk + b * dk_sb + hk * dk_sh + n0 * dk_sn : dv + b * dv_sb + hk * dv_sh + n0 * dv_sn;
    store_c_rows<DT>(gout, dk_warp ? dk_sn : dv_sn, acc, dk_warp ? scale : 1.0, pair * 16, g, t, keys_valid, d);
}
