// Split-KV decoding: a few query tokens against a long K/V cache (FlashDecoding's idea).
//
// The work is bound by reading the cache once, so parallelism comes from the keys: a block owns
// one (K/V split, K/V head, sequence) and its warps stream interleaved key tiles through private
// cp.async rings (no block barrier in the loop). All query rows that read one K/V head - the GQA
// group times the Nq new tokens - are packed into the rows of one mma tile, so the cache is read
// once per K/V head, not once per query head. Warps merge their (max, sum, O) in shared memory;
// with several splits each block writes a normalized partial O and its log-sum-exp, and
// attn_decode_combine merges the splits with the log-sum-exp rule.
#include "common.cuh"
#include "softmax.cuh"
#include "tile_load.cuh"

template <int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES>
struct DecodeTraits {
    static constexpr int kRows = 16 * ROW_TILES;  // packed (head, token) rows, zero-padded
    static constexpr int kChunks = HEAD_DIM / 8;
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kTileKV = BLOCK_N * HEAD_DIM;
    static constexpr int kRingElems = 2 * STAGES * kTileKV;  // one warp's K and V ring
    static constexpr int kSmemBytes =
        (kRows * HEAD_DIM + WARPS * kRingElems) * 2 + WARPS * kRows * 2 * 4;
    using Swz = Swizzle<HEAD_DIM>;
    static_assert((BLOCK_N * kChunks) % 32 == 0, "a warp loads its tiles evenly");
    static_assert(kRows * HEAD_DIM * 4 <= WARPS * kRingElems * 2, "the O merge buffer reuses the rings");
};

template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_decode(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            u16* __restrict__ o, float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
            const int* __restrict__ kv_lens,
            i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
            i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
            int hq, int nq, int nk, int d, int group, int bottom_right, int chunk, float scale_log2) {
    using Tr = DecodeTraits<HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES>;
    constexpr int kRows = Tr::kRows, kNS = BLOCK_N / 8, kNO = HEAD_DIM / 8, kKS = HEAD_DIM / 16;
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, n_splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u16* ring = sQ + kRows * HEAD_DIM + warp * Tr::kRingElems;  // this warp's K then V stages
    float* s_stat = reinterpret_cast<float*>(sQ + kRows * HEAD_DIM + WARPS * Tr::kRingElems);  // [WARPS][kRows][2]

    const int rows = group * nq;  // row r = (head hk*group + r / nq, token r % nq)
    const int len = kv_lens ? min(kv_lens[b], nk) : nk;
    const int off = CAUSAL ? (bottom_right ? len - nq : 0) : 0;
    const int s0 = split * chunk;
    int s1 = min(len, s0 + chunk);
    if constexpr (CAUSAL) s1 = min(s1, max(0, nq - 1 + off + 1));  // last token's limit
    const int n_keys = max(0, s1 - s0);
    const int n_tiles = (n_keys + BLOCK_N - 1) / BLOCK_N;

    // Q rows, packed and zero-padded, then into registers (reused for every key tile).
    for (int i = threadIdx.x; i < kRows * Tr::kChunks; i += Tr::kThreads) {
        const int r = i / Tr::kChunks, col = (i % Tr::kChunks) * 8;
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
        *reinterpret_cast<uint4*>(sQ + Tr::Swz::offset(r, col)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();
    const u32 sbase = smem_addr(smem);
    // Q fragments stay in registers when they are few; otherwise they are re-read from sQ.
    constexpr bool kQRegs = ROW_TILES * HEAD_DIM <= 128;
    const LaneAddr<HEAD_DIM> aQ(sbase, lane & 15, lane >> 4);
    u32 qf[kQRegs ? ROW_TILES : 1][kQRegs ? kKS : 1][4];
    if constexpr (kQRegs) {
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
            for (int kk = 0; kk < kKS; ++kk) ldmatrix_x4(qf[mi][kk], aQ.at(mi * 16, kk * 2));
    }

    const u16* gK = k + b * k_sb + hk * k_sh;
    const u16* gV = v + b * v_sb + hk * v_sh;
    // Warp w takes tiles w, w + WARPS, ... of this split.
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;
    auto load = [&](int t, int slot) {
        const int n0 = s0 + (t * WARPS + warp) * BLOCK_N;
        load_tile_rows<HEAD_DIM, BLOCK_N, 32, VEC>(ring + slot * Tr::kTileKV, gK + n0 * k_sn, k_sn, s1 - n0, d, lane);
        load_tile_rows<HEAD_DIM, BLOCK_N, 32, VEC>(ring + (STAGES + slot) * Tr::kTileKV, gV + n0 * v_sn, v_sn, s1 - n0, d, lane);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < my_tiles) load(s, s);
        cp_async_commit();
    }
    const u32 rbase = sbase + (kRows * HEAD_DIM + warp * Tr::kRingElems) * 2;
    const LaneAddr<HEAD_DIM> aK(rbase, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> aV(rbase + STAGES * Tr::kTileKV * 2, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);

    float acc_o[ROW_TILES][kNO][4];
#pragma unroll
    for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNO; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mi][ni][e] = 0.f;
    OnlineSoftmax<2 * ROW_TILES> softmax;

    for (int t = 0; t < my_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // every lane's copies of tile t are visible; everyone left tile t-1's slot
        if (t + STAGES - 1 < my_tiles) load(t + STAGES - 1, (t + STAGES - 1) % STAGES);
        cp_async_commit();
        const u32 slot = (t % STAGES) * Tr::kTileKV * 2;

        float acc_s[ROW_TILES][kNS][4];
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mi][ni][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKS; ++kk) {
            u32 a[ROW_TILES][4];
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi) {
                if constexpr (kQRegs) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mi][e] = qf[mi][kk][e];
                } else {
                    ldmatrix_x4(a[mi], aQ.at(mi * 16, kk * 2));
                }
            }
#pragma unroll
            for (int ni = 0; ni < kNS; ni += 2) {
                u32 bk[4];
                ldmatrix_x4(bk, aK.at(ni * 8, kk * 2) + slot);
#pragma unroll
                for (int mi = 0; mi < ROW_TILES; ++mi) {
                    mma_16816<T>(acc_s[mi][ni], a[mi], bk[0], bk[1]);
                    mma_16816<T>(acc_s[mi][ni + 1], a[mi], bk[2], bk[3]);
                }
            }
        }
        const int n0 = s0 + (t * WARPS + warp) * BLOCK_N;
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
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) mma_acc_times_bt<T>(acc_o, acc_s, kk, aV, kk * 16, 0, slot);
    }
    cp_async_wait<0>();

    // Merge the warps: each publishes (max, sum) per row; every warp rescales its O to the common
    // max and adds it into a float buffer that reuses the (now idle) K/V rings.
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r2 = 0; r2 < 2 * ROW_TILES; ++r2) {
        const float sum = quad_sum(softmax.l[r2]);
        if ((lane & 3) == 0) {
            const int r = (r2 / 2) * 16 + (lane >> 2) + 8 * (r2 % 2);
            s_stat[(warp * kRows + r) * 2] = softmax.m[r2];
            s_stat[(warp * kRows + r) * 2 + 1] = sum;
        }
    }
    __syncthreads();  // statistics visible; every warp is past its loop, so the rings are free
    float* sO = reinterpret_cast<float*>(sQ + kRows * HEAD_DIM);
    for (int i = threadIdx.x; i < kRows * HEAD_DIM; i += Tr::kThreads) sO[i] = 0.f;
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = mi * 16 + (lane >> 2) + 8 * hf;
            float mx = -INFINITY;
            for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, s_stat[(w * kRows + r) * 2]);
            const float mine = softmax.m[2 * mi + hf];
            const float f = mine == -INFINITY ? 0.f : fast_exp2((mine - mx) * scale_log2);
#pragma unroll
            for (int ni = 0; ni < kNO; ++ni)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    atomicAdd(&sO[r * HEAD_DIM + ni * 8 + 2 * (lane & 3) + e], acc_o[mi][ni][2 * hf + e] * f);
        }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * HEAD_DIM; i += Tr::kThreads) {
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
            const i64 prow = (((i64)b * gridDim.y + hk) * n_splits + split) * rows + r;
            part_o[prow * d + c] = val;
            if (c == 0) part_lse[prow] = row_lse;
        }
    }
}

// Merge the splits of one (row, K/V head, sequence): O = sum_s w_s O_s / sum_s w_s, w_s = exp(lse_s - max).
// Partial O rows are d floats apart (no head-dim padding in the workspace).
template <typename T, int HEAD_DIM>
__global__ void attn_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                    u16* __restrict__ o, float* __restrict__ lse,
                                    i64 o_sb, i64 o_sh, i64 o_sn, int hq, int hkv, int nq, int group, int d, int n_splits) {
    const int r = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int rows = group * nq;
    const i64 base = (((i64)b * hkv + hk) * n_splits) * rows + r;
    float mx = -INFINITY;
    for (int s = 0; s < n_splits; ++s) mx = fmaxf(mx, part_lse[base + (i64)s * rows]);
    float wsum = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        const float l = part_lse[base + (i64)s * rows];
        if (l != -INFINITY) wsum += __expf(l - mx);
    }
    const int h = hk * group + r / nq, tok = r % nq;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n_splits; ++s) {
            const float l = part_lse[base + (i64)s * rows];
            if (l != -INFINITY) acc += __expf(l - mx) * part_o[(base + (i64)s * rows) * d + c];
        }
        o[b * o_sb + h * o_sh + tok * o_sn + c] = from_float<T>(wsum > 0.f ? acc / wsum : 0.f);
    }
    if (threadIdx.x == 0) lse[((i64)b * hq + h) * nq + tok] = wsum > 0.f ? mx + __logf(wsum) : -INFINITY;
}
