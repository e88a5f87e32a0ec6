// What the cp.async and the TMA split-KV decode kernels share: packing the query rows of one K/V
// head into a tile, and the end of a block - merge the warps' online-softmax states, then write O
// and LSE (one split) or the split's normalized partial O and its log-sum-exp (several splits;
// attn_decode_combine merges them).
#pragma once
#include "common.cuh"
#include "softmax.cuh"

// Rows r = (head hk * group + r / nq, token r % nq) of q into sQ (Swizzle<HEAD_DIM> layout),
// zero-padded to 16 * ROW_TILES rows and HEAD_DIM columns. Element loads: q is a few hundred bytes.
template <int HEAD_DIM, int ROW_TILES, int THREADS>
__device__ __forceinline__ void decode_pack_q(u16* sQ, const u16* q, i64 q_sb, i64 q_sh, i64 q_sn, int b, int hk,
                                              int group, int nq, int d) {
    constexpr int kChunks = HEAD_DIM / 8;
    const int rows = group * nq;
    for (int i = threadIdx.x; i < 16 * ROW_TILES * kChunks; i += THREADS) {
        const int r = i / kChunks, col = (i % kChunks) * 8;
        u32 w[4] = {0u, 0u, 0u, 0u};
        if (r < rows) {
            const u16* src = q + b * q_sb + (i64)(hk * group + r / nq) * q_sh + (i64)(r % nq) * q_sn + col;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 lo = col + 2 * e < d ? src[2 * e] : 0u;
                const u32 hi = col + 2 * e + 1 < d ? src[2 * e + 1] : 0u;
                w[e] = lo | (hi << 16);
            }
        }
        *reinterpret_cast<uint4*>(sQ + Swizzle<HEAD_DIM>::offset(r, col)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The keys [s0, s1) that split `split` of sequence b reads: its chunk of the first kv_lens[b]
// keys (all nk without kv_lens), cut at the last token's causal limit; off is the causal diagonal
// (packed row r, token r % nq, sees keys j <= token + off).
template <bool CAUSAL>
struct DecodeSpan {
    int s0, s1, off;
    __device__ __forceinline__ DecodeSpan(const int* kv_lens, int b, int nk, int nq, int bottom_right, int split,
                                          int chunk) {
        const int len = kv_lens ? min(kv_lens[b], nk) : nk;
        off = CAUSAL ? (bottom_right ? len - nq : 0) : 0;
        s0 = split * chunk;
        s1 = min(len, s0 + chunk);
        if constexpr (CAUSAL) s1 = min(s1, max(0, nq - 1 + off + 1));
    }
};

// The packed Q tile's A fragments: kept in registers when they are few, else re-read from sQ
// (at shared byte address sq) for every key tile.
template <int HEAD_DIM, int ROW_TILES>
struct DecodeQ {
    static constexpr int kKS = HEAD_DIM / 16;
    static constexpr bool kRegs = ROW_TILES * HEAD_DIM <= 128;
    LaneAddr<HEAD_DIM> aQ;
    u32 frag[kRegs ? ROW_TILES : 1][kRegs ? kKS : 1][4];
    __device__ __forceinline__ DecodeQ(u32 sq, int lane) : aQ(sq, lane & 15, lane >> 4) {
        if constexpr (kRegs) {
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
                for (int kk = 0; kk < kKS; ++kk) ldmatrix_x4(frag[mi][kk], aQ.at(mi * 16, kk * 2));
        }
    }
    __device__ __forceinline__ void get(u32 (&a)[4], int mi, int kk) const {
        if constexpr (kRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = frag[mi][kk][e];
        } else {
            ldmatrix_x4(a, aQ.at(mi * 16, kk * 2));
        }
    }
};

// One warp's BLOCK_N keys starting at key n0: S = Q K^T, keys >= s1 (the split's end) and, under
// causality, past each packed row's diagonal masked to -inf, online softmax, O += P V. K and V
// come from shared memory through lane address generators (LaneAddr or Sw128LaneAddr) plus byte
// offsets k_off / v_off (the ring slot).
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, bool CAUSAL, typename AddrK, typename AddrV>
__device__ __forceinline__ void decode_tile_step(const DecodeQ<HEAD_DIM, ROW_TILES>& qa, const AddrK& aK,
                                                 const AddrV& aV, u32 k_off, u32 v_off, int n0, int s1, int off,
                                                 int nq, int lane, OnlineSoftmax<2 * ROW_TILES>& softmax,
                                                 float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4], float scale_log2) {
    constexpr int kNS = BLOCK_N / 8, kNO = HEAD_DIM / 8, kKS = HEAD_DIM / 16;
    float acc_s[ROW_TILES][kNS][4];
    zero_acc(acc_s);
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
        u32 a[ROW_TILES][4];
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi) qa.get(a[mi], mi, kk);
#pragma unroll
        for (int ni = 0; ni < kNS; ni += 2) {
            u32 bk[4];
            ldmatrix_x4(bk, aK.at(ni * 8, kk * 2) + k_off);
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi) {
                mma_16816<T>(acc_s[mi][ni], a[mi], bk[0], bk[1]);
                mma_16816<T>(acc_s[mi][ni + 1], a[mi], bk[2], bk[3]);
            }
        }
    }
    if (n0 + BLOCK_N > s1 || CAUSAL) {
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = mi * 16 + (lane >> 2) + 8 * hf;
                const int limit = CAUSAL ? min(s1, (r % nq) + off + 1) : s1;
#pragma unroll
                for (int ni = 0; ni < kNS; ++ni)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (n0 + ni * 8 + 2 * (lane & 3) + e >= limit) acc_s[mi][ni][2 * hf + e] = -INFINITY;
            }
    }
    softmax.template update<ROW_TILES, kNS, kNO>(acc_s, acc_o, scale_log2);
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) mma_acc_times_bt<T>(acc_o, acc_s, kk, aV, kk * 16, 0, v_off);
}

// Each computing warp publishes (max, sum) per packed row in s_stat [WARPS][rows16][2]; every warp
// rescales its O to the common max and adds it, in warp order, into sO (float, rows16 x HEAD_DIM),
// which reuses shared memory that is idle by now. `computes` is false for a warp with no statistics (a TMA
// producer). All THREADS threads of the block must call this.
template <typename T, int HEAD_DIM, int ROW_TILES, int WARPS, int THREADS>
__device__ __forceinline__ void decode_merge_store(const OnlineSoftmax<2 * ROW_TILES>& softmax,
                                                   const float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4], bool computes,
                                                   float* s_stat, float* sO, int warp, int lane, u16* o, float* lse,
                                                   float* part_o, float* part_lse, i64 o_sb, i64 o_sh, i64 o_sn,
                                                   int b, int hk, int hkv, int split, int n_splits, int hq, int nq,
                                                   int d, int group, float scale_log2) {
    constexpr int kRows = 16 * ROW_TILES, kNO = HEAD_DIM / 8;
    constexpr float kLn2 = 0.6931471805599453f;
    const int rows = group * nq;
    if (computes) {
#pragma unroll
        for (int r2 = 0; r2 < 2 * ROW_TILES; ++r2) {
            const float sum = quad_sum(softmax.l[r2]);
            if ((lane & 3) == 0) {
                const int r = (r2 / 2) * 16 + (lane >> 2) + 8 * (r2 % 2);
                s_stat[(warp * kRows + r) * 2] = softmax.m[r2];
                s_stat[(warp * kRows + r) * 2 + 1] = sum;
            }
        }
    }
    __syncthreads();  // statistics visible; every warp is past its loop, so the buffers are free
    // The warps add their rescaled O into sO one after another: no shared-memory atomics (float
    // atomicAdd there is a compare-and-swap loop, and all warps hit the same addresses: profiled at
    // a quarter of the small decode cells' time) and a fixed summation order.
    for (int w = 0; w < WARPS; ++w) {
        if (computes && warp == w) {
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = mi * 16 + (lane >> 2) + 8 * hf;
                    float mx = -INFINITY;
                    for (int w2 = 0; w2 < WARPS; ++w2) mx = fmaxf(mx, s_stat[(w2 * kRows + r) * 2]);
                    const float mine = softmax.m[2 * mi + hf];
                    const float f = mine == -INFINITY ? 0.f : fast_exp2((mine - mx) * scale_log2);
#pragma unroll
                    for (int ni = 0; ni < kNO; ++ni) {
                        float2* dst = reinterpret_cast<float2*>(&sO[r * HEAD_DIM + ni * 8 + 2 * (lane & 3)]);
                        float2 add = make_float2(acc_o[mi][ni][2 * hf] * f, acc_o[mi][ni][2 * hf + 1] * f);
                        if (w > 0) {
                            const float2 old = *dst;
                            add.x += old.x;
                            add.y += old.y;
                        }
                        *dst = add;
                    }
                }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < rows * HEAD_DIM; i += THREADS) {
        const int r = i / HEAD_DIM, c = i % HEAD_DIM;
        if (c >= d) continue;
        float mx = -INFINITY, sum = 0.f;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, s_stat[(w * kRows + r) * 2]);
        if (mx != -INFINITY)
            for (int w = 0; w < WARPS; ++w) {
                const float mw = s_stat[(w * kRows + r) * 2];
                if (mw != -INFINITY) sum += s_stat[(w * kRows + r) * 2 + 1] * fast_exp2((mw - mx) * scale_log2);
            }
        const float val = sum > 0.f ? sO[i] / sum : 0.f;
        const float row_lse = sum > 0.f ? (mx * scale_log2 + __log2f(sum)) * kLn2 : -INFINITY;
        const int h = hk * group + r / nq, tok = r % nq;
        if (n_splits == 1) {
            o[b * o_sb + h * o_sh + tok * o_sn + c] = from_float<T>(val);
            if (c == 0) lse[((i64)b * hq + h) * nq + tok] = row_lse;
        } else {
            const i64 prow = (((i64)b * hkv + hk) * n_splits + split) * rows + r;
            part_o[prow * d + c] = val;
            if (c == 0) part_lse[prow] = row_lse;
        }
    }
}
