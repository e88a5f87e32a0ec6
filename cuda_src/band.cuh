// Sliding-window bands and packed sequences as the forward kernels see them (attn_fwd_band,
// attn_fwd_wgmma_band): one definition of where a block's sequence lies and of its diagonal bounds.
#pragma once
#include "common.cuh"

// lo_off and the kernel's upper offset are measured from the diagonal (open sides arrive as
// +-(2^31 - 1) and are clamped here); align: from each sequence's bottom-right diagonal
// (nk_b - nq_b); cu_q / cu_k: B + 1 packed offsets, or null for an ordinary batch.
struct FwdBand {
    int lo_off, align;
    const int* cu_q;
    const int* cu_k;
};

// Sequence b's rows are q rows [q_row0, q_row0 + nq_b) and keys [k_row0, k_row0 + nk_b); row i
// sees key j iff i + lo <= j <= i + hi. Without BAND: the batch entry as given, hi = causal_off.
struct BandSeq {
    int nq_b, nk_b, hi, lo, q_row0, k_row0;
};

// Packed sequences index one batch entry, so b becomes 0 for them.
template <bool BAND>
__device__ __forceinline__ BandSeq band_sequence(const FwdBand& band, int& b, int nq, int nk, int causal_off) {
    BandSeq s{nq, nk, causal_off, 0, 0, 0};
    if constexpr (BAND) {
        if (band.cu_q != nullptr) {
            s.q_row0 = band.cu_q[b];
            s.k_row0 = band.cu_k[b];
            s.nq_b = band.cu_q[b + 1] - s.q_row0;
            s.nk_b = band.cu_k[b + 1] - s.k_row0;
            b = 0;
        }
    }
    return s;
}

// The band's bounds for a sequence that has rows in this block (after the early return).
template <bool BAND>
__device__ __forceinline__ void band_bounds(const FwdBand& band, BandSeq& s, int causal_off) {
    if constexpr (BAND) {
        const i64 shift = band.align ? (i64)s.nk_b - s.nq_b : 0;
        s.hi = (int)min((i64)causal_off + shift, (i64)s.nk_b);
        s.lo = (int)max((i64)band.lo_off + shift, -(i64)s.nq_b);
    }
}

// Score fragment rows of the forward kernels (an mma / wgmma accumulator's row `row` held by this
// lane in elements 2 hf, 2 hf + 1 of each 8-key group starting at key n0): keys past the
// sequence (nk_b), past row + hi (HI: causal or a band's right side) or before row + lo (BAND)
// set to -inf.
template <bool HI, bool BAND, int NS>
__device__ __forceinline__ void mask_score_row(float (&acc)[NS][4], int hf, int row, int n0, int nk_b, int hi, int lo,
                                               int lane) {
    const int limit = HI ? min(nk_b, row + hi + 1) : nk_b;
    const int first = BAND ? row + lo : 0;
#pragma unroll
    for (int ni = 0; ni < NS; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = n0 + ni * 8 + 2 * (lane & 3) + e;
            if (col >= limit || (BAND && col < first)) acc[ni][2 * hf + e] = -INFINITY;
        }
}
