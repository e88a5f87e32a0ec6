// MLA decoding (DeepSeek's latent cache): q (B, Hq, Nq, 576) against one cache of 576-wide rows per
// K/V head, v its first 512 columns. Split-KV as attn_decode: a block owns one (split, K/V head x
// row block, sequence); the packed (head, token) rows of its K/V head are the rows of the mma tiles;
// several splits write normalized partial (O, LSE) that attn_decode_combine<T, 512> merges.
//
// Why the block is built this way (H100 numbers: 3.35 TB/s, ~660 dense 16-bit TFLOP/s reachable with
// mma.sync): a key costs 576 x 2 = 1152 bytes (v read from the same row) and 2 x (576 + 512) = 2176
// flops per packed row. At Hq = 16 (16 rows) that is 30 flop/byte - memory-bound (ridge ~200); at
// Hq = 128 it is 242 flop/byte - at the ridge, so no flop may be spent twice.
//  * O is 16 rows x 512 fp32 columns per row tile = 256 registers per thread for one warp: O's
//    columns are split over the 8 warps (64 each, every row tile: 32 registers per row tile).
//    At most two row tiles (32 packed rows) per block: four (O at 128 registers) reached ptxas'
//    255 and spilled 4-12 bytes (bf16, with and without V_IN_K); more packed rows run as row blocks
//    (attn_decode's row_blocks), each reading the K/V head (from L2 when they run together).
//  * S = Q K^T (53% of the flops: 576 of 1088 per key) is computed once. Warp (row tile, quarter of
//    the head dim) multiplies its 144 columns of Q and of all 32 keys: each Q fragment feeds four
//    8-key mma tiles (four accumulator chains of 9 steps), and a tile's Q and K cross shared memory
//    about once (a warp per 8-key slice over all 576 columns reloads Q for each slice: twice the
//    bytes, one chain of 36 dependent steps). The four partial S meet in shared memory; warp (row
//    tile, 8-key slice) sums its slice, and the tile's row max, P (16-bit) and the rows' rescale
//    factors go through shared memory to the P V warps. Recomputing S in each of the 8 column-split
//    warps instead would cost 7 x 53% = 3.7x more flops: invisible at Hq = 16, but at Hq = 128 (242
//    flop/byte) it would make the kernel compute-bound at a third of the copy rate.
//  * V_IN_K (v aliases k's first 512 columns: same pointer, same strides): P V reads V from the K
//    tile in shared memory - each cache row crosses DRAM once, 1152 bytes per key instead of 2176.
//    Otherwise a V ring of the same keys is copied alongside.
//  * 32-key tiles (36.9 KB of K): with a 32-row Q tile (36.9 KB), four K stages (three in flight,
//    110 KB: enough bytes in flight for an SM's share of HBM at ~1 us latency) fit sm_90's 227 KB,
//    or two K + V stages (139 KB) when v is separate; 64-key tiles would halve the stages.
#include "common.cuh"
#include "tile_load.cuh"
#include "decode_common.cuh"

constexpr int kMlaD = 576, kMlaDv = 512;

// ROW_TILES: 16-row tiles of packed rows (1 or 2; rows past group x nq are zero and not stored).
// V_IN_K: V read from K's shared tile.
template <int ROW_TILES, bool V_IN_K>
struct MlaDecodeTraits {
    static constexpr int kRows = 16 * ROW_TILES;
    static constexpr int kWarps = 8, kThreads = kWarps * 32;
    static constexpr int kBlockN = 32;  // keys per ring stage (see the top)
    static constexpr int kStages = V_IN_K ? 4 : 2;  // (see the top)
    // S's products: warp w multiplies row tile w % ROW_TILES over head-dim part w / ROW_TILES (kDParts
    // parts of kDPartSteps 16-column steps) for all kBlockN keys; its partial S (kPartStride floats a
    // row: 8 more than the tile's 32 keys, so the warp's float2 stores of 8 rows fall on distinct banks).
    static constexpr int kDParts = 4, kDPartSteps = kMlaD / 16 / kDParts;
    static constexpr int kGemmWarps = ROW_TILES * kDParts;
    static constexpr int kGemmN8 = kBlockN / 8;  // 8-key mma tiles of a warp's partial S
    static constexpr int kPartStride = kBlockN + 8;
    // S's softmax: warp w takes row tile w % ROW_TILES, key slice w / ROW_TILES of kSliceKeys keys
    // (RT 1: four warps of 8 keys; RT 2: eight of 8).
    static constexpr int kSlices = 4;
    static constexpr int kSliceKeys = kBlockN / kSlices;
    static constexpr int kSWarps = ROW_TILES * kSlices;
    static constexpr int kSN8 = kSliceKeys / 8;  // 8-key mma tiles of a warp's S slice
    // P V's work: warp w owns O's columns [64 w, 64 w + 64) of every row tile.
    static constexpr int kOCols = kMlaDv / kWarps, kON8 = kOCols / 8;
    static constexpr int kKTile = kBlockN * kMlaD, kVTile = V_IN_K ? 0 : kBlockN * kMlaDv;  // elements
    // shared memory, in bytes: Q, the K (and V) ring, P, float statistics, then the partial S
    static constexpr int kQBytes = kRows * kMlaD * 2;
    static constexpr int kRingBytes = kStages * (kKTile + kVTile) * 2;
    static constexpr int kPBytes = kRows * kBlockN * 2;
    static constexpr int kStatFloats = 2 * kSlices * kRows + 2 * kRows;  // max and sum per slice, alpha, final max
    static constexpr int kPartFloats = kDParts * kRows * kPartStride;
    static constexpr int kSmemBytes = kQBytes + kRingBytes + kPBytes + (kStatFloats + kPartFloats) * 4;
    static_assert(ROW_TILES == 1 || ROW_TILES == 2, "O's registers: at most two row tiles (see the top)");
    static_assert(kSWarps <= kWarps && kSliceKeys % 8 == 0, "S slices cover the key tile");
    static_assert(kGemmWarps <= kWarps && kDParts * kDPartSteps * 16 == kMlaD && kBlockN % 16 == 0,
                  "the head-dim parts cover q's 576 columns; keys in 16-key ldmatrix groups");
    static_assert(kStatFloats % 2 == 0 && (kQBytes + kRingBytes + kPBytes) % 8 == 0, "float2 partials");
    static_assert(kSmemBytes <= 227 * 1024, "sm_90's shared memory per block");
};

// The block's copy of keys n0 .. n0 + 31 (zero past s1) into ring slot `slot`: K rows of 576 and,
// without V_IN_K, V rows of 512. gK / gV: the K/V head's rows (contiguous: of sequence b; paged: page
// 0's, a page k_sb / v_sb further each). Paged: each 16-key group looked up in the block table (pages
// hold a power of two >= 16 keys), half of the block per group.
template <typename Tr, bool V_IN_K>
__device__ __forceinline__ void mla_load_tile(u16* sK, u16* sV, const u16* gK, const u16* gV, const int* bt_row,
                                              int page_shift, i64 k_sb, i64 k_sn, i64 v_sb, i64 v_sn, int n0, int s1) {
    if (bt_row == nullptr) {
        load_tile_rows<kMlaD, Tr::kBlockN, Tr::kThreads, true>(sK, gK + n0 * k_sn, k_sn, s1 - n0, kMlaD, threadIdx.x);
        if constexpr (!V_IN_K)
            load_tile_rows<kMlaDv, Tr::kBlockN, Tr::kThreads, true>(sV, gV + n0 * v_sn, v_sn, s1 - n0, kMlaDv,
                                                                    threadIdx.x);
    } else {
        constexpr int kHalf = Tr::kThreads / 2;
        static_assert(Tr::kBlockN == 32, "two 16-key page groups per tile");
        const int g = threadIdx.x / kHalf, n = n0 + 16 * g;
        const i64 page = n < s1 ? bt_row[n >> page_shift] : 0;
        const int in_page = n & ((1 << page_shift) - 1);
        load_tile_rows<kMlaD, 16, kHalf, true>(sK + 16 * g * kMlaD, gK + page * k_sb + in_page * k_sn, k_sn, s1 - n,
                                               kMlaD, threadIdx.x % kHalf);
        if constexpr (!V_IN_K)
            load_tile_rows<kMlaDv, 16, kHalf, true>(sV + 16 * g * kMlaDv, gV + page * v_sb + in_page * v_sn, v_sn,
                                                    s1 - n, kMlaDv, threadIdx.x % kHalf);
    }
}

// One warp's partial S: Q's rows q_row .. q_row + 15 times the tile's keys over the head dim's
// 16-column steps step0 .. step0 + STEPS - 1. Q's A fragment by ldmatrix, K's B fragments of 16 keys
// per ldmatrix (aK16: lanes 0-15 keys 0-7, 16-31 keys 8-15; odd lane octets the step's upper 8
// columns); one accumulator chain per 8-key tile.
template <typename T, int N8, int STEPS>
__device__ __forceinline__ void mla_partial_scores(float (&s)[N8][4], const LaneAddr<kMlaD>& aQ,
                                                   const LaneAddr<kMlaD>& aK16, int q_row, int step0) {
    static_assert(N8 % 2 == 0, "16-key ldmatrix groups");
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk) {
        const int chunk = 2 * (step0 + kk);  // 8-column chunks
        u32 a[4];
        ldmatrix_x4(a, aQ.at(q_row, chunk));
#pragma unroll
        for (int jp = 0; jp < N8 / 2; ++jp) {
            u32 kb[4];
            ldmatrix_x4(kb, aK16.at(16 * jp, chunk));
            mma_16816<T>(s[2 * jp], a, kb[0], kb[1]);
            mma_16816<T>(s[2 * jp + 1], a, kb[2], kb[3]);
        }
    }
}

// Fragment-ordered float2 pairs of a 16-row partial S tile in a row-major float array (stride
// STRIDE): element (j, e) of the lane is row (lane >> 2) + 8 (e >> 1), column 8 j + 2 (lane & 3) + (e & 1).
template <int N8, int STRIDE>
__device__ __forceinline__ void mla_store_partial(float* dst, const float (&s)[N8][4], int lane) {
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(dst + ((lane >> 2) + 8 * h) * STRIDE + 8 * j + 2 * (lane & 3)) =
                make_float2(s[j][2 * h], s[j][2 * h + 1]);
}
// s = the sum of PARTS partials (PART_FLOATS apart) of the same fragment (columns col0 + 8 j).
template <int N8, int STRIDE, int PARTS, int PART_FLOATS>
__device__ __forceinline__ void mla_sum_partials(float (&s)[N8][4], const float* src, int col0, int lane) {
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float2 acc = make_float2(0.f, 0.f);
#pragma unroll
            for (int q = 0; q < PARTS; ++q) {
                const float2 x = *reinterpret_cast<const float2*>(src + q * PART_FLOATS + ((lane >> 2) + 8 * h) * STRIDE +
                                                                  col0 + 8 * j + 2 * (lane & 3));
                acc.x += x.x, acc.y += x.y;
            }
            s[j][2 * h] = acc.x, s[j][2 * h + 1] = acc.y;
        }
}

// Scores of keys at or past s1, and (CAUSAL) past a row's token + hi0, to -inf. Thread rows: the
// fragment's rows r0 (e 0, 1) and r0 + 8 (e 2, 3), of tokens r0 % nq and (r0 + 8) % nq.
template <int SN8, bool CAUSAL>
__device__ __forceinline__ void mla_mask(float (&s)[SN8][4], int key0, int s1, int r0, int nq, int hi0, int lane) {
    const int lim[2] = {CAUSAL ? r0 % nq + hi0 : 0, CAUSAL ? (r0 + 8) % nq + hi0 : 0};
#pragma unroll
    for (int j = 0; j < SN8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * j + 2 * (lane & 3) + (e & 1);
            bool out = key >= s1;
            if constexpr (CAUSAL) out = out || key > lim[e >> 1];
            if (out) s[j][e] = -INFINITY;
        }
}

template <typename T, int ROW_TILES, bool CAUSAL, bool V_IN_K>
__global__ void __launch_bounds__(256, 1)
attn_decode_mla(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
                float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
                const int* __restrict__ kv_lens, const int* __restrict__ block_table, i64 bt_sb, int page_shift,
                i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb,
                i64 o_sh, i64 o_sn, int hq, int nq, int nk, int group, int align, int chunk, float scale_log2,
                int row_blocks) {
    using Tr = MlaDecodeTraits<ROW_TILES, V_IN_K>;
    constexpr int kRows = Tr::kRows, kBN = Tr::kBlockN, kST = Tr::kStages, kSN8 = Tr::kSN8, kON8 = Tr::kON8;
    pdl_launch_dependents();
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sRing = sQ + kRows * kMlaD;  // kST slots of K, then kST of V (separate V only)
    u16* sP = sRing + kST * (Tr::kKTile + Tr::kVTile);
    float* s_max = reinterpret_cast<float*>(sP + kRows * kBN);  // [kSlices][kRows]: tile max per slice
    float* s_sum = s_max + Tr::kSlices * kRows;  // [kSlices][kRows]: final sum per slice
    float* s_alpha = s_sum + Tr::kSlices * kRows;  // [kRows]: this tile's rescale of O
    float* s_m = s_alpha + kRows;  // [kRows]: the final max
    float* s_part = s_m + kRows;  // [kDParts][kRows][kPartStride]: partial S of the tile

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, n_splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hkv = hk / row_blocks;  // (hk counts (K/V head, row block) pairs, as in attn_decode)
    const DecodeSpan<CAUSAL> span(kv_lens, b, nk, nq, align, split, chunk, 0, 0);
    const int s0 = span.s0, s1 = span.s1, hi0 = span.hi0;
    const int n_tiles = (max(0, s1 - s0) + kBN - 1) / kBN;
    auto slot_k = [&](int t) { return sRing + (t % kST) * Tr::kKTile; };
    auto slot_v = [&](int t) { return sRing + kST * Tr::kKTile + (t % kST) * Tr::kVTile; };
    const bool paged = block_table != nullptr;
    const u16* gK = k + (paged ? 0 : b * k_sb) + hkv * k_sh;
    const u16* gV = v + (paged ? 0 : b * v_sb) + hkv * v_sh;
    const int* bt_row = paged ? block_table + b * bt_sb : nullptr;
    auto load = [&](int t) {
        if (t < n_tiles)
            mla_load_tile<Tr, V_IN_K>(slot_k(t), slot_v(t), gK, gV, bt_row, page_shift, k_sb, k_sn, v_sb, v_sn,
                                      s0 + t * kBN, s1);
        cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < kST - 1; ++t) load(t);
    decode_pack_q<kMlaD, ROW_TILES, Tr::kThreads>(sQ, q, q_sb, q_sh, q_sn, b, hk, group, nq, kMlaD);

    // S's products: row tile grt, head-dim part gdp.
    const bool gemm_warp = warp < Tr::kGemmWarps;
    const int grt = warp % ROW_TILES, gdp = warp / ROW_TILES;
    // S's softmax: row tile srt, keys [sk0, sk0 + kSliceKeys) of each tile, slice ks.
    const bool s_warp = warp < Tr::kSWarps;
    const int srt = warp % ROW_TILES, ks = warp / ROW_TILES, sk0 = ks * Tr::kSliceKeys;
    const int r0 = srt * 16 + (lane >> 2);  // this thread's S rows r0, r0 + 8
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // (S warps: raw-score max, partial sum)
    float acc[ROW_TILES][kON8][4];
    zero_acc(acc);

    const u32 sbase = smem_addr(smem);
    const LaneAddr<kMlaD> aQ(sbase, lane & 15, lane >> 4);
    const LaneAddr<32> aP(smem_addr(sP), lane & 15, lane >> 4);
    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<kST - 2>();
        __syncthreads();  // tile t visible (and Q, at t = 0); every warp is past tile t-1's P V
        load(t + kST - 1);
        const u32 kslot = smem_addr(slot_k(t));
        const int key0 = s0 + t * kBN;
        if (gemm_warp) {
            float part[Tr::kGemmN8][4];
            const LaneAddr<kMlaD> aK16(kslot, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
            mla_partial_scores<T, Tr::kGemmN8, Tr::kDPartSteps>(part, aQ, aK16, grt * 16, gdp * Tr::kDPartSteps);
            mla_store_partial<Tr::kGemmN8, Tr::kPartStride>(s_part + (gdp * kRows + grt * 16) * Tr::kPartStride, part,
                                                            lane);
        }
        __syncthreads();  // the partial S of every head-dim part
        float s[kSN8][4];
        if (s_warp) {
            mla_sum_partials<kSN8, Tr::kPartStride, Tr::kDParts, kRows * Tr::kPartStride>(
                s, s_part + srt * 16 * Tr::kPartStride, sk0, lane);
            mla_mask<kSN8, CAUSAL>(s, key0 + sk0, s1, r0, nq, hi0, lane);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < kSN8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
                mx = quad_max(mx);
                if ((lane & 3) == 0) s_max[ks * kRows + r0 + 8 * h] = mx;
            }
        }
        __syncthreads();  // every slice's max
        if (s_warp) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = r0 + 8 * h;
                float m_new = m_run[h];
#pragma unroll
                for (int i = 0; i < Tr::kSlices; ++i) m_new = fmaxf(m_new, s_max[i * kRows + r]);
                const float m_use = m_new == -INFINITY ? 0.f : m_new;  // (no visible key yet: p = 0)
                const float alpha = fast_exp2((m_run[h] - m_use) * scale_log2);
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < kSN8; ++j) {
                    const float p0 = fast_exp2((s[j][2 * h] - m_use) * scale_log2);
                    const float p1 = fast_exp2((s[j][2 * h + 1] - m_use) * scale_log2);
                    sum += p0 + p1;
                    const int col = sk0 + 8 * j + 2 * (lane & 3);
                    *reinterpret_cast<u32*>(sP + Swizzle<32>::offset(r, col & ~7) + (col & 7)) = pack2<T>(p0, p1);
                }
                l_run[h] = l_run[h] * alpha + sum;
                m_run[h] = m_new;
                if (ks == 0 && (lane & 3) == 0) s_alpha[r] = alpha;
            }
        }
        __syncthreads();  // P and the rows' alpha
        // O (this warp's 64 columns, every row tile) *= alpha, += P V
#pragma unroll
        for (int rt = 0; rt < ROW_TILES; ++rt) {
            const float a0 = s_alpha[rt * 16 + (lane >> 2)], a1 = s_alpha[rt * 16 + 8 + (lane >> 2)];
#pragma unroll
            for (int j = 0; j < kON8; ++j) {
                acc[rt][j][0] *= a0, acc[rt][j][1] *= a0;
                acc[rt][j][2] *= a1, acc[rt][j][3] *= a1;
            }
        }
        constexpr int kVCols = V_IN_K ? kMlaD : kMlaDv;
        const LaneAddr<kVCols> aV(V_IN_K ? kslot : smem_addr(slot_v(t)), (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
            for (int rt = 0; rt < ROW_TILES; ++rt) {
                u32 pa[4];
                ldmatrix_x4(pa, aP.at(rt * 16, 2 * kk));
#pragma unroll
                for (int j = 0; j < kON8; j += 2) {
                    u32 vb[4];
                    ldmatrix_x4_trans(vb, aV.at(16 * kk, warp * (Tr::kOCols / 8) + j));
                    mma_16816<T>(acc[rt][j], pa, vb[0], vb[1]);
                    mma_16816<T>(acc[rt][j + 1], pa, vb[2], vb[3]);
                }
            }
    }
    cp_async_wait<0>();

    // The rows' statistics: the sum over the slices (each S warp summed its own keys), the max as
    // every S warp tracked it (the same for all slices of a row).
    if (s_warp) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float l = quad_sum(l_run[h]);
            if ((lane & 3) == 0) {
                s_sum[ks * kRows + r0 + 8 * h] = l;
                if (ks == 0) s_m[r0 + 8 * h] = m_run[h];
            }
        }
    }
    __syncthreads();
    constexpr float kLn2 = 0.6931471805599453f;
    const int rows = group * nq;
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = rt * 16 + 8 * h + (lane >> 2);
            if (r >= rows) continue;
            float l = 0.f;
#pragma unroll
            for (int i = 0; i < Tr::kSlices; ++i) l += s_sum[i * kRows + r];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const float row_lse = l > 0.f ? (s_m[r] * scale_log2 + __log2f(l)) * kLn2 : -INFINITY;
            const int head = hk * group + r / nq, tk = r % nq;
            const i64 prow = (((i64)b * gridDim.y + hk) * n_splits + split) * rows + r;
#pragma unroll
            for (int j = 0; j < kON8; ++j) {
                const int col = warp * Tr::kOCols + 8 * j + 2 * (lane & 3);
                const float x0 = acc[rt][j][2 * h] * inv, x1 = acc[rt][j][2 * h + 1] * inv;
                if (n_splits == 1)
                    *reinterpret_cast<u32*>(o + b * o_sb + head * o_sh + tk * o_sn + col) = pack2<T>(x0, x1);
                else
                    *reinterpret_cast<float2*>(part_o + prow * kMlaDv + col) = make_float2(x0, x1);
            }
            if (warp == 0 && (lane & 3) == 0) {
                if (n_splits == 1)
                    lse[((i64)b * hq + head) * nq + tk] = row_lse;
                else
                    part_lse[prow] = row_lse;
            }
        }
}
