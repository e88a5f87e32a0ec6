// Sliding-window bands and packed sequences, as every band kernel sees them (attn_fwd_band,
// attn_fwd_wgmma_band, attn_bwd_kv_band, attn_bwd_dq_band): one definition of the band's
// arguments, of where a sequence lies in the packed arrays and of its row bounds.
#pragma once
#include "common.cuh"

// Query i of a sequence sees key j iff i + lo <= j <= i + hi. lo_off and the kernel's upper offset
// (hi) are measured from the diagonal; align adds the sequence's nk - nq (its bottom-right
// diagonal); an open side arrives as +-(2^31 - 1) and clamps to nk / -nq. cu_q / cu_k: B + 1
// packed offsets (int32), or null for an ordinary batch.
struct BandArgs {
    int lo_off, align;
    const int* cu_q;
    const int* cu_k;
};
using FwdBand = BandArgs;

// (cu_q non-null) sequence b's first q / k rows in the packed arrays and its lengths.
__device__ __forceinline__ void band_packed_rows(const BandArgs& band, int b, int& q_row0, int& k_row0, int& nq_b,
                                                 int& nk_b) {
    q_row0 = band.cu_q[b];
    k_row0 = band.cu_k[b];
    nq_b = band.cu_q[b + 1] - q_row0;
    nk_b = band.cu_k[b + 1] - k_row0;
}

// A sequence's bounds (hi, lo) from the band's offsets, its lengths and the kernel's upper offset.
__device__ __forceinline__ void band_row_bounds(const BandArgs& band, int nq_b, int nk_b, int hi_off, int& hi, int& lo) {
    const i64 shift = band.align ? (i64)nk_b - nq_b : 0;
    hi = (int)min((i64)hi_off + shift, (i64)nk_b);
    lo = (int)max((i64)band.lo_off + shift, -(i64)nq_b);
}

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
            band_packed_rows(band, b, s.q_row0, s.k_row0, s.nq_b, s.nk_b);
            b = 0;
        }
    }
    return s;
}

// The band's bounds for a sequence that has rows in this block (after the early return).
template <bool BAND>
__device__ __forceinline__ void band_bounds(const FwdBand& band, BandSeq& s, int causal_off) {
    if constexpr (BAND) band_row_bounds(band, s.nq_b, s.nk_b, causal_off, s.hi, s.lo);
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

// The key tiles a tile of query rows m0 .. m0 + rows - 1 reads: [j0, j0 + n_tiles) of BLOCK_N keys.
// All keys, or up to the last row's upper limit (HI: causal or a band), and from the first row's
// lower limit (BAND): whole tiles outside are never loaded.
template <int BLOCK_N, bool HI, bool BAND>
__device__ __forceinline__ void band_key_tiles(int m0, int rows, int nk_b, int hi, int lo, int& j0, int& n_tiles) {
    int n_end = nk_b;
    if constexpr (HI) n_end = max(0, min(nk_b, m0 + rows + hi));
    j0 = 0, n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    if constexpr (BAND) {
        const int n_begin = max(0, m0 + lo);  // the first row's lowest visible key
        j0 = n_begin / BLOCK_N;
        n_tiles = n_begin < n_end ? n_tiles - j0 : 0;
    }
}

// Whether query rows row0 .. row0 + ROWS - 1 meet a boundary among keys n0 .. n0 + BLOCK_N - 1: the
// sequence's end (nk_b), (HI) a row's upper limit, (BAND) a row's lower limit. Only such tiles pay
// for the mask.
template <int BLOCK_N, int ROWS, bool HI, bool BAND>
__device__ __forceinline__ bool band_tile_needs_mask(int n0, int nk_b, int row0, int hi, int lo) {
    bool need = (n0 + BLOCK_N > nk_b) || (HI && n0 + BLOCK_N - 1 > row0 + hi);
    if constexpr (BAND) need = need || n0 < row0 + ROWS - 1 + lo;
    return need;
}
