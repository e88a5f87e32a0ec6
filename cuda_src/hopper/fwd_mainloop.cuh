// The Hopper forward's main-loop pieces, per math warpgroup: the two GEMMs of a key tile issued as
// wgmmas (S = Q K^T from shared memory, O += P V with P from registers), the mask of a tile that
// straddles a boundary, P's conversion to A fragments, and the ping-pong turns between warpgroups.
#pragma once
#include "band.cuh"
#include "hopper/fwd_traits.cuh"
#include "hopper/fwd_fp8.cuh"

// S = Q K_j^T: Tr::kQkSteps k-steps along the 128-byte rows of Q and K (K-major operands), each
// 32 bytes (16 16-bit or 32 e4m3 elements). q_rows: this warpgroup's rows of each column block of
// Q; k_tile: K_j's ring slot.
template <typename T, typename Tr, int kNS>
__device__ __forceinline__ void fwd_issue_qk(float (&acc_s)[kNS][4], u32 q_rows, u32 k_tile) {
#pragma unroll
    for (int kk = 0; kk < Tr::kQkSteps; ++kk) {
        const u32 step = (kk & 3) * 32;  // 32 bytes into the swizzle atom
        const auto da = sw128_desc(q_rows + (kk >> 2) * Tr::TileQ::kBlockBytes + step, 16, 1024);
        const auto db = sw128_desc(k_tile + (kk >> 2) * Tr::TileK::kBlockBytes + step, 16, 1024);
        if constexpr (Tr::kFp8) WgmmaE4m3<Tr::kBlockN>::ss(acc_s, da, db, kk > 0);
        else Wgmma<T, Tr::kBlockN>::ss(acc_s, da, db, kk > 0);
    }
}

// O += P V_j. 16-bit: BLOCK_N/16 k-steps down V's rows (N-major operand: 64-column blocks apart
// by one block of the tile, 8-row groups 1024 bytes apart), N = V's head dim. e4m3: BLOCK_N/32
// k-steps along vt's 128-byte rows (K-major, as K in Q K^T), a 128-key column block per 4.
template <typename T, typename Tr, int kNO, int kKSteps>
__device__ __forceinline__ void fwd_issue_pv(float (&acc_o)[kNO][4], const u32 (&p_frag)[kKSteps][4], u32 v_tile) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        if constexpr (Tr::kFp8) {
            const u32 at = v_tile + (kk >> 2) * Tr::TileV::kBlockBytes + (kk & 3) * 32;
            WgmmaE4m3<Tr::kHeadDim>::rs(acc_o, p_frag[kk], sw128_desc(at, 16, 1024), 1);
        } else {
            Wgmma<T, Tr::kHeadDimV>::rs(acc_o, p_frag[kk], sw128_desc(v_tile + kk * 16 * 128, Tr::TileV::kBlockBytes, 1024), 1);
        }
    }
}

// P (the probabilities in S's accumulators) as the A fragments of P V (e4m3: fwd_p_to_e4m3).
template <typename T, typename Tr, int kNS, int kKSteps>
__device__ __forceinline__ void fwd_to_p(u32 (&p_frag)[kKSteps][4], const float (&acc_s)[kNS][4]) {
    if constexpr (Tr::kFp8) {
        fwd_p_to_e4m3(p_frag, acc_s);
    } else {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) acc_to_a<T>(p_frag[kk], acc_s, kk);
    }
}

// Keys past the end and, under causality, after each row's diagonal (and, under a band, before
// its lower limit) get -inf. Only tiles that straddle a boundary for this warp's rows pay for it.
// m_base: the tile's first row as the bounds count rows (under a band, rows and keys count from m0
// and key tile j0); row0: this thread's first row within the tile. KEY_FLOOR (the TMA band kernel):
// keys before k_first belong to the previous packed sequence, masked in every row as well.
template <int BLOCK_N, bool kHi, bool BAND, bool KEY_FLOOR = false, int kNS>
__device__ __forceinline__ void fwd_mask_tile(float (&acc_s)[kNS][4], int n0, int m_base, int wg, int warp, int row0,
                                              int nk_b, int hi, int lo, int lane, int k_first = 0) {
    static_assert(!KEY_FLOOR || BAND, "the key floor is a band's lower limit");
    const int warp_first = m_base + 64 * wg + 16 * warp;
    bool need_mask = (n0 + BLOCK_N > nk_b) || (kHi && n0 + BLOCK_N - 1 > warp_first + hi);
    if constexpr (BAND) need_mask = need_mask || n0 < warp_first + 15 + lo;
    if constexpr (KEY_FLOOR) need_mask = need_mask || n0 < k_first;
    if (need_mask) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = m_base + row0 + 8 * hf;
            // (the row's lower limit row + lo raised to k_first)
            mask_score_row<kHi, BAND>(acc_s, hf, row, n0, nk_b, hi, KEY_FLOOR ? max(lo, k_first - row) : lo, lane);
        }
    }
}

// Ping-pong turns: warpgroup w waits on barrier 2 + w for its turn to issue GEMMs and passes it to
// the next one (round robin) through that one's barrier; each turn is a bar.sync of the waiting
// warpgroup met by a bar.arrive of the previous one (2 x 128 threads). The last warpgroup opens
// with a pass (warpgroup 0 goes first) and skips its last one, so every bar.sync meets exactly one
// bar.arrive.
template <int WARPGROUPS>
struct FwdTurns {
    static constexpr int kTurnThreads = 2 * 128;
    int wg;
    __device__ __forceinline__ void open(int n_tiles) const {
        if (wg == WARPGROUPS - 1 && n_tiles > 0) named_barrier_arrive(2, kTurnThreads);
    }
    __device__ __forceinline__ void wait() const { named_barrier(2 + wg, kTurnThreads); }
    __device__ __forceinline__ void pass(bool last) const {
        // (3 - wg for two: the spelling of the kernel measured on the H200)
        const int next = WARPGROUPS == 2 ? 3 - wg : 2 + (wg + 1) % WARPGROUPS;
        if (!(last && wg == WARPGROUPS - 1)) named_barrier_arrive(next, kTurnThreads);
    }
};
