// Backward main kernel for Hopper (sm_90a): attn_bwd_kv's algorithm on wgmma tensor cores.
//
// One block per (K/V tile, K/V head, batch); each warpgroup owns 64 key rows (wgmma's M) and
// keeps their dK and dV accumulators in registers across the loop over the query heads of the
// GQA group and the query tiles that see the block's keys. Per query tile, per warpgroup:
//   S^T  = K Q^T,  dP^T = V dO^T              (A and B from shared memory, K-major)
//   P^T  = exp2(S^T * scale log2e - lse log2e), dS^T = P^T (dP^T - D)
//   dV  += P^T dO, dK += dS^T Q                (A = P^T / dS^T from registers, B N-major)
//   dQ  += dS K                                (A = dS^T from shared memory read M-major, B = K
//                                               N-major), added into the float32 accumulator
// A step of BLOCK_M = 128 queries runs the first four products in two 64-query halves (the
// registers of one half) and dQ once for the whole step.
// Head dims above 128 (kSplitD, kSplitS): the block owns 64 keys and each warpgroup half of dK's
// and dV's columns; each warpgroup computes S^T and dP^T for its 32 of the step's 64 queries,
// stores P^T and dS^T to shared memory, and after one block barrier takes dV and dK with both
// operands from shared memory; dQ is staged in the step's Q and dO tiles (kDqStagedInQdO) and
// added by bulk reduce-adds.
// dQ's split over the warpgroups, one atomic per element except the last:
//   rows    (BLOCK_M = 64 x warpgroups): each warpgroup takes 64 queries, all keys, all columns;
//   columns (head dim = 64-column block per warpgroup): all queries and keys, its own columns;
//   keys    (otherwise): all queries and columns over its own 64 keys (one atomic per warpgroup).
// attn_bwd_prep (D) and attn_bwd_dq_convert come from attn_bwd.cu; deterministic mode runs
// attn_bwd_dq there and this kernel with ATOMIC_DQ = false.
// attn_bwd_kv_wgmma_tma: the same kernel with each step's Q and dO tiles fetched by the bulk tensor
// copy engine (one thread issues 64-column boxes that land in the Sw128Tile layout, completing on
// one mbarrier per buffer) instead of every thread issuing cp.async copies.
// attn_bwd_kv_wgmma_ws (WS, warp-specialized; FlashAttention-3's layout): one
// more warpgroup at 24 registers whose warp 0 fills a two-stage ring of Q and dO (TMA) on
// full/empty mbarriers, and whose warp 1 adds dQ: each math warpgroup stores its 64 x 64 float32
// dQ tile to shared memory in its accumulator fragments' order, and the dQ warp adds the whole
// 16 KiB to global memory with one bulk reduce-add. The accumulator (dq_acc) is therefore in
// fragment order, 64 x 64 chunks (attn_bwd_dq_convert<..., true> reorders it). Each step's lse
// and D come with its Q/dO boxes from the producer's warp 0 (MATH_STATS: the math warpgroups copy
// them a step ahead by cp.async instead), so the math warpgroups (240 registers) issue no other
// global access in the loop. attn_bwd_kv_wgmma_ws_persistent: the same over work units, at most
// one block per SM, with MATH_STATS (its 24-register producer spills the per-row loads).
#include "common.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "hopper/bwd_traits.cuh"
#include "hopper/bwd_smem.cuh"
#include "hopper/bwd_scheduler.cuh"
#include "hopper/bwd_producer.cuh"
#include "hopper/bwd_dq.cuh"
#include "hopper/bwd_consumer.cuh"
#include "hopper/bwd_epilogue.cuh"

template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL, bool ATOMIC_DQ, bool TMA, bool WS = false,
          bool PERSISTENT = false, bool MATH_STATS = true, bool MOD = false>
__device__ __forceinline__ void
attn_bwd_kv_wgmma_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                       const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                       float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv,
                       i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                       i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn,
                       int hq, int nq, int nk, int d, int group, int causal_off, float scale_log2, BwdMaps maps,
                       BwdUnits units = BwdUnits{}, const ScoreModArgs& mods = ScoreModArgs{}) {
    using Tr = HopperBwdTraits<HEAD_DIM, BLOCK_M, WARPGROUPS, TMA, WS>;
    static_assert(!WS || (TMA && ATOMIC_DQ && Tr::kDqCols == 64), "WS: TMA loads, atomic dQ in 64 x 64 tiles");
    // 2 math warpgroups: the register split (24 + 2 x 240) and the barrier IDs below assume it; the
    // keys split of dQ syncs each warpgroup alone on barrier 1 + wg, which WS uses for the block.
    static_assert(!WS || (WARPGROUPS == 2 && Tr::kDqBlockSync), "WS: 2 math warpgroups, dQ split by rows or columns");
    static_assert(!PERSISTENT || WS, "PERSISTENT: the warp-specialized kernel");
    // (WS) lse and D by the math threads a step ahead (cp.async), or by the producer's warp 0 with
    // the Q/dO boxes; PERSISTENT needs the former (the producer spills the per-row loads there).
    static_assert(MATH_STATS || (WS && !PERSISTENT), "producer-loaded row statistics: the plain WS kernel");
    constexpr bool kProducerStats = WS && !MATH_STATS;
    using TileQ = typename Tr::TileQ;
    using TileKV = typename Tr::TileKV;
    using TileS = typename Tr::TileS;
    constexpr int kBN = Tr::kBlockN, kThreads = Tr::kThreads;
    constexpr int kND = Tr::kDkvCols / 8;  // 8-column blocks of this warpgroup's dK and dV
    constexpr float kLog2e = 1.4426950408889634f;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const BwdSmem<Tr> sm(smem_raw);
    // (WS) named barriers: 1 the math warpgroups, 6 + w dQ tile w full, 8 + w dQ tile w free (math
    // warpgroup w's 128 threads and the dQ warp's 32 meet on each).
    constexpr int kMathThreads = 128 * WARPGROUPS, kDqBarThreads = 128 + 32;

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int key_row = (Tr::kSplitD ? 0 : 64 * wg) + 16 * warp + (lane >> 2);  // this thread's first key row (+8 the second)
    // (split S) this warpgroup's S^T and dP^T columns: 32 of the half's 64 queries, from 32 wg
    using Scores = BwdTransposedScores<T, Tr, CAUSAL>;
    constexpr int kSN = Scores::kSN;
    const int q_sub = Tr::kSplitS ? 32 * wg : 0;
    const Scores st{key_row, q_sub, lane};
    // (split head dim) this warpgroup's dK/dV columns: their first 8-column block, and the byte
    // offset of their first 64-column block in a Q or dO tile.
    const int dkv_nb0 = Tr::kSplitD ? wg * kND : 0;
    const u32 dkv_cb = Tr::kSplitD ? wg * (Tr::kDkvCols / 64) * TileQ::kBlockBytes : 0;

    const BwdScheduler<Tr, CAUSAL, PERSISTENT> sched{units, nq, group, causal_off};

    if constexpr (TMA) {
        if (tid == 0) sm.template init_barriers<WS, PERSISTENT>(kProducerStats ? 32 : 1, kMathThreads);
        __syncthreads();  // initialized before anyone waits on them
    }
    if constexpr (WS) {
        if (tid >= kMathThreads) {
            bwd_producer_warpgroup<Tr, WARPGROUPS, kProducerStats>(sm, sched, maps, lse, dsum, dq_acc, hq, nq, tid, lane);
            return;
        }
        setmaxnreg_inc<240>();
    }
    constexpr int kLoaders = WS ? kMathThreads : kThreads;  // (== kThreads: the math threads)
    int g = 0, units_done = 0;  // steps and units before this one
    for (int u = sched.unit0(); u < sched.n_units(); u += sched.unit_stride(), ++units_done) {
        const BwdUnit t = sched.unit_at(u);
        const int hk = t.hk, b = t.b, n0 = t.n0, m_begin = t.m_begin, per_head = t.per_head, n_steps = t.n_steps;
        const int keys_valid = min(kBN, nk - n0);
        bwd_load_kv<Tr, PERSISTENT, kLoaders>(sm, maps, BwdTensor{k, k_sb, k_sh, k_sn}, BwdTensor{v, v_sb, v_sh, v_sn}, n0, hk,
                                              b, keys_valid, d, units_done, tid);
        auto load_step = [&](int step, int buf) {
            bwd_load_step<Tr, TMA>(sm, maps, BwdTensor{q, q_sb, q_sh, q_sn}, BwdTensor{dout, do_sb, do_sh, do_sn}, lse, dsum, b,
                                   hk * group + step / per_head, (m_begin + step % per_head) * BLOCK_M, hq, nq, d, buf, tid);
        };
        // (WS, MATH_STATS) the math threads copy each step's lse and D themselves, a step ahead
        // (cp.async), instead of the producer's warp 0.
        auto load_stats = [&](int step, int buf) {
            const int h = hk * group + step / per_head;
            const int m0 = (m_begin + step % per_head) * BLOCK_M;
            load_row_stats_async<BLOCK_M, kMathThreads>(sm.sL, sm.sD, buf, lse, dsum, ((i64)b * hq + h) * nq + m0,
                                                        min(BLOCK_M, nq - m0), tid);
        };
        if (n_steps > 0) {
            if constexpr (WS) {
                if constexpr (!kProducerStats) load_stats(0, g & 1);
            } else {
                load_step(0, 0);
            }
        }
        cp_async_commit();

        float acc_dk[kND][4], acc_dv[kND][4];
#pragma unroll
        for (int ni = 0; ni < kND; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[ni][e] = acc_dv[ni][e] = 0.f;

        const u32 kv_row0 = Tr::kSplitD ? 0 : 64 * wg * 128;  // this warpgroup's key rows (split head dim: all)
        const u32 k_rows = sm.sK + kv_row0, v_rows = sm.sV + kv_row0;
        for (int step = 0; step < n_steps; ++step) {
            const int gs = g + step, buf = gs & 1;
            // Tile `step` landed (without WS, everywhere once the block barrier below is passed).
            cp_async_wait<0>();
            if constexpr (TMA) mbar_wait(sm.sBar + 8 * buf, (gs >> 1) & 1);  // buffer buf's (gs/2)-th fill
            // This thread's row statistics of the step have landed: into their stored form
            // (kProducerStats: stored so by the producer).
            if constexpr (!kProducerStats)
                fix_row_stats<BLOCK_M, kThreads>(sm.sL, buf, min(BLOCK_M, nq - (m_begin + step % per_head) * BLOCK_M), tid);
            fence_proxy_async();
            if constexpr (WS) {
                // K/V (step 0) landed everywhere; (math stats) the other threads' rows fixed and
                // buffer buf ^ 1's rows read; (one dS^T buffer) both warpgroups left it. Two dS^T
                // buffers need no meeting for it: buffer gs & 1 was last read by step gs - 2's dQ,
                // which both warpgroups finished before the barrier ahead of step gs - 1's.
                if (!kProducerStats || step == 0 || Tr::kDsBuffers == 1) named_barrier(1, kMathThreads);
                if constexpr (!kProducerStats) {
                    if (step + 1 < n_steps) load_stats(step + 1, buf ^ 1);
                    cp_async_commit();
                }
            } else {
                bwd_dq_staged_read<Tr>(tid);  // (staged dQ) step - 1's reduce-adds read buffer buf ^ 1, refilled here
                __syncthreads();
                if (step + 1 < n_steps) load_step(step + 1, buf ^ 1);
                cp_async_commit();
            }
            const int h = hk * group + step / per_head;
            const int m0 = (m_begin + step % per_head) * BLOCK_M;
            const u32 tq = sm.sQ + buf * TileQ::kBytes, tdo = sm.sdO + buf * TileQ::kBytes;
            const u32 tds = sm.sdS + (Tr::kDsBuffers == 2 ? buf * TileS::kBytes : 0);
            const float* tL = sm.sL + buf * BLOCK_M;
            const float* tD = sm.sD + buf * BLOCK_M;

            const bool need_mask = (n0 + kBN > nk) || (m0 + BLOCK_M > nq) || (CAUSAL && n0 + kBN - 1 > m0 + causal_off);
            // (MOD) this step's head's softcap and ALiBi slope (a GQA block steps through its heads).
            ScoreMod mod{};
            if constexpr (MOD) mod = ScoreMod(mods, b, h, nq, nk);
            // This half's P^T and dS^T as A fragments. Declared out here so that the last half's stay
            // pinned (fence_regs after the final wait) while its dV and dK read them.
            u32 pf[64 / 16][4], sf[64 / 16][4];
            // dK += dS^T Q for the half whose query rows start q_half bytes into the Q tile, one group.
            auto issue_dk = [&](u32 q_half) {
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    Wgmma<T, Tr::kDkvCols>::rs(acc_dk, sf[kk], sw128_desc(tq + dkv_cb + q_half + kk * 16 * 128, TileQ::kBlockBytes, 1024), 1);
                wgmma_commit();
            };
#pragma unroll
            for (int hv = 0; hv < Tr::kHalves; ++hv) {
                const u32 q_half = 64 * hv * 128;  // the half's first query row in the Q and dO tiles
                // S^T = K Q^T and dP^T = V dO^T, two commit groups: acc = (this warpgroup's rows of
                // K or V) x (this half's rows of Q or dO)^T, over the head dim.
                // (split S: this warpgroup's 32 queries of the half)
                float s[kSN][4], dp[kSN][4];
                wgmma_fence();
                st.issue(s, k_rows, tq, q_half);
                st.issue(dp, v_rows, tdo, q_half);

                // P^T with invisible pairs forced to 0 (keys past nk, queries past nq, the causal mask).
                wgmma_wait<1>();
                fence_regs(s);
                // (MOD) the modified scores (S^T's rows are keys, its columns queries).
                if constexpr (MOD) mod.apply_cols<8>(s, m0 + 64 * hv, n0 + key_row, lane);
                st.probs(s, tL, scale_log2, hv);
                if (need_mask) st.mask(s, hv, n0, m0, nk, nq, causal_off);
                if constexpr (Tr::kSplitS) {
                    st.store(sm.sPt, s);  // dV reads P^T from shared memory once both halves are in
                } else {
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) acc_to_a<T>(pf[kk], s, kk);
                    // dV += P^T dO (dO read N-major: rows are the k steps).
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        Wgmma<T, Tr::kDkvCols>::rs(acc_dv, pf[kk], sw128_desc(tdo + dkv_cb + q_half + kk * 16 * 128, TileQ::kBlockBytes, 1024), 1);
                    wgmma_commit();
                }

                // dS^T = P^T (dP^T - D), rounded once: into registers for dK and into shared memory for dQ.
                wgmma_wait<Tr::kSplitS ? 0 : 1>();
                fence_regs(dp);
                st.dscores(dp, s, tD, hv);
                if constexpr (MOD) {
                    if (mod.capped()) st.softcap_grad(dp, s, mod, tL, scale_log2, hv, n0, m0);
                }
                if constexpr (Tr::kSplitS) st.store(tds, dp);  // for dK and dQ, once both halves are in
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) if constexpr (!Tr::kSplitS) acc_to_a<T>(sf[kk], dp, kk);
                if (ATOMIC_DQ && !Tr::kSplitS) st.store_frags(tds, sf, hv);
                if (hv + 1 < Tr::kHalves) {  // dK += dS^T Q for this half; the last half's waits for dQ
                    wgmma_fence();
                    issue_dk(q_half);
                    wgmma_wait<0>();
                    fence_regs(acc_dv);
                    fence_regs(acc_dk);
                    fence_regs(pf);
                    fence_regs(sf);
                }
            }
            if constexpr (ATOMIC_DQ || Tr::kSplitS) bwd_dq_sync<Tr, WS>(wg);
            // dQ (if atomic) then the last half's dK, two groups: dQ's atomics run while dK is on the
            // tensor cores, and nothing is in flight across iterations (a wgmma in flight over the
            // loop's back edge makes ptxas serialize them all).
            const BwdDqSplit<Tr> dq(wg);
            float acc_q[ATOMIC_DQ ? Tr::kDqCols / 8 : 1][4];  // unused without ATOMIC_DQ
            wgmma_fence();
            if constexpr (Tr::kSplitS) {  // dV += P^T dO and dK += dS^T Q, both from shared memory
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    Wgmma<T, Tr::kDkvCols>::template ss<0, 1>(acc_dv, sw128_desc(sm.sPt + kk * 32, 16, 1024),
                                                              sw128_desc(tdo + dkv_cb + kk * 16 * 128, TileQ::kBlockBytes, 1024), 1);
                wgmma_commit();
            }
            if constexpr (ATOMIC_DQ) bwd_issue_dq<T, Tr>(acc_q, dq, tds, sm.sK);
            if constexpr (Tr::kSplitS) {
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    Wgmma<T, Tr::kDkvCols>::template ss<0, 1>(acc_dk, sw128_desc(tds + kk * 32, 16, 1024),
                                                              sw128_desc(tq + dkv_cb + kk * 16 * 128, TileQ::kBlockBytes, 1024), 1);
                wgmma_commit();
            } else {
                issue_dk(64 * (Tr::kHalves - 1) * 128);  // the last half's
            }
            if constexpr (ATOMIC_DQ && Tr::kDqStagedInQdO) {
                wgmma_wait<0>();  // dQ and this warpgroup's dV and dK: its columns of Q and dO are read
                fence_regs(acc_q);
                bwd_add_dq_staged<Tr>(acc_q, tq, tdo, dq_acc, b, h, hq, nq, m0, wg, tid);
            } else if constexpr (ATOMIC_DQ) {
                wgmma_wait<1>();  // dV and dQ done; dK in flight
                fence_regs(acc_q);
                bwd_store_dq<Tr, WS>(acc_q, dq, sm, dq_acc, b, h, hq, nq, m0, wg, tid, warp, lane);
            }
            wgmma_wait<0>();
            fence_regs(acc_dv);
            fence_regs(acc_dk);
            if constexpr (!Tr::kSplitS) {
                fence_regs(pf);
                fence_regs(sf);
            }
            if constexpr (WS) mbar_arrive(sm.sEmpty + 8 * buf);  // this thread's reads of Q/dO buffer buf are done
        }
        cp_async_wait<0>();

        // dK carries the softmax scale (S = scale * Q K^T).
        const float scale = scale_log2 / kLog2e;
        u16* gdk = dk + b * dk_sb + hk * dk_sh + n0 * dk_sn;
        u16* gdv = dv + b * dv_sb + hk * dv_sh + n0 * dv_sn;
        bwd_store_dkdv<T, Tr, TMA, WS, PERSISTENT>(acc_dk, acc_dv, sm, gdk, gdv, dk_sn, dv_sn, scale, keys_valid, d, tid, key_row,
                                                   dkv_nb0, lane);
        g += n_steps;
    }  // units
    if constexpr (WS) named_barrier(8 + wg, kDqBarThreads);  // the dQ warp's last arrival (see there)
    if constexpr (Tr::kDqStagedInQdO && ATOMIC_DQ) {
        if ((tid & 127) == 0) bulk_wait<0>();  // the staged dQ's reduce-adds complete before the block ends
    }
}

// The kernels' arguments after the tensor maps (the TMA kernel's Q and dO pointers and strides
// unused but for one launch).
#define BWD_KV_PARAMS                                                                                           \
    const u16 *__restrict__ q, const u16 *__restrict__ k, const u16 *__restrict__ v,                            \
        const u16 *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dsum,            \
        float *__restrict__ dq_acc, u16 *__restrict__ dk, u16 *__restrict__ dv, i64 q_sb, i64 q_sh, i64 q_sn,   \
        i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn,            \
        i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn, int hq, int nq, int nk, int d,        \
        int group, int causal_off, float scale_log2
#define BWD_KV_ARGS                                                                                             \
    q, k, v, dout, lse, dsum, dq_acc, dk, dv, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb,      \
        do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, hq, nq, nk, d, group, causal_off, scale_log2
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPGROUPS * 128, 1)
attn_bwd_kv_wgmma(BWD_KV_PARAMS) {
    attn_bwd_kv_wgmma_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CAUSAL, ATOMIC_DQ, false>(BWD_KV_ARGS,
                                                                                     BwdMaps{nullptr, nullptr});
}

// Q and dO through tensor maps (d, queries, heads, batch) with 64 x BLOCK_M boxes.
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPGROUPS * 128, 1)
attn_bwd_kv_wgmma_tma(const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_do, BWD_KV_PARAMS) {
    attn_bwd_kv_wgmma_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CAUSAL, ATOMIC_DQ, true>(BWD_KV_ARGS,
                                                                                    BwdMaps{&tmap_q, &tmap_do});
}

// Warp-specialized (WS): Q and dO by TMA from the producer warpgroup's warp 0, lse and D by the
// math threads (MATH_STATS) or by that warp; dQ added from shared memory by its dQ warp into a
// fragment-order accumulator of 64 x 64 float32 chunks, (batch, head, 64-query tile, 64-column
// block) major (attn_bwd_dq_convert<..., true>, attn_bwd.cu). Atomic dQ only (deterministic runs
// attn_bwd_kv_wgmma_tma). Arguments as attn_bwd_kv_wgmma_tma.
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL, bool MATH_STATS>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_bwd_kv_wgmma_ws(const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_do, BWD_KV_PARAMS) {
    attn_bwd_kv_wgmma_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CAUSAL, true, true, true, false, MATH_STATS>(
        BWD_KV_ARGS, BwdMaps{&tmap_q, &tmap_do});
}

// attn_bwd_kv_wgmma_ws with score modifiers (score_mod.cuh: softcap, ALiBi; sinks change no
// kernel, the lse includes them), no mask or a causal one. alibi is batch x alibi_sb + head,
// offset to the launch's first batch entry.
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL, bool MATH_STATS>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_bwd_kv_wgmma_ws_mod(const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_do, BWD_KV_PARAMS,
                         float cap_ex2, float cap_out, float inv_scale, const float* __restrict__ alibi, int alibi_sb) {
    attn_bwd_kv_wgmma_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CAUSAL, true, true, true, false, MATH_STATS, true>(
        BWD_KV_ARGS, BwdMaps{&tmap_q, &tmap_do}, BwdUnits{},
        ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, nullptr});
}

// attn_bwd_kv_wgmma_ws over a grid of at most one block per SM (K and V through tensor maps
// too), each block walking the units (key tile, K/V head, batch entry) blockIdx.x, + gridDim.x, ...
// of kv_tiles x hkv x batch = n_units (counted on the host): the producer fills the Q/dO ring with
// the next unit's first tiles and the dQ warp drains this unit's last adds while the math
// warpgroups store dK/dV and load the next K/V, so a block's start and end are paid once per SM
// instead of once per unit.
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool CAUSAL>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_bwd_kv_wgmma_ws_persistent(const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_do,
                                const __grid_constant__ TmaDesc tmap_k, const __grid_constant__ TmaDesc tmap_v,
                                BWD_KV_PARAMS, int kv_tiles, int hkv, int n_units) {
    attn_bwd_kv_wgmma_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CAUSAL, true, true, true, true>(
        BWD_KV_ARGS, BwdMaps{&tmap_q, &tmap_do, &tmap_k, &tmap_v}, BwdUnits{kv_tiles, hkv, n_units});
}
#undef BWD_KV_PARAMS
#undef BWD_KV_ARGS
