// The Hopper backward's math on the transposed scores, per query step, half and warpgroup: rows are
// this warpgroup's keys (key_row, key_row + 8 per thread), columns the half's queries (kSN 8-query
// blocks from q_sub). The GEMMs S^T = K Q^T and dP^T = V dO^T, P^T from the row statistics with
// the mask, dS^T = P^T (dP^T - D), and their 16-bit stores to shared memory.
#pragma once
#include "hopper/bwd_smem.cuh"
#include "score_mod.cuh"

template <typename T, typename Tr, bool CAUSAL>
struct BwdTransposedScores {
    using TileQ = typename Tr::TileQ;
    using TileKV = typename Tr::TileKV;
    using TileS = typename Tr::TileS;
    // (split S) each warpgroup takes 32 of the half's 64 queries: 4 8-query blocks, else 8.
    static constexpr int kSN = Tr::kSplitS ? 4 : 8;
    int key_row;  // this thread's first key row in the block's tile (+8 the second)
    int q_sub;    // (split S) the warpgroup's first query of the half
    int lane;

    // The query within the step of accumulator column (ni, e & 1), in half hv.
    __device__ __forceinline__ int query(int hv, int ni, int e) const {
        return 64 * hv + q_sub + ni * 8 + 2 * (lane & 3) + (e & 1);
    }

    // acc = (this warpgroup's rows of K or V) x (the half's rows of Q or dO)^T over the head dim,
    // one commit group; q_half: the half's first row, in bytes into the Q or dO tile.
    __device__ __forceinline__ void issue(float (&acc)[kSN][4], u32 kv_rows, u32 q_tile, u32 q_half) const {
#pragma unroll
        for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
            const u32 off = (kk >> 2) * TileKV::kBlockBytes + (kk & 3) * 32;
            const u32 offq = (kk >> 2) * TileQ::kBlockBytes + (kk & 3) * 32 + q_half + q_sub * 128;
            Wgmma<T, 8 * kSN>::ss(acc, sw128_desc(kv_rows + off, 16, 1024), sw128_desc(q_tile + offq, 16, 1024), kk > 0);
        }
        wgmma_commit();
    }

    // P^T = exp2(S^T scale log2e - lse log2e) (tL: the step's lse in log2 units).
    __device__ __forceinline__ void probs(float (&s)[kSN][4], const float* tL, float scale_log2, int hv) const {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int ni = 0; ni < kSN; ++ni)
#pragma unroll
                for (int e = 0; e < 2; ++e) s[ni][2 * hf + e] = fast_exp2(fmaf(s[ni][2 * hf + e], scale_log2, -tL[query(hv, ni, e)]));
    }

    // Invisible pairs of P^T to 0: keys past nk, queries past nq, the causal mask. A loop of its
    // own behind the caller's one branch: tested inside probs()' loop, ptxas made it one branch per
    // element pair on every step, masked or not (H200 trace, N=4k: per step d=64 causal 3.32 ->
    // 2.73 us, full 2.95 -> 2.75, d=128 causal 2.45 -> 2.25).
    __device__ __forceinline__ void mask(float (&p)[kSN][4], int hv, int n0, int m0, int nk, int nq, int causal_off) const {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int key = n0 + key_row + 8 * hf;
#pragma unroll
            for (int ni = 0; ni < kSN; ++ni)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    // (m0 + query(hv, ni, e), summed in this order: the other moves registers in the loop)
                    const int qi = m0 + 64 * hv + q_sub + ni * 8 + 2 * (lane & 3) + e;
                    const bool vis = key < nk && qi < nq && (!CAUSAL || key <= qi + causal_off);
                    p[ni][2 * hf + e] = vis ? p[ni][2 * hf + e] : 0.f;
                }
        }
    }

    // dP^T -> dS^T = P^T (dP^T - D) (tD: the step's D).
    __device__ __forceinline__ void dscores(float (&dp)[kSN][4], const float (&p)[kSN][4], const float* tD, int hv) const {
#pragma unroll
        for (int ni = 0; ni < kSN; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[ni][e] = p[ni][e] * (dp[ni][e] - tD[query(hv, ni, e)]);
    }

    // (softcap) dS^T times the cap's factor 1 - tanh^2, its tanh recovered from P and the lse:
    // keeping it from the scores instead, 32 more registers per thread spill 76 words at d = 128.
    __device__ __forceinline__ void softcap_grad(float (&ds)[kSN][4], const float (&p)[kSN][4], const ScoreMod& mod,
                                                 const float* tL, float scale_log2, int hv, int n0, int m0) const {
        const float d0 = mod.col_dist0(m0 + 64 * hv, n0 + key_row, lane);
        const float tanh_per_log2 = mod.cap_in() / scale_log2;
#pragma unroll
        for (int ni = 0; ni < kSN; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                ds[ni][e] *= mod.grad_from_prob(p[ni][e], tL[query(hv, ni, e)], tanh_per_log2, d0 + ScoreMod::col_dist(ni, e));
    }

    // (split S) P^T or dS^T rounded into the shared tile, each warpgroup its queries' columns.
    __device__ __forceinline__ void store(u32 tile, const float (&acc)[kSN][4]) const {
#pragma unroll
        for (int ni = 0; ni < kSN; ++ni)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(tile + TileS::offset(key_row + 8 * hf, q_sub / 8 + ni) + 4 * (lane & 3)),
                             "r"(pack2<T>(acc[ni][2 * hf], acc[ni][2 * hf + 1])));
    }

    // dS^T's A fragments of half hv into the dS^T tile for dQ: sf[kk] holds rows (key_row,
    // key_row + 8) x query columns 64 hv + 16 kk + 2t (+1, +8, +9).
    __device__ __forceinline__ void store_frags(u32 tds, const u32 (&sf)[4][4], int hv) const {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = key_row + 8 * (r & 1), chunk = 8 * hv + 2 * kk + (r >> 1);
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(tds + TileS::offset(row, chunk) + 4 * (lane & 3)), "r"(sf[kk][r]));
            }
    }
};
