// The Hopper forward's math warpgroup (the consumer): the key tiles its own rows see, S_0 before
// the loop, one K/V tile per step, (causal TMA) the tiles past its rows, and the wait before the
// epilogue. attn_fwd_wgmma_body runs it once per query tile:
//     FwdConsumer c(acc_o, acc_s, p_frag, softmax, alpha, moved, ...);  // n_mine, (ping-pong) the turns
//     c.prologue();                                                     // S_0 and its probabilities
//     for (j < n_mine - 1) c.step(j, true); c.step(n_mine - 1, false);
//     c.skip_rest(); c.before_epilogue<WG_EPILOGUE>();
// The statements and their order are those of the kernel measured on the H200 (identical SASS).
// Its registers (O, S, P, the softmax state) are the caller's locals, held here by reference like
// the block's values: as members of this struct they changed ptxas's output (every kernel's SASS,
// one more or fewer 128-byte block, 2 registers fewer in the d=64 band kernel).
#pragma once
#include "common.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "wgmma.cuh"
#include "hopper/fwd_traits.cuh"
#include "hopper/fwd_smem.cuh"
#include "hopper/fwd_producer.cuh"
#include "hopper/fwd_mainloop.cuh"

// (cp.async kernels without a producer) what the math threads load themselves in each step.
struct FwdKvSource {
    const u16* gK;
    const u16* gV;
    i64 k_sn, v_sn;
    int d, tid;
};

template <typename T, typename Tr, bool CAUSAL, bool PRODUCER, bool BAND, bool TMA, bool PINGPONG, bool PERSISTENT,
          bool SPLIT, bool MOD = false>
struct FwdConsumer {
    static constexpr int HEAD_DIM = Tr::kHeadDim, BLOCK_N = Tr::kBlockN, STAGES = Tr::kStages;
    static constexpr int WARPGROUPS = Tr::kWarpgroups;
    static constexpr int kNS = BLOCK_N / 8, kNO = Tr::kHeadDimV / 8;  // S's and O's accumulator blocks
    static constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    // Each math warpgroup stops at its own rows' last key tile (n_mine): causal only (a TMA band
    // kernel's CAUSAL is its upper limit).
    // Against cuDNN (H200): causal d=64 N=4k (192-row tiles) 0.966 -> 1.008x, d=256 N=1k/2k/4k 0.956/1.042/1.174 -> 0.987/1.060/1.190, d=192 N=1k
    // 0.89 -> 0.91, d=128 unchanged; without a mask (where only a ragged last tile's warpgroups
    // gain) d=64 / d=128 lost 1-3.5% to the loop's extra register moves.
    static constexpr bool kWgExtent = TMA && !SPLIT && CAUSAL;
    // d=256: rows keep a stale max within 2^8 (OnlineSoftmax STALE), so after the first tiles
    // O's rescale (128 FMULs per step) is skipped by whole warps (a vote on whether any of the
    // warp's rows moved its max). Against cuDNN (H200):
    // d=256 +2-4.5% in every cell (N 1k-4k, full 0.97/1.00/1.02 -> 1.01/1.04/1.06); d=128 full
    // -1.5-3%, causal within 1%; d=64 -2-5%: where O is small the vote and the branch cost more.
    // (d=192 not measured: off.) Not with e4m3 P: its spec is P <= 1 (cuflash.fp8.emulate_attention),
    // where a row's largest key has P = 1 exactly; P up to 2^8 rounds that key too (2.4x the
    // largest error of o in one emulated case).
    static constexpr bool kStale = HEAD_DIM >= 256 && !Tr::kFp8;
    // e4m3: O's rescale skipped by whole warps when none of the warp's rows moved its max (exact:
    // alpha is then 1), without the stale max (P stays <= 1). The e4m3 tile's softmax is as long as
    // its GEMMs (docs/performance.md#fp8-e4m3), so the 64 or 128 FMULs a step it saves count more
    // than the vote and the branch.
    static constexpr bool kLazy = kStale || Tr::kFp8;
    // (warp-specialized) Where P_j V_j's wgmma retires. Written after the softmax of tile j+1,
    // ptxas schedules that wait near the top of its basic block, i.e. before the softmax (SASS:
    // DEPBAR.LE gsb0 0 before the first MUFU.EX2), and the softmax never overlaps P_j V_j.
    // kWaitAtStart retires it at the next step's start (a block of its own), which restores the
    // overlap. Against cuDNN (H200): d=256 +0.3-4.7%,
    // d=128 causal persistent (N 2k-4k) +1-1.5%; but d=128 otherwise -2.5-5% and d=64
    // (ping-pong) -1-9%: where the other warpgroup already fills the tensor cores during the
    // softmax, overlapping it with its own P V only slows the wgmma. (The cp.async kernels keep
    // the early wait: the late one spills in the d=256 band kernel; e4m3 at d=128 keeps it too:
    // the late one read 0.91-0.97x there, docs/decisions.md.)
    static constexpr bool kWaitAtStart =
        PRODUCER && (HEAD_DIM == 256 || (HEAD_DIM == 128 && CAUSAL && PERSISTENT && !Tr::kFp8));
    // (the TMA band kernel) Keys count from vt's 32-key group of the sequence's first key, k_first.
    static constexpr bool kKeyFloor = TMA && BAND;

    // The warpgroup's registers (the caller's).
    float (&acc_o)[1][kNO][4];
    float (&acc_s)[1][kNS][4];
    u32 (&p_frag)[Tr::kPvSteps][4];
    OnlineSoftmax<2>& softmax;
    float (&alpha)[2];
    bool& moved;

    // The block's values, read where they are used (as the kernel's lambdas did).
    const FwdSmem<Tr, PERSISTENT>& sm;
    const FwdKvSource& src;
    const int &kv0, &m0, &wg, &warp, &lane, &nk_b, &hi, &lo, &n_tiles, &k_first;
    const u32& q_phase;
    const float& scale_log2;
    const ScoreMod& mod;  // (MOD) softcap and ALiBi of this (batch entry, head)
    int row0;    // this thread's first row in the tile
    u32 q_rows;  // this warpgroup's rows of each column block
    const FwdTurns<WARPGROUPS> turns;
    int n_mine;  // the key tiles this warpgroup computes (the rest: kWgExtent)

    // kv0: the ring's count of this tile's first key tile (across a persistent block's tiles),
    // q_phase: Q's parity; k_first: (kKeyFloor) the first key of the sequence.
    __device__ __forceinline__ FwdConsumer(float (&acc_o_)[1][kNO][4], float (&acc_s_)[1][kNS][4],
                                           u32 (&p_frag_)[Tr::kPvSteps][4], OnlineSoftmax<2>& softmax_,
                                           float (&alpha_)[2], bool& moved_, const FwdSmem<Tr, PERSISTENT>& sm_,
                                           const FwdKvSource& src_, const int& kv0_, const u32& q_phase_,
                                           const int& m0_, const int& rows_valid, const int& wg_, const int& warp_,
                                           const int& lane_, const int& nk_b_, const int& hi_, const int& lo_,
                                           const int& n_tiles_, const float& scale_log2_, const ScoreMod& mod_,
                                           const int& k_first_)
        : acc_o(acc_o_), acc_s(acc_s_), p_frag(p_frag_), softmax(softmax_), alpha(alpha_), moved(moved_), sm(sm_),
          src(src_), kv0(kv0_), m0(m0_), wg(wg_), warp(warp_), lane(lane_), nk_b(nk_b_), hi(hi_), lo(lo_),
          n_tiles(n_tiles_), k_first(k_first_), q_phase(q_phase_), scale_log2(scale_log2_), mod(mod_), turns{wg_} {
        row0 = 64 * wg + 16 * warp + (lane >> 2);
        q_rows = sm.sQ + 64 * wg * 128;
        if constexpr (PINGPONG) turns.open(n_tiles);

        // (TMA) The key tiles this warpgroup's own rows see: under a causal mask the tile's first 64
        // rows end up to kBM - 64 keys before its last (the 192-row d=64 tile, the 80- and 96-key
        // tiles at d=256 / 192), and a warpgroup whose rows all lie past nq sees none. It computes
        // n_mine tiles and only takes its turns and releases its ring slots for the rest, leaving
        // the tensor cores to the other warpgroups.
        n_mine = n_tiles;
        if constexpr (kWgExtent) {
            const int wg_rows = min(64, rows_valid - 64 * wg);
            int wg_end = nk_b;
            if constexpr (kHi) wg_end = max(0, min(nk_b, (BAND ? 0 : m0) + 64 * wg + wg_rows + hi));
            n_mine = wg_rows > 0 ? min(n_tiles, (wg_end + BLOCK_N - 1) / BLOCK_N) : 0;
            // A warp-uniform loop bound for ptxas: derived from threadIdx, it kept the ring's
            // counters and barrier addresses in per-thread registers and every forward 5-10% slower
            // (H200).
            n_mine = warp_uniform(n_mine);
        }
    }

    __device__ __forceinline__ void rescale_o() {
        if (!kLazy || __any_sync(0xffffffffu, moved)) softmax.rescale(acc_o, alpha);
    }
    // The GEMMs of key tile j (the ring's count kv0 + j), its mask and P (hopper/fwd_mainloop.cuh).
    __device__ __forceinline__ void issue_qk(int j) {
        fwd_issue_qk<T, Tr>(acc_s[0], q_rows, sm.k_slot((kv0 + j) % STAGES));
    }
    __device__ __forceinline__ void issue_pv(int j) {
        fwd_issue_pv<T, Tr>(acc_o[0], p_frag, sm.v_slot((kv0 + j) % STAGES));
    }
    // (MOD) the modifiers first: softcap before the mask, so a masked key stays -inf.
    __device__ __forceinline__ void mask(int j) {
        if constexpr (MOD) mod.template apply_rows<kNS>(acc_s[0], m0 + row0, j * BLOCK_N, lane);
        fwd_mask_tile<BLOCK_N, kHi, BAND, kKeyFloor>(acc_s[0], j * BLOCK_N, BAND ? 0 : m0, wg, warp, row0, nk_b, hi, lo,
                                                     lane, k_first);
    }
    __device__ __forceinline__ void to_p() { fwd_to_p<T, Tr>(p_frag, acc_s[0]); }
    __device__ __forceinline__ void retire_pv() {
        wgmma_wait<0>();
        fence_regs(acc_o[0]);
        fence_regs(p_frag);
    }

    // S_0 and its probabilities before the loop (O is still zero); (ping-pong, n_mine == 0) the
    // turn of S_0, passed on.
    __device__ __forceinline__ void prologue() {
        if constexpr (PINGPONG && kWgExtent) {
            if (n_mine == 0 && n_tiles > 0) {
                turns.wait();
                turns.pass(false);
            }
        }
        if (n_mine > 0) {
            if constexpr (PRODUCER) {
                mbar_wait(sm.full_q(), q_phase);
                mbar_wait(sm.full_k(kv0 % STAGES), (kv0 / STAGES) & 1);
            } else {
                cp_async_wait<STAGES - 1>();  // group 0: Q and K_0
            }
            // cp.async copies were written through the generic proxy; wgmma reads through the async one.
            if constexpr (!TMA) fence_proxy_async();
            if constexpr (!PRODUCER) __syncthreads();
            if constexpr (PINGPONG) turns.wait();
            wgmma_fence();
            issue_qk(0);
            wgmma_commit();
            if constexpr (PINGPONG) turns.pass(false);
            wgmma_wait<0>();
            fence_regs(acc_s[0]);
            if constexpr (PRODUCER) mbar_arrive(sm.empty_k(kv0 % STAGES));
            if constexpr (PERSISTENT) {
                if (n_mine == 1) mbar_arrive(sm.empty_q());  // the tile's last read of Q
            }
            mask(0);
            moved = softmax.template probs<1, kNS, kStale>(acc_s, scale_log2, alpha);  // (O is zero: its rescale in step 0 is harmless)
            if constexpr (!kWaitAtStart) to_p();
        }
    }

    // One K/V tile. Called with a constant kNext, once in the loop and once for the last tile, so
    // that each inlined copy has one fixed sequence of wgmma groups (a branch around the next
    // tile's Q K^T makes ptxas serialize every wgmma).
    __device__ __forceinline__ void step(int j, const bool kNext) {
        const int g = kv0 + j;  // the ring's count (across a persistent block's tiles)
        if constexpr (kWaitAtStart) {
            retire_pv();  // (step 0: none in flight)
            if (j > 0) mbar_arrive(sm.empty_v((g - 1) % STAGES));
        }
        if constexpr (PRODUCER) {  // K_{j+1} and V_j have landed
            if (kNext) mbar_wait(sm.full_k((g + 1) % STAGES), ((g + 1) / STAGES) & 1);
            mbar_wait(sm.full_v(g % STAGES), (g / STAGES) & 1);
            if constexpr (!TMA) fence_proxy_async();  // TMA writes through the async proxy
        } else {
            // K_{j+1} and V_j have landed for every thread; every warpgroup is done with K_j (its
            // Q K^T retired last iteration) and V_{j-1}, whose slots the next loads reuse.
            cp_async_wait<STAGES - 2>();
            fence_proxy_async();
            __syncthreads();
            if (j + STAGES < n_tiles) fwd_load_kv<Tr, PRODUCER>(sm.sK, src.gK, src.k_sn, nk_b, src.d, j + STAGES, src.tid);
            if (j + STAGES - 1 < n_tiles)
                fwd_load_kv<Tr, PRODUCER>(sm.sV, src.gV, src.v_sn, nk_b, src.d, j + STAGES - 1, src.tid);
            cp_async_commit();
        }
        if constexpr (kWaitAtStart) {
            rescale_o();  // O onto tile j's row maxima
            to_p();
            // (keeps both before the wgmma fence below: NVVM would sink them to the wgmma that
            // reads them, past the fence, and ptxas then injects a fence of its own: C7519)
            fence_regs(acc_o[0]);
            fence_regs(p_frag);
        }
        if constexpr (PINGPONG) turns.wait();
        wgmma_fence();
        if (kNext) {
            issue_qk(j + 1);
            wgmma_commit();
        }
        issue_pv(j);
        wgmma_commit();
        if constexpr (PINGPONG) turns.pass(!kNext && (!kWgExtent || j + 1 == n_tiles));
        if (kNext) {  // softmax of tile j+1 while P_j V_j runs on the tensor cores
            wgmma_wait<1>();
            fence_regs(acc_s[0]);
            if constexpr (PRODUCER) mbar_arrive(sm.empty_k((g + 1) % STAGES));
            if constexpr (PERSISTENT) {
                if (j + 2 == n_mine) mbar_arrive(sm.empty_q());  // the tile's last read of Q
            }
            mask(j + 1);
            moved = softmax.template probs<1, kNS, kStale>(acc_s, scale_log2, alpha);
        }
        if (!kWaitAtStart || !kNext) {  // (warp-specialized: the tile's last step, before the epilogue)
            retire_pv();
            if constexpr (PRODUCER) mbar_arrive(sm.empty_v(g % STAGES));
            if (!kWaitAtStart && kNext) {
                rescale_o();
                to_p();
            }
        }
    }

    // (kWgExtent) The tiles past this warpgroup's rows: its turn passed on, each slot released once
    // its tile has landed.
    __device__ __forceinline__ void skip_rest() {
        if constexpr (kWgExtent) {
            // O is retired on every path here: else ptxas injects that wait at the first join after
            // the loop, inside the loop below, and then serializes every wgmma (C7518).
            wgmma_wait<0>();
            fence_regs(acc_o[0]);
            // (the producer refills a slot only after every release of its previous tile, so
            // waiting for "full" first keeps this release in the right phase)
            for (int j = n_mine; j < n_tiles; ++j) {
                const int g = kv0 + j, s = g % STAGES;
                const u32 parity = (g / STAGES) & 1;
                if constexpr (PINGPONG) {
                    turns.wait();
                    turns.pass(j + 1 == n_tiles);
                }
                mbar_wait(sm.full_k(s), parity);
                mbar_arrive(sm.empty_k(s));
                mbar_wait(sm.full_v(s), parity);
                mbar_arrive(sm.empty_v(s));
            }
        }
    }

    // Every copy has landed and every wgmma read of Q is done before Q's rows hold the output.
    template <bool WG_EPILOGUE>
    __device__ __forceinline__ void before_epilogue() {
        if constexpr (PRODUCER) {
            if (n_mine == 0) {
                mbar_wait(sm.full_q(), q_phase);  // Q's copies may still be landing in the rows reused below
                if constexpr (PERSISTENT) mbar_arrive(sm.empty_q());
            }
            if constexpr (WG_EPILOGUE) named_barrier(5 + wg, 128);  // this warpgroup left its O rows
            else named_barrier(1, Tr::kMathThreads);
        } else {
            cp_async_wait<0>();
            __syncthreads();
        }
    }
};
