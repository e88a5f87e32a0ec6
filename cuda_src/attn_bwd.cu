// Tiled backward attention on mma.sync tensor cores (FlashAttention-2's algorithm).
//
//   attn_bwd_prep : D = rowsum(dO * O) in float32.
//   attn_bwd_kv   : one block per (K/V tile, K/V head, batch); loops over the query heads of the
//                   GQA group and the query tiles that can see its keys. Recomputes P from the
//                   saved log-sum-exp, accumulates dV = P^T dO and dK = dS^T Q in registers, and
//                   (unless deterministic) adds dQ += dS K into a float32 accumulator with vector
//                   atomics. Keys are the mma M dimension, so dK/dV never leave registers.
//   attn_bwd_dq   : deterministic dQ: one block per query tile, a fixed-order loop over key tiles
//                   (the forward's shape), no atomics. Costs S and dP a second time.
//   attn_bwd_dq_convert : dQ = scale * accumulator, rounded to the input dtype.
//   attn_bwd_kv_band, attn_bwd_dq_band : the same under a sliding window and/or over packed
//                   sequences (see BwdBand); prep and convert serve packed arrays as one batch entry.
// Nothing N x N touches device memory: dS lives in one shared-memory tile per block.
#include "common.cuh"
#include "tile_load.cuh"
#include "band.cuh"
#include "score_mod.cuh"

// ---------------------------------------------------------------------------------------------
// LANES threads per query row (8 columns each per pass: 16-byte loads where the row allows),
// rows of all (batch, head) pairs in blockIdx.x-major order, 256 / LANES rows per block. (One
// warp per row with 2-byte loads was issue-bound: 56-115 us for 16k tokens x 2048, H200 ncu.)
template <typename T, int LANES>
__global__ void attn_bwd_prep(const u16* __restrict__ o, const u16* __restrict__ dout, float* __restrict__ dsum,
                              i64 o_sb, i64 o_sh, i64 o_sn, i64 do_sb, i64 do_sh, i64 do_sn,
                              int hq, int nq, int d) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "a power-of-two group within a warp");
    const int lane = threadIdx.x % LANES;
    const i64 row = (i64)blockIdx.x * (blockDim.x / LANES) + threadIdx.x / LANES;  // head * nq + query
    const int b = blockIdx.y;
    const bool live = row < (i64)hq * nq;  // (every lane reaches the shuffles below)
    const int h = live ? (int)(row / nq) : 0, i = live ? (int)(row - (i64)h * nq) : 0;
    const u16* po = o + b * o_sb + h * o_sh + (i64)i * o_sn;
    const u16* pd = dout + b * do_sb + h * do_sh + (i64)i * do_sn;
    float acc = 0.f;
    if (live) {
        if (d % 8 == 0 && ((reinterpret_cast<unsigned long long>(po) | reinterpret_cast<unsigned long long>(pd)) & 15) == 0) {
            for (int c = 8 * lane; c < d; c += 8 * LANES) {
                const uint4 vo = *reinterpret_cast<const uint4*>(po + c);
                const uint4 vd = *reinterpret_cast<const uint4*>(pd + c);
                const u32 wo[4] = {vo.x, vo.y, vo.z, vo.w}, wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    acc += to_float<T>((u16)(wo[j] & 0xffff)) * to_float<T>((u16)(wd[j] & 0xffff)) +
                           to_float<T>((u16)(wo[j] >> 16)) * to_float<T>((u16)(wd[j] >> 16));
            }
        } else {
            for (int c = lane; c < d; c += LANES) acc += to_float<T>(po[c]) * to_float<T>(pd[c]);
        }
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (live && lane == 0) dsum[((i64)b * hq + h) * nq + i] = acc;
}

// ---------------------------------------------------------------------------------------------
// S = A1 B1^T and DP = A2 B2^T over the head dim for this warp's 16 MM rows and 8 NN columns
// (mma.sync m16n8k16; A and B rows as stored, B's tile at b_off): both products in one pass over
// k, so each step's four fragments load together. The K/V kernel passes K, V and Q, dO (S^T, dP^T),
// the dQ kernel Q, dO and K, V (S, dP).
template <typename T, int MM, int NN, int HEAD_DIM>
__device__ __forceinline__ void gemm_pair_nt(float (&s)[MM][NN][4], float (&dp)[MM][NN][4],
                                             LaneAddr<HEAD_DIM> a1, LaneAddr<HEAD_DIM> a2,
                                             LaneAddr<HEAD_DIM> b1, LaneAddr<HEAD_DIM> b2, u32 b_off) {
    zero_acc(s, dp);
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 fa1[MM][4], fa2[MM][4];
#pragma unroll
        for (int mi = 0; mi < MM; ++mi) {
            ldmatrix_x4(fa1[mi], a1.at(mi * 16, kk * 2));
            ldmatrix_x4(fa2[mi], a2.at(mi * 16, kk * 2));
        }
#pragma unroll
        for (int ni = 0; ni < NN; ni += 2) {
            u32 fb1[4], fb2[4];
            ldmatrix_x4(fb1, b1.at(ni * 8, kk * 2) + b_off);
            ldmatrix_x4(fb2, b2.at(ni * 8, kk * 2) + b_off);
#pragma unroll
            for (int mi = 0; mi < MM; ++mi) {
                mma_16816<T>(s[mi][ni], fa1[mi], fb1[0], fb1[1]);
                mma_16816<T>(s[mi][ni + 1], fa1[mi], fb1[2], fb1[3]);
                mma_16816<T>(dp[mi][ni], fa2[mi], fb2[0], fb2[1]);
                mma_16816<T>(dp[mi][ni + 1], fa2[mi], fb2[2], fb2[3]);
            }
        }
    }
}

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int WARPS_D>
struct BwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockM = BLOCK_M;  // queries per inner tile
    static constexpr int kBlockN = BLOCK_N;  // keys owned by the block
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kChunks = HEAD_DIM / 8;
    static constexpr int kWarpsN = WARPS / WARPS_D;          // warps along keys
    static constexpr int kRowsPerWarp = BLOCK_N / kWarpsN;   // key rows per warp
    static constexpr int kMmaM = kRowsPerWarp / 16;
    static constexpr int kDSlice = HEAD_DIM / WARPS_D;       // dK/dV columns per warp
    static constexpr int kNTilesQ = BLOCK_M / 8;             // S^T columns (queries) in n8 tiles
    static constexpr int kNTilesD = kDSlice / 8;
    // dQ = dS K partition: (BLOCK_M / 16) query row tiles x kDqSlices column slices = WARPS.
    static constexpr int kDqRowTiles = BLOCK_M / 16;
    static constexpr int kDqSlices = WARPS / kDqRowTiles;
    static constexpr int kDqCols = HEAD_DIM / kDqSlices;
    static constexpr int kTileQ = BLOCK_M * HEAD_DIM;
    static constexpr int kTileKV = BLOCK_N * HEAD_DIM;
    static constexpr int kSmemBytes =
        (2 * kTileKV + 4 * kTileQ + BLOCK_N * BLOCK_M) * 2 + 4 * BLOCK_M * 4;
    using Swz = Swizzle<HEAD_DIM>;
    using SwzS = Swizzle<BLOCK_M>;
    static_assert(kRowsPerWarp % 16 == 0 && kDSlice % 16 == 0 && kDqCols % 16 == 0, "whole mma tiles");
    static_assert(kDqRowTiles * kDqSlices == WARPS, "dQ tiles cover the warps exactly");
    static_assert((BLOCK_M * kChunks) % kThreads == 0 && (BLOCK_N * kChunks) % kThreads == 0, "even loads");
};

// Band and packed sequences (the *_band kernels): BandArgs (band.cuh). Packed sequences are batch
// 0 with nq (nk) their total rows, for lse, D and the dQ accumulator too.
using BwdBand = BandArgs;

// This block's sequence: its batch index (0 when packed), first q / k rows, lengths and bounds.
struct BwdBandSeq {
    int b, q_row0, k_row0, nq, nk, hi, lo;
};

template <bool BAND>
__device__ __forceinline__ BwdBandSeq bwd_band_sequence(const BwdBand& band, int b, int nq, int nk, int causal_off) {
    BwdBandSeq sq{b, 0, 0, nq, nk, causal_off, 0};
    if constexpr (BAND) {
        if (band.cu_q != nullptr) {
            sq.b = 0;
            band_packed_rows(band, b, sq.q_row0, sq.k_row0, sq.nq, sq.nk);
        }
        band_row_bounds(band, sq.nq, sq.nk, causal_off, sq.hi, sq.lo);
    }
    return sq;
}

// ---------------------------------------------------------------------------------------------
// The K/V kernel's pieces. Its tiles are transposed (S^T, dP^T: keys are the mma rows), so the
// element at (row, col) of for_each_acc is key key0 + row and query q0 + col.

// Every element of an m16n8 accumulator set acc[MM][NN][4], in register order: f(mi, ni, i, row,
// col) for acc[mi][ni][i] at row mi * 16 + lane / 4 + 8 (i / 2), column ni * 8 + 2 (lane % 4) + i % 2.
template <int MM, int NN, typename F>
__device__ __forceinline__ void for_each_acc(int lane, F&& f) {
#pragma unroll
    for (int mi = 0; mi < MM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int ni = 0; ni < NN; ++ni)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    f(mi, ni, 2 * hf + e, mi * 16 + (lane >> 2) + 8 * hf, ni * 8 + 2 * (lane & 3) + e);
}

// Softcap and ALiBi on S^T; gfac receives the softcap's derivative.
template <int MM, int NQ>
__device__ __forceinline__ void bwd_mod_scores_t(float (&s)[MM][NQ][4], float (&gfac)[MM][NQ][4], const ScoreMod& mod,
                                                 int key0, int q0, int lane) {
    for_each_acc<MM, NQ>(lane, [&](int mi, int ni, int i, int r, int c) {
        float t;
        s[mi][ni][i] = mod.apply(s[mi][ni][i], q0 + c, key0 + r, t);
        gfac[mi][ni][i] = ScoreMod::grad(t);
    });
}

// P^T = exp2(S^T * scale * log2e - lse * log2e) in place, invisible pairs forced to 0. The
// exponentials first, then the mask behind one branch: a mask test inside the exp loop becomes
// one branch per element on every step, as measured on the wgmma kernel.
template <bool HI, bool BAND, int MM, int NQ>
__device__ __forceinline__ void bwd_probs_t(float (&s)[MM][NQ][4], const float* tL, bool need_mask, const BwdBandSeq& sq,
                                            int key0, int q0, float scale_log2, int lane) {
    for_each_acc<MM, NQ>(lane, [&](int mi, int ni, int i, int, int c) {
        s[mi][ni][i] = fast_exp2(fmaf(s[mi][ni][i], scale_log2, -tL[c]));
    });
    if (!need_mask) return;
    for_each_acc<MM, NQ>(lane, [&](int mi, int ni, int i, int r, int c) {
        const int key = key0 + r, qi = q0 + c;
        const bool vis = key < sq.nk && qi < sq.nq && (!HI || key <= qi + sq.hi) && (!BAND || key >= qi + sq.lo);
        s[mi][ni][i] = vis ? s[mi][ni][i] : 0.f;
    });
}

// dS^T = P^T * (dP^T - D) in dp, times the softcap's derivative (MOD).
template <bool MOD, int MM, int NQ, int GM, int GQ>
__device__ __forceinline__ void bwd_dscores_t(float (&dp)[MM][NQ][4], const float (&p)[MM][NQ][4], const float* tD,
                                              const float (&gfac)[GM][GQ][4], int lane) {
    for_each_acc<MM, NQ>(lane, [&](int mi, int ni, int i, int, int c) {
        dp[mi][ni][i] = p[mi][ni][i] * (dp[mi][ni][i] - tD[c]);
        if constexpr (MOD) dp[mi][ni][i] *= gfac[mi][ni][i];
    });
}

// dV += P^T dO and dK += dS^T Q over the warp's column slice (from col0), the Q/dO buffer at
// qoff. With store_ds the warp also writes its rows of dS^T (16-bit) to sdS for dQ = dS K.
template <typename T, typename Tr, int MM, int NQ, int ND>
__device__ __forceinline__ void accumulate_dkdv(float (&acc_dv)[MM][ND][4], float (&acc_dk)[MM][ND][4],
                                                const float (&p)[MM][NQ][4], const float (&ds)[MM][NQ][4],
                                                const LaneAddr<Tr::kHeadDim>& bdOt, const LaneAddr<Tr::kHeadDim>& bQt,
                                                int col0, u32 qoff, bool store_ds, u16* sdS, int key_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockM / 16; ++kk) {
        u32 ap[MM][4], as[MM][4];
#pragma unroll
        for (int mi = 0; mi < MM; ++mi) {
            acc_to_a<T>(ap[mi], p[mi], kk);
            acc_to_a<T>(as[mi], ds[mi], kk);
        }
        if (store_ds) {
#pragma unroll
            for (int mi = 0; mi < MM; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = key_row0 + mi * 16 + (lane >> 2) + 8 * hf;
                        const int col = kk * 16 + half * 8;
                        u16* dst = sdS + Tr::SwzS::offset(row, col) + 2 * (lane & 3);
                        *reinterpret_cast<u32*>(dst) = as[mi][2 * half + hf];
                    }
        }
#pragma unroll
        for (int di = 0; di < ND; di += 2) {
            u32 bo[4], bq[4];
            ldmatrix_x4_trans(bo, bdOt.at(kk * 16, col0 / 8 + di) + qoff);
            ldmatrix_x4_trans(bq, bQt.at(kk * 16, col0 / 8 + di) + qoff);
#pragma unroll
            for (int mi = 0; mi < MM; ++mi) {
                mma_16816<T>(acc_dv[mi][di], ap[mi], bo[0], bo[1]);
                mma_16816<T>(acc_dv[mi][di + 1], ap[mi], bo[2], bo[3]);
                mma_16816<T>(acc_dk[mi][di], as[mi], bq[0], bq[1]);
                mma_16816<T>(acc_dk[mi][di + 1], as[mi], bq[2], bq[3]);
            }
        }
    }
}

// dQ(tile) += dS K for the warp's 16 query rows (row tile dq_rt) x kDqCols columns (slice dq_cs),
// from the whole dS^T tile in shared memory, by vector atomics into the float32 rows at gq.
template <typename T, typename Tr>
__device__ __forceinline__ void atomic_add_dq_tile(float* gq, const LaneAddr<Tr::kBlockM>& aS,
                                                   const LaneAddr<Tr::kHeadDim>& bKt, int dq_rt, int dq_cs, int m0,
                                                   int nq, int lane) {
    constexpr int kNC = Tr::kDqCols / 8;
    float acc_q[kNC][4];
#pragma unroll
    for (int ni = 0; ni < kNC; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_q[ni][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
        u32 a[4];
        ldmatrix_x4_trans(a, aS.at(kk * 16, dq_rt * 2));
#pragma unroll
        for (int ni = 0; ni < kNC; ni += 2) {
            u32 bk[4];
            ldmatrix_x4_trans(bk, bKt.at(kk * 16, dq_cs * kNC + ni));
            mma_16816<T>(acc_q[ni], a, bk[0], bk[1]);
            mma_16816<T>(acc_q[ni + 1], a, bk[2], bk[3]);
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = dq_rt * 16 + (lane >> 2) + 8 * hf;
        if (m0 + row < nq) {
#pragma unroll
            for (int ni = 0; ni < kNC; ++ni) {
                const int col = dq_cs * Tr::kDqCols + ni * 8 + 2 * (lane & 3);
                red_add_v2(gq + (i64)row * Tr::kHeadDim + col, acc_q[ni][2 * hf], acc_q[ni][2 * hf + 1]);
            }
        }
    }
}

// dK (times the softmax scale) and dV from the registers, the warp's key rows below keys_valid
// and columns below d.
template <typename T, bool VEC, int MM, int ND>
__device__ __forceinline__ void store_dkdv(u16* gdk, u16* gdv, i64 dk_sn, i64 dv_sn, const float (&acc_dk)[MM][ND][4],
                                           const float (&acc_dv)[MM][ND][4], float scale, int key_row0, int col0,
                                           int keys_valid, int d, int lane) {
#pragma unroll
    for (int mi = 0; mi < MM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = key_row0 + mi * 16 + (lane >> 2) + 8 * hf;
            if (row >= keys_valid) continue;
#pragma unroll
            for (int ni = 0; ni < ND; ++ni) {
                const int col = col0 + ni * 8 + 2 * (lane & 3);
                const float k0 = acc_dk[mi][ni][2 * hf] * scale, k1 = acc_dk[mi][ni][2 * hf + 1] * scale;
                const float v0 = acc_dv[mi][ni][2 * hf], v1 = acc_dv[mi][ni][2 * hf + 1];
                if (VEC) {
                    if (col < d) {
                        *reinterpret_cast<u32*>(gdk + row * dk_sn + col) = pack2<T>(k0, k1);
                        *reinterpret_cast<u32*>(gdv + row * dv_sn + col) = pack2<T>(v0, v1);
                    }
                } else {
                    if (col < d) {
                        gdk[row * dk_sn + col] = from_float<T>(k0);
                        gdv[row * dv_sn + col] = from_float<T>(v0);
                    }
                    if (col + 1 < d) {
                        gdk[row * dk_sn + col + 1] = from_float<T>(k1);
                        gdv[row * dv_sn + col + 1] = from_float<T>(v1);
                    }
                }
            }
        }
}

// ---------------------------------------------------------------------------------------------
// The K/V kernel: one block per (K/V tile, K/V head, sequence); the loop runs over the (query
// head, query tile) pairs that can see its keys, double-buffering Q, dO and their statistics.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int WARPS_D, bool CAUSAL, bool VEC, bool ATOMIC_DQ,
          bool BAND, bool MOD = false>
__device__ __forceinline__ void
attn_bwd_kv_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                 float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv,
                 i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                 i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                 int hq, int nq, int nk, int d, int group, int causal_off, float scale_log2, BwdBand band,
                 const ScoreModArgs& mods = ScoreModArgs{}) {
    using Tr = BwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, WARPS_D>;
    constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    constexpr int kMmaM = Tr::kMmaM, kNQ = Tr::kNTilesQ, kND = Tr::kNTilesD;
    constexpr float kLog2e = 1.4426950408889634f;
    extern __shared__ __align__(128) u16 smem[];
    u16* sK = smem;
    u16* sV = sK + Tr::kTileKV;
    u16* sQ = sV + Tr::kTileKV;          // 2 buffers
    u16* sdO = sQ + 2 * Tr::kTileQ;      // 2 buffers
    u16* sdS = sdO + 2 * Tr::kTileQ;     // BLOCK_N x BLOCK_M, dS^T
    float* sL = reinterpret_cast<float*>(sdS + BLOCK_N * BLOCK_M);  // 2 x BLOCK_M: lse * log2(e)
    float* sD = sL + 2 * BLOCK_M;                                     // 2 x BLOCK_M: D

    const int n_block = blockIdx.x, hk = blockIdx.y;
    const int n0 = n_block * BLOCK_N;
    const BwdBandSeq sq = bwd_band_sequence<BAND>(band, blockIdx.z, nq, nk, causal_off);
    const int b = sq.b;
    if (BAND && n0 >= sq.nk) return;  // the grid covers the longest sequence
    const int keys_valid = min(BLOCK_N, sq.nk - n0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wn = warp % Tr::kWarpsN, wd = warp / Tr::kWarpsN;
    const int key_row0 = wn * Tr::kRowsPerWarp;  // warp's first key row within the block
    const int col0 = wd * Tr::kDSlice;           // warp's first dK/dV column

    // Query tiles that can see any of this block's keys: query i sees key j iff j <= i + hi (and,
    // under a band, i + lo <= j): i in [n0 - hi, n0 + keys_valid - 1 - lo].
    int m_tiles = (sq.nq + BLOCK_M - 1) / BLOCK_M;
    int m_begin = 0;
    if constexpr (kHi) m_begin = max(0, n0 - sq.hi) / BLOCK_M;
    if constexpr (BAND) m_tiles = min(m_tiles, (max(0, n0 + keys_valid - sq.lo) + BLOCK_M - 1) / BLOCK_M);
    const int per_head = max(0, m_tiles - m_begin);
    const int n_steps = per_head * group;  // (head, query tile) pairs, head-major

    const u16* gK = k + b * k_sb + hk * k_sh + (i64)(sq.k_row0 + n0) * k_sn;
    const u16* gV = v + b * v_sb + hk * v_sh + (i64)(sq.k_row0 + n0) * v_sn;
    load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sK, gK, k_sn, keys_valid, d, threadIdx.x);
    load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sV, gV, v_sn, keys_valid, d, threadIdx.x);

    auto load_step = [&](int step, int buf) {
        const int h = hk * group + step / per_head;
        const int m0 = (m_begin + step % per_head) * BLOCK_M;
        const int rows = min(BLOCK_M, sq.nq - m0);
        const i64 row0 = sq.q_row0 + m0;
        load_tile_rows<HEAD_DIM, BLOCK_M, Tr::kThreads, VEC>(sQ + buf * Tr::kTileQ, q + b * q_sb + h * q_sh + row0 * q_sn, q_sn, rows, d, threadIdx.x);
        load_tile_rows<HEAD_DIM, BLOCK_M, Tr::kThreads, VEC>(sdO + buf * Tr::kTileQ, dout + b * do_sb + h * do_sh + row0 * do_sn, do_sn, rows, d, threadIdx.x);
        const i64 stat = ((i64)b * hq + h) * nq + row0;
        load_row_stats<BLOCK_M, Tr::kThreads>(sL, sD, buf, lse, dsum, stat, rows, threadIdx.x);
    };
    if (n_steps > 0) load_step(0, 0);
    cp_async_commit();

    float acc_dk[kMmaM][kND][4], acc_dv[kMmaM][kND][4];
    zero_acc(acc_dk, acc_dv);

    // Lane address generators (see common.cuh): A operands from K/V rows (non-transposed),
    // B operands from Q/dO rows (non-transposed for S^T and dP^T, transposed for dV and dK).
    // All tiles sit at compile-time offsets from one shared base (see LaneAddr).
    const u32 sbase = smem_addr(smem);
    constexpr u32 oV = Tr::kTileKV * 2, oQ = 2 * Tr::kTileKV * 2, odO = oQ + 2 * Tr::kTileQ * 2;
    constexpr u32 odS = odO + 2 * Tr::kTileQ * 2;
    const LaneAddr<HEAD_DIM> aK(sbase, key_row0 + (lane & 15), lane >> 4);
    const LaneAddr<HEAD_DIM> aV(sbase + oV, key_row0 + (lane & 15), lane >> 4);
    const LaneAddr<HEAD_DIM> bQ(sbase + oQ, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> bQt(sbase + oQ, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    const LaneAddr<HEAD_DIM> bdO(sbase + odO, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> bdOt(sbase + odO, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    // dQ = dS K: A = dS from the dS^T tile (transposed ldmatrix), B = K (transposed ldmatrix).
    const int dq_rt = warp % Tr::kDqRowTiles, dq_cs = warp / Tr::kDqRowTiles;
    const LaneAddr<BLOCK_M> aS(sbase + odS, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> bKt(sbase, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);

    for (int step = 0; step < n_steps; ++step) {
        const int buf = step & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile `step` landed everywhere; everyone is done with the other buffer and sdS
        if (step + 1 < n_steps) load_step(step + 1, buf ^ 1);
        cp_async_commit();
        const u32 qoff = buf * Tr::kTileQ * 2;
        const int h = hk * group + step / per_head;
        const int m0 = (m_begin + step % per_head) * BLOCK_M;
        const float* tL = sL + buf * BLOCK_M;
        const float* tD = sD + buf * BLOCK_M;

        // S^T = K Q^T and dP^T = V dO^T for this warp's key rows.
        float s[kMmaM][kNQ][4], dp[kMmaM][kNQ][4];
        gemm_pair_nt<T>(s, dp, aK, aV, bQ, bdO, qoff);

        // (MOD) softcap and ALiBi on S^T, keeping the softcap's derivative.
        float gfac[MOD ? kMmaM : 1][MOD ? kNQ : 1][4];
        if constexpr (MOD) bwd_mod_scores_t(s, gfac, ScoreMod(mods, blockIdx.z, h, sq.nq, sq.nk), n0 + key_row0, m0, lane);

        // P^T with invisible pairs forced to 0, then dS^T = P^T (dP^T - D).
        bool need_mask = (n0 + BLOCK_N > sq.nk) || (m0 + BLOCK_M > sq.nq) || (kHi && n0 + BLOCK_N - 1 > m0 + sq.hi);
        if constexpr (BAND) need_mask = need_mask || n0 < m0 + BLOCK_M - 1 + sq.lo;
        bwd_probs_t<kHi, BAND>(s, tL, need_mask, sq, n0 + key_row0, m0, scale_log2, lane);
        bwd_dscores_t<MOD>(dp, s, tD, gfac, lane);

        // dV += P^T dO and dK += dS^T Q; one copy of dS^T to shared memory for dQ.
        accumulate_dkdv<T, Tr>(acc_dv, acc_dk, s, dp, bdOt, bQt, col0, qoff, ATOMIC_DQ && wd == 0, sdS, key_row0, lane);

        if constexpr (ATOMIC_DQ) {
            __syncthreads();  // the whole dS^T tile is in shared memory
            float* gq = dq_acc + (((i64)b * hq + h) * nq + sq.q_row0 + m0) * HEAD_DIM;
            atomic_add_dq_tile<T, Tr>(gq, aS, bKt, dq_rt, dq_cs, m0, sq.nq, lane);
        }
    }
    cp_async_wait<0>();

    // dK carries the softmax scale (S = scale * Q K^T).
    const float scale = scale_log2 / kLog2e;
    u16* gdk = dk + b * dk_sb + hk * dk_sh + (i64)(sq.k_row0 + n0) * dk_sn;
    u16* gdv = dv + b * dv_sb + hk * dv_sh + (i64)(sq.k_row0 + n0) * dv_sn;
    store_dkdv<T, VEC>(gdk, gdv, dk_sn, dv_sn, acc_dk, acc_dv, scale, key_row0, col0, keys_valid, d, lane);
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: the forward's shape (warps own query rows), fixed-order loop over key tiles.
// Large head dims split dQ's columns over DQ_SPLIT blocks (each recomputes S and dP) so that the
// accumulator fits in registers.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct DqTraits {
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kChunks = HEAD_DIM / 8;
    static constexpr int kRowsPerWarp = BLOCK_M / WARPS;
    static constexpr int kMmaM = kRowsPerWarp / 16;
    static constexpr int kTileQ = BLOCK_M * HEAD_DIM;
    static constexpr int kTileKV = BLOCK_N * HEAD_DIM;
    static constexpr int kSmemBytes = (2 * kTileQ + 4 * kTileKV) * 2;  // Q, dO, 2 x (K, V)
    static_assert(kRowsPerWarp % 16 == 0, "whole mma tiles");
    static_assert((BLOCK_M * kChunks) % kThreads == 0 && (BLOCK_N * kChunks) % kThreads == 0, "even loads");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int DQ_SPLIT, bool CAUSAL, bool VEC, bool BAND,
          bool MOD = false>
__device__ __forceinline__ void
attn_bwd_dq_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                 float* __restrict__ dq_acc,
                 i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                 i64 do_sb, i64 do_sh, i64 do_sn, int nq, int nk, int d, int group, int causal_off, float scale_log2,
                 BwdBand band, const ScoreModArgs& mods = ScoreModArgs{}) {
    using Tr = DqTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
    constexpr int kMmaM = Tr::kMmaM, kNS = BLOCK_N / 8, kNO = HEAD_DIM / 8 / DQ_SPLIT;
    static_assert(kNO % 2 == 0, "dQ column slices are pairs of 8-column tiles");
    constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    constexpr float kLog2e = 1.4426950408889634f;
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sdO = sQ + Tr::kTileQ;
    u16* sK = sdO + Tr::kTileQ;  // 2 buffers
    u16* sV = sK + 2 * Tr::kTileKV;  // 2 buffers

    const int split = blockIdx.x % DQ_SPLIT;  // which slice of dQ's columns
    const int m_block = gridDim.x / DQ_SPLIT - 1 - blockIdx.x / DQ_SPLIT;
    const int h = blockIdx.y, hk = h / group, hq = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = m_block * BLOCK_M;
    const BwdBandSeq sq = bwd_band_sequence<BAND>(band, blockIdx.z, nq, nk, causal_off);
    const int b = sq.b;
    if (BAND && m0 >= sq.nq) return;  // the grid covers the longest sequence
    const int rows_valid = min(BLOCK_M, sq.nq - m0);
    int j0, n_tiles;  // key tiles from the first row's lowest visible key to the last row's highest
    band_key_tiles<BLOCK_N, kHi, BAND>(m0, rows_valid, sq.nk, sq.hi, sq.lo, j0, n_tiles);

    const u16* gK = k + b * k_sb + hk * k_sh + (i64)sq.k_row0 * k_sn;
    const u16* gV = v + b * v_sb + hk * v_sh + (i64)sq.k_row0 * v_sn;
    const i64 qrow = sq.q_row0 + m0;
    load_tile_rows<HEAD_DIM, BLOCK_M, Tr::kThreads, VEC>(sQ, q + b * q_sb + h * q_sh + qrow * q_sn, q_sn, rows_valid, d, threadIdx.x);
    load_tile_rows<HEAD_DIM, BLOCK_M, Tr::kThreads, VEC>(sdO, dout + b * do_sb + h * do_sh + qrow * do_sn, do_sn, rows_valid, d, threadIdx.x);
    if (n_tiles > 0) {
        const int nn = j0 * BLOCK_N;
        load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sK, gK + nn * k_sn, k_sn, sq.nk - nn, d, threadIdx.x);
        load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sV, gV + nn * v_sn, v_sn, sq.nk - nn, d, threadIdx.x);
    }
    cp_async_commit();

    const int warp_row0 = warp * Tr::kRowsPerWarp;
    // Per-row statistics of this thread's rows (g and g+8 of each mma tile).
    float lse2[2 * kMmaM], dsv[2 * kMmaM];
    const i64 stat = ((i64)b * hq + h) * nq + sq.q_row0;
#pragma unroll
    for (int r = 0; r < 2 * kMmaM; ++r) {
        const int row = m0 + warp_row0 + (r / 2) * 16 + (lane >> 2) + (r % 2) * 8;
        const float l = row < sq.nq ? lse[stat + row] : -INFINITY;
        lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;
        dsv[r] = row < sq.nq ? dsum[stat + row] : 0.f;
    }
    float acc[kMmaM][kNO][4];
    zero_acc(acc);
    ScoreMod mod{};
    if constexpr (MOD) mod = ScoreMod(mods, blockIdx.z, h, sq.nq, sq.nk);

    const u32 sbase = smem_addr(smem);
    constexpr u32 odO = Tr::kTileQ * 2, oK = 2 * Tr::kTileQ * 2, oV = oK + 2 * Tr::kTileKV * 2;
    const LaneAddr<HEAD_DIM> aQ(sbase, warp_row0 + (lane & 15), lane >> 4);
    const LaneAddr<HEAD_DIM> adO(sbase + odO, warp_row0 + (lane & 15), lane >> 4);
    const LaneAddr<HEAD_DIM> bK(sbase + oK, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> bV(sbase + oV, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> bKt(sbase + oK, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < n_tiles) {
            const int nn = (j0 + j + 1) * BLOCK_N;
            load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sK + (buf ^ 1) * Tr::kTileKV, gK + nn * k_sn, k_sn, sq.nk - nn, d, threadIdx.x);
            load_tile_rows<HEAD_DIM, BLOCK_N, Tr::kThreads, VEC>(sV + (buf ^ 1) * Tr::kTileKV, gV + nn * v_sn, v_sn, sq.nk - nn, d, threadIdx.x);
        }
        cp_async_commit();
        const u32 koff = buf * Tr::kTileKV * 2;

        float s[kMmaM][kNS][4], dp[kMmaM][kNS][4];
        gemm_pair_nt<T>(s, dp, aQ, adO, bK, bV, koff);
        const int n0 = (j0 + j) * BLOCK_N;
        const bool need_mask = band_tile_needs_mask<BLOCK_N, Tr::kRowsPerWarp, kHi, BAND>(n0, sq.nk, m0 + warp_row0, sq.hi, sq.lo);
#pragma unroll
        for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = 2 * mi + hf;
                const int row = m0 + warp_row0 + mi * 16 + (lane >> 2) + 8 * hf;
                const int limit = kHi ? min(sq.nk, row + sq.hi + 1) : sq.nk, first = row + sq.lo;
#pragma unroll
                for (int ni = 0; ni < kNS; ++ni)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n0 + ni * 8 + 2 * (lane & 3) + e;
                        float sv = s[mi][ni][2 * hf + e], g = 1.f;
                        if constexpr (MOD) {  // softcap and ALiBi, and the softcap's derivative
                            float t;
                            sv = mod.apply(sv, row, col, t);
                            g = ScoreMod::grad(t);
                        }
                        float p = fast_exp2(fmaf(sv, scale_log2, -lse2[r]));
                        if (need_mask && (col >= limit || (BAND && col < first))) p = 0.f;
                        dp[mi][ni][2 * hf + e] = p * (dp[mi][ni][2 * hf + e] - dsv[r]);
                        if constexpr (MOD) dp[mi][ni][2 * hf + e] *= g;
                    }
            }
        // dQ += dS K.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            u32 a[kMmaM][4];
#pragma unroll
            for (int mi = 0; mi < kMmaM; ++mi) acc_to_a<T>(a[mi], dp[mi], kk);
#pragma unroll
            for (int di = 0; di < kNO; di += 2) {  // (mma_acc_times_bt's loop; inlined here it spills)
                u32 bk[4];
                ldmatrix_x4_trans(bk, bKt.at(kk * 16, split * kNO + di) + koff);
#pragma unroll
                for (int mi = 0; mi < kMmaM; ++mi) {
                    mma_16816<T>(acc[mi][di], a[mi], bk[0], bk[1]);
                    mma_16816<T>(acc[mi][di + 1], a[mi], bk[2], bk[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    float* gq = dq_acc + (stat + m0) * HEAD_DIM;
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = warp_row0 + mi * 16 + (lane >> 2) + 8 * hf;
            if (row < rows_valid) {
#pragma unroll
                for (int ni = 0; ni < kNO; ++ni) {
                    const int col = (split * kNO + ni) * 8 + 2 * (lane & 3);
                    *reinterpret_cast<float2*>(gq + (i64)row * HEAD_DIM + col) = make_float2(acc[mi][ni][2 * hf], acc[mi][ni][2 * hf + 1]);
                }
            }
        }
}

// The launchable dQ kernels, one body: BAND = false compiles the band code away.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int DQ_SPLIT, bool CAUSAL, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_dq(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
            float* __restrict__ dq_acc,
            i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
            i64 do_sb, i64 do_sh, i64 do_sn, int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_bwd_dq_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, DQ_SPLIT, CAUSAL, VEC, false>(
        q, k, v, dout, lse, dsum, dq_acc, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,
        nq, nk, d, group, causal_off, scale_log2, BwdBand{0, 0, nullptr, nullptr});
}

// The same with a band and packed sequences (see BwdBand).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int DQ_SPLIT, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_dq_band(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                 float* __restrict__ dq_acc,
                 i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                 i64 do_sb, i64 do_sh, i64 do_sn, int nq, int nk, int d, int group, int hi_off, float scale_log2,
                 int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    attn_bwd_dq_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, DQ_SPLIT, true, VEC, true>(
        q, k, v, dout, lse, dsum, dq_acc, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,
        nq, nk, d, group, hi_off, scale_log2, BwdBand{lo_off, align, cu_q, cu_k});
}

// The band dQ kernel with score modifiers (softcap, ALiBi: score_mod.cuh).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int DQ_SPLIT, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_dq_band_mod(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                     const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                     float* __restrict__ dq_acc,
                     i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                     i64 do_sb, i64 do_sh, i64 do_sn, int nq, int nk, int d, int group, int hi_off, float scale_log2,
                     int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                     float cap_ex2, float cap_out, float inv_scale, const float* __restrict__ alibi, int alibi_sb) {
    attn_bwd_dq_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, DQ_SPLIT, true, VEC, true, true>(
        q, k, v, dout, lse, dsum, dq_acc, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,
        nq, nk, d, group, hi_off, scale_log2, BwdBand{lo_off, align, cu_q, cu_k},
        ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, nullptr});
}

// ---------------------------------------------------------------------------------------------
// The launchable kernels: the plain ones keep their arguments (BAND = false compiles the band code
// away); the *_band ones take the band and the packed-sequence offsets.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int WARPS_D, bool CAUSAL, bool VEC, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_kv(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
            float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv,
            i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
            i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
            int hq, int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_bwd_kv_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, WARPS_D, CAUSAL, VEC, ATOMIC_DQ, false>(
        q, k, v, dout, lse, dsum, dq_acc, dk, dv, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn,
        do_sb, do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, hq, nq, nk, d, group, causal_off, scale_log2,
        BwdBand{0, 0, nullptr, nullptr});
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int WARPS_D, bool VEC, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_kv_band(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                 float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv,
                 i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                 i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                 int hq, int nq, int nk, int d, int group, int hi_off, float scale_log2,
                 int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    attn_bwd_kv_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, WARPS_D, true, VEC, ATOMIC_DQ, true>(
        q, k, v, dout, lse, dsum, dq_acc, dk, dv, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn,
        do_sb, do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, hq, nq, nk, d, group, hi_off, scale_log2,
        BwdBand{lo_off, align, cu_q, cu_k});
}

// The band K/V kernel with score modifiers (softcap, ALiBi: score_mod.cuh; sinks need no change
// of the backward kernels: lse includes them).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int WARPS_D, bool VEC, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_kv_band_mod(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                     const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                     float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv,
                     i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                     i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                     int hq, int nq, int nk, int d, int group, int hi_off, float scale_log2,
                     int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                     float cap_ex2, float cap_out, float inv_scale, const float* __restrict__ alibi, int alibi_sb) {
    attn_bwd_kv_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, WARPS_D, true, VEC, ATOMIC_DQ, true, true>(
        q, k, v, dout, lse, dsum, dq_acc, dk, dv, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn,
        do_sb, do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, hq, nq, nk, d, group, hi_off, scale_log2,
        BwdBand{lo_off, align, cu_q, cu_k}, ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, nullptr});
}

// ---------------------------------------------------------------------------------------------
// dQ = scale * the float32 accumulator, 8 columns of a row per thread (16-byte stores where dQ's
// row allows), 256 threads per block. (One element per thread with 64-bit divisions was
// issue-bound: 204-211 us for 16k tokens x 2048 on the H200, ncu; cuDNN's takes 53.)
//   rows (FRAG false): rows of HEAD_DIM floats, (batch, head, query) major; blockIdx.x covers
//     (head, query, 8-column group) of batch entry blockIdx.y.
//   FRAG: attn_bwd_kv_wgmma_ws's fragment-order 64 x 64 chunks, (batch, head, 64-query tile,
//     64-column block) major, one block per chunk: element (row r, column c) of a chunk sits in
//     thread t = 32 (r / 16) + 4 (r % 8) + (c % 8) / 2 of the warpgroup, its float4 k = c / 8,
//     entry 2 ((r % 16) / 8) + c % 2, at float (128 k + t) 4 + entry. The block reads the chunk's
//     float4s contiguously (float4 f: t = f % 128, k = f / 128: rows r, r + 8, columns c, c + 1),
//     converts them into a shared 64 x 64 tile, and writes whole rows from it. (Writing 16 bytes
//     of 32 rows per warp straight from the fragment order kept L2 82% busy at d=64: 267 us for
//     16k tokens x 2048, H200 ncu.)
template <typename T>
__device__ __forceinline__ void store_dq8(u16* __restrict__ row, int c, int d, const float (&v)[8], float scale) {
    if (c + 8 <= d && (reinterpret_cast<unsigned long long>(row + c) & 15) == 0) {
        uint4 w;
        w.x = pack2<T>(v[0] * scale, v[1] * scale);
        w.y = pack2<T>(v[2] * scale, v[3] * scale);
        w.z = pack2<T>(v[4] * scale, v[5] * scale);
        w.w = pack2<T>(v[6] * scale, v[7] * scale);
        *reinterpret_cast<uint4*>(row + c) = w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (c + j < d) row[c + j] = from_float<T>(v[j] * scale);
    }
}

template <typename T, int HEAD_DIM, bool FRAG = false>
__global__ void __launch_bounds__(256)
attn_bwd_dq_convert(const float* __restrict__ dq_acc, u16* __restrict__ dq, i64 sb, i64 sh, i64 sn, int hq, int nq,
                    int d, float scale) {
    static_assert(HEAD_DIM % 64 == 0 || !FRAG, "fragment chunks are 64 columns wide");
    const int b = blockIdx.y;
    if constexpr (FRAG) {
        constexpr int kColBlocks = HEAD_DIM / 64, kPitch = 36;  // words per tile row: 16-byte rows, no bank conflict
        __shared__ __align__(16) u32 tile[64 * kPitch];        // bf16/fp16 pairs
        const int row_tiles = (nq + 63) / 64;
        const int chunk = blockIdx.x;  // within batch entry b: (head, 64-query tile, 64-column block)
        const int cb = chunk % kColBlocks, rt = (chunk / kColBlocks) % row_tiles, h = chunk / (kColBlocks * row_tiles);
        const float4* src = reinterpret_cast<const float4*>(dq_acc + ((i64)b * hq * row_tiles * kColBlocks + chunk) * 4096);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int f = 256 * j + threadIdx.x, t = f & 127, k = f >> 7;
            const float4 v = src[f];
            const int r = 16 * (t >> 5) + ((t >> 2) & 7), w = 4 * k + (t & 3);  // w: the column pair c / 2
            tile[r * kPitch + w] = pack2<T>(v.x * scale, v.y * scale);
            tile[(r + 8) * kPitch + w] = pack2<T>(v.z * scale, v.w * scale);
        }
        __syncthreads();
        u16* base = dq + b * sb + h * sh;
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // 8 threads per 64-column row, 32 rows per pass
            const int r = 32 * j + (threadIdx.x >> 3), g = threadIdx.x & 7;
            const int row = 64 * rt + r, c = 64 * cb + 8 * g;
            if (row >= nq) continue;
            const uint4 w = *reinterpret_cast<const uint4*>(&tile[r * kPitch + 4 * g]);
            u16* dst = base + row * sn + c;
            if (c + 8 <= d && (reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
                *reinterpret_cast<uint4*>(dst) = w;
            } else {
                const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (c + e < d) dst[e] = (u16)(e % 2 ? ws[e / 2] >> 16 : ws[e / 2] & 0xffff);
            }
        }
    } else {
        constexpr int kGroups = HEAD_DIM / 8;
        const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // (head * nq + query) * kGroups + group
        if (idx >= (i64)hq * nq * kGroups) return;
        const i64 r = idx / kGroups;  // (a constant divisor; one division by nq per 8 elements below)
        const int g = (int)(idx - r * kGroups), h = (int)(r / nq), i = (int)(r - (i64)h * nq);
        const float4* src = reinterpret_cast<const float4*>(dq_acc + ((i64)b * hq * nq + r) * HEAD_DIM + 8 * g);
        const float4 f0 = src[0], f1 = src[1];
        const float v[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
        store_dq8<T>(dq + b * sb + h * sh + (i64)i * sn, 8 * g, d, v, scale);
    }
}
