// Tiled forward attention for Hopper (sm_90a): wgmma tensor cores fed from swizzled shared memory.
//
// Same algorithm and outputs as attn_fwd.cu (online base-2 softmax, O and the natural-log LSE,
// nothing N x N written); what changes is the machine: each warpgroup (4 warps) owns 64 query rows
// and issues asynchronous m64nNk16 wgmmas. S = Q K^T reads Q and K from shared memory; O += P V
// takes P from registers and V from shared memory (N-major). Within a warpgroup the next tile's
// Q K^T and this tile's P V are in flight together while the softmax of the next tile runs on
// the CUDA cores (FlashAttention-3's intra-warpgroup overlap). K and V tiles stream through two
// STAGES-deep cp.async rings: K runs one tile ahead of V because Q K^T of tile j+1 is issued
// together with P V of tile j, so K's slot frees an iteration before V's.
// PRODUCER = false: all threads load, and a block barrier per tile publishes the copies.
// PRODUCER = true (warp specialization): one more warpgroup only loads, with few registers
// (setmaxnreg), handing tiles over through mbarriers; the math warpgroups never wait for each
// other and get the registers the producer gave up.
// TMA = true (attn_fwd_wgmma_tma): the producer is one thread issuing bulk tensor copies (64-column
// boxes that land in exactly the Sw128Tile layout) completing on the "full" mbarriers; rows and
// columns past the tensor are zero-filled by the copy engine, keys past nk masked as always.
// PINGPONG (two or three math warpgroups): the warpgroups take turns, round robin, issuing their
// GEMMs (named barriers 2 .. 1 + WARPGROUPS), so one's softmax runs while another's Q K^T and P V
// keep the tensor cores busy (FlashAttention-3's inter-warpgroup schedule).
#include "common.cuh"
#include "band.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"
#include "tma.cuh"

// The tensor maps of attn_fwd_wgmma_tma (parameter space), null for the cp.async kernels.
struct FwdMaps {
    const TmaDesc* q;
    const TmaDesc* k;
    const TmaDesc* v;
};

// The key split of attn_fwd_wgmma_tma_split (full attention on a grid of fewer query tiles than
// SMs, which a block per tile would leave mostly idle): every query tile runs as `splits` key
// ranges (pieces). Pieces 0 .. splits-2 of tile t write their normalized O (float32, in
// accumulator order) and log-sum-exp to partial slot t * (splits - 1) + piece and count
// themselves in flags[t]; the last piece, launched after them, waits for that count, merges the
// partials by the log-sum-exp rule in piece order and stores O and the LSE, then zeroes flags[t]
// for the next launch on the stream.
struct FwdSplit {
    int splits;
    float* part_o;
    float* part_lse;
    unsigned* flags;
};

template <int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PRODUCER, bool TMA = false>
struct HopperFwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;     // padded head dim on chip (64 .. 256)
    static constexpr int kBlockN = BLOCK_N;       // keys per K/V tile
    static constexpr int kWarpgroups = WARPGROUPS;  // math warpgroups
    static constexpr int kMathThreads = 128 * WARPGROUPS;
    static constexpr int kThreads = kMathThreads + (PRODUCER ? 128 : 0);
    static constexpr int kLoadThreads = PRODUCER ? 128 : kThreads;
    // Registers after setmaxnreg: the producer keeps 40 (24 when one thread only issues TMA
    // copies), the math warpgroups share the rest.
    static constexpr int kProducerRegs = TMA ? 24 : 40;
    static constexpr int kMathRegs = ((65536 / 128 - kProducerRegs) / WARPGROUPS) / 8 * 8 > 240
                                         ? 240 : ((65536 / 128 - kProducerRegs) / WARPGROUPS) / 8 * 8;
    static constexpr int kBlockM = 64 * WARPGROUPS;  // wgmma's M is 64 rows per warpgroup
    static constexpr int kStages = STAGES;
    // (causal, one tile per block) launch order: longest first within groups of this many (head,
    // batch) pairs (lpt_head_groups), as the backward's HopperBwdTraits::kLptHeads.
    static constexpr int kLptHeads = 4;
    using TileQ = Sw128Tile<HEAD_DIM, kBlockM>;
    using TileKV = Sw128Tile<HEAD_DIM, BLOCK_N>;
    // mbarriers (PRODUCER): Q full, then K full, V full, K empty, V empty per stage.
    static constexpr int kBarriers = PRODUCER ? 1 + 4 * STAGES : 0;
    // + 1024: the dynamic shared-memory base is rounded up to the swizzle pattern's period.
    static constexpr int kSmemBytes = TileQ::kBytes + 2 * STAGES * TileKV::kBytes + 8 * kBarriers + 1024;
    static_assert(STAGES >= 2, "a K (and a V) tile in use while the next one loads");
    static_assert(!TMA || PRODUCER, "TMA copies are issued by a producer warpgroup");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 64 == 0, "whole wgmma k-steps and swizzle atoms");
};

// The key split's end of a piece (FwdSplit), called by every math thread with its normalized O
// fragment (rows row0 and row0 + 8) and their log-sum-exp. A piece before the last writes them
// and counts itself: returns true (nothing left to store). The last piece waits for the others,
// merges, and returns false with the tile's O and LSE in acc_o and row_lse.
template <int kNO, int kMath, int kBM>
__device__ __forceinline__ bool split_merge(const FwdSplit& split, int piece, int tile, int tid, int lane, int row0,
                                            float (&acc_o)[1][kNO][4], float (&row_lse)[2]) {
    const int last = split.splits - 1;
    const i64 slot0 = (i64)tile * last;
    float4* part_o = reinterpret_cast<float4*>(split.part_o);
    if (piece < last) {
        const i64 slot = slot0 + piece;
#pragma unroll
        for (int di = 0; di < kNO; ++di)  // (accumulator order: a warp's stores are 512 contiguous bytes)
            part_o[(slot * kNO + di) * kMath + tid] = make_float4(acc_o[0][di][0], acc_o[0][di][1], acc_o[0][di][2], acc_o[0][di][3]);
        if ((lane & 3) == 0) {
            split.part_lse[slot * kBM + row0] = row_lse[0];
            split.part_lse[slot * kBM + row0 + 8] = row_lse[1];
        }
        __threadfence();  // the partials are visible device-wide before the count says so
        named_barrier(1, kMath);
        if (tid == 0) atomicAdd(split.flags + tile, 1u);
        return true;
    }
    if (tid == 0) {
        unsigned seen;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(split.flags + tile) : "memory");
            if (seen >= (unsigned)last) break;
            __nanosleep(128);
        }
    }
    named_barrier(1, kMath);
    // O = sum_p w_p O_p / sum_p w_p, w_p = exp(lse_p - max); the partials are read from L2 (.cg).
    float mx[2], w[2], total[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = row_lse[hf];
        for (int p = 0; p < last; ++p) mx[hf] = fmaxf(mx[hf], __ldcg(split.part_lse + (slot0 + p) * kBM + row0 + 8 * hf));
        w[hf] = mx[hf] == -INFINITY ? 0.f : expf(row_lse[hf] - mx[hf]);
        total[hf] = 0.f;
    }
    for (int p = -1; p < last; ++p) {  // -1: this piece's own O, then the partials in piece order
        if (p >= 0) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float l = __ldcg(split.part_lse + (slot0 + p) * kBM + row0 + 8 * hf);
                w[hf] = mx[hf] == -INFINITY ? 0.f : expf(l - mx[hf]);
            }
        }
        total[0] += w[0];
        total[1] += w[1];
#pragma unroll
        for (int di = 0; di < kNO; ++di) {
            if (p < 0) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[0][di][e] *= w[e / 2];
            } else {
                const float4 v = __ldcg(part_o + ((slot0 + p) * kNO + di) * kMath + tid);
                acc_o[0][di][0] += w[0] * v.x;
                acc_o[0][di][1] += w[0] * v.y;
                acc_o[0][di][2] += w[1] * v.z;
                acc_o[0][di][3] += w[1] * v.w;
            }
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        row_lse[hf] = total[hf] > 0.f ? mx[hf] + logf(total[hf]) : -INFINITY;
        total[hf] = total[hf] > 0.f ? 1.f / total[hf] : 0.f;
    }
#pragma unroll
    for (int di = 0; di < kNO; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][di][e] *= total[e / 2];
    if (tid == 0) split.flags[tile] = 0u;  // every piece has counted itself: ready for the next launch
    return false;
}

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PRODUCER, bool BAND,
          bool TMA = false, bool PINGPONG = false, bool PERSISTENT = false, bool WG_EPILOGUE = false, bool SPLIT = false>
__device__ __forceinline__ void
attn_fwd_wgmma_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                    int nq, int nk, int d, int group, int causal_off, float scale_log2, FwdBand band,
                    FwdMaps maps = FwdMaps{nullptr, nullptr, nullptr}, int n_heads = 0, int n_batch = 0,
                    FwdSplit split = FwdSplit{1, nullptr, nullptr, nullptr}) {
    constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    static_assert(!(TMA && BAND), "packed sequences share rows in one tensor: a box would read the next one's");
    static_assert(!PINGPONG || (WARPGROUPS >= 2 && WARPGROUPS <= 3 && PRODUCER), "ping-pong takes turns between 2 or 3 math warpgroups");
    static_assert(!PERSISTENT || (TMA && !BAND), "the persistent schedule is the TMA kernel's");
    static_assert(!SPLIT || (TMA && !BAND && !CAUSAL && !PERSISTENT), "the key split: full attention, per-tile TMA kernel");
    // WG_EPILOGUE: each math warpgroup stages and stores only its own 64 rows of O, behind
    // warpgroup barriers (5 + wg), so the warpgroups never wait for each other at a tile's end
    // (persistent: under ping-pong their offset carries into the next tile). Without PERSISTENT O
    // is staged in Q's rows: a warpgroup's own rows, which only its own wgmma read.
    static_assert(!WG_EPILOGUE || (TMA && (PERSISTENT || !PINGPONG)),
                  "the per-warpgroup epilogue: TMA kernels, ping-pong only in the persistent one (turns)");
    using Tr = HopperFwdTraits<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, PRODUCER, TMA>;
    using TileQ = typename Tr::TileQ;
    using TileKV = typename Tr::TileKV;
    constexpr int kThreads = Tr::kThreads, kBM = Tr::kBlockM, kLoad = Tr::kLoadThreads, kMath = Tr::kMathThreads;
    constexpr int kNS = BLOCK_N / 8, kNO = HEAD_DIM / 8;
    // Each math warpgroup stops at its own rows' last key tile (n_mine in math()): causal only.
    // Against cuDNN (H200): causal d=64 N=4k (192-row tiles) 0.966 -> 1.008x, d=256 N=1k/2k/4k 0.956/1.042/1.174 -> 0.987/1.060/1.190, d=192 N=1k
    // 0.89 -> 0.91, d=128 unchanged; without a mask (where only a ragged last tile's warpgroups
    // gain) d=64 / d=128 lost 1-3.5% to the loop's extra register moves.
    constexpr bool kWgExtent = TMA && !SPLIT && CAUSAL;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sK = sQ + TileQ::kBytes;
    const u32 sV = sK + STAGES * TileKV::kBytes;
    // PERSISTENT: O is staged in its own tile, so that the next tile's Q can land during the epilogue.
    const u32 sO = PERSISTENT ? sV + STAGES * TileKV::kBytes : sQ;
    const u32 sBar = sV + STAGES * TileKV::kBytes + (PERSISTENT ? TileQ::kBytes : 0);
    const u32 full_q = sBar;
    auto full_k = [&](int s) { return sBar + 8 * (1 + s); };
    auto full_v = [&](int s) { return sBar + 8 * (1 + STAGES + s); };
    auto empty_k = [&](int s) { return sBar + 8 * (1 + 2 * STAGES + s); };
    auto empty_v = [&](int s) { return sBar + 8 * (1 + 3 * STAGES + s); };
    const u32 empty_q = sBar + 8 * (1 + 4 * STAGES);  // PERSISTENT: Q's last reader is done

    // Blocks with the most key tiles (the last query tiles under a causal mask) start first:
    // (causal, one tile per block) within groups of Tr::kLptHeads heads, else within each head.
    int m_block = gridDim.x - 1 - blockIdx.x;
    int h = blockIdx.y;
    int b = blockIdx.z;
    if constexpr (CAUSAL && !BAND && !PERSISTENT) {
        const LptPos pos = lpt_head_groups<Tr::kLptHeads>(gridDim.x, gridDim.y * gridDim.z, grid_linear_block());
        m_block = gridDim.x - 1 - pos.rank;
        h = pos.head % gridDim.y;
        b = pos.head / gridDim.y;
    }
    // SPLIT: block x is piece `piece` of query tile `split_tile` in the plain grid's order (query
    // tiles, heads, batch).
    int piece = -1, split_tile = -1;
    if constexpr (SPLIT) {
        const int m_count = (nq + kBM - 1) / kBM;
        split_tile = blockIdx.x / split.splits;
        piece = blockIdx.x - split_tile * split.splits;
        m_block = m_count - 1 - split_tile % m_count;
        h = (split_tile / m_count) % n_heads;
        b = split_tile / (m_count * n_heads);
    }
    int hk = h / group;
    // The warpgroup and warp indices as ptxas sees them (warp_uniform): against cuDNN (H200), read
    // from lane 0 d=64 +0-3%, d=128 causal +1.5-2%, d=256 +0.5-1%, but d=128 without a mask
    // -1.2-3.7%, which keeps them per-thread.
    constexpr bool kUniformIdx = !(HEAD_DIM == 128 && !CAUSAL);
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = kUniformIdx ? warp_uniform(tid >> 7) : tid >> 7;
    const int warp = kUniformIdx ? warp_uniform((tid >> 5) & 3) : (tid >> 5) & 3;
    int m0 = m_block * kBM;
    // Rows of this sequence: [q_row0, q_row0 + nq_b) of q, keys [k_row0, k_row0 + nk_b); the
    // plain kernel keeps nk and causal_off (its hi) as the parameters they are.
    BandSeq seq = band_sequence<BAND>(band, b, nq, nk, causal_off);
    if constexpr (BAND) {
        if (m0 >= seq.nq_b) return;  // the grid covers the longest sequence (before any barrier)
        band_bounds<BAND>(band, seq, causal_off);
    }
    int nq_b = seq.nq_b, nk_b = seq.nk_b, hi = seq.hi, lo = seq.lo;
    int q_row0 = seq.q_row0, k_row0 = seq.k_row0;
    int rows_valid = min(kBM, nq_b - m0);
    const u16* gQ = q + b * q_sb + h * q_sh + (i64)(q_row0 + m0) * q_sn;
    const u16* gK = k + b * k_sb + hk * k_sh + (i64)k_row0 * k_sn;
    const u16* gV = v + b * v_sb + hk * v_sh + (i64)k_row0 * v_sn;

    // Key tiles this block can see: up to the last valid row's upper limit and, under a band,
    // from the first row's lower limit (tiles outside are never loaded).
    int n_end = nk_b;
    if constexpr (kHi) n_end = max(0, min(nk_b, m0 + rows_valid + hi));
    int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    if constexpr (BAND) {
        const int n_begin = max(0, m0 + lo);  // the first row's lowest visible key
        const int j0 = n_begin / BLOCK_N;
        n_tiles = n_begin < n_end ? n_tiles - j0 : 0;
        // From here on keys count from key tile j0 and rows from m0 (the K/V pointers, the key
        // count and the bounds move), so the loop keeps as few values live as the plain kernel's.
        const int kb = j0 * BLOCK_N;
        gK += (i64)kb * k_sn;
        gV += (i64)kb * v_sn;
        nk_b -= kb;
        hi += m0 - kb;
        lo += m0 - kb;
    }

    // SPLIT: a piece's key tiles, [piece, piece + 1) * n_tiles / splits; keys count from its first
    // (piece_k0), so the mask of the last tile's end and the loop are the whole tile's.
    int piece_k0 = 0;
    if constexpr (SPLIT) {
        const int t0 = piece * n_tiles / split.splits, t1 = (piece + 1) * n_tiles / split.splits;
        piece_k0 = t0 * BLOCK_N;
        n_tiles = t1 - t0;
        nk_b -= piece_k0;
    }

    // PERSISTENT: gridDim.x blocks (one per SM) walk a list of work units; block c takes units
    // c, c + G, c + 2G, ... A unit is one query tile, or under a causal mask the pair (m, M-1-m),
    // heavy one first, so that every unit has about the same number of key tiles (a static
    // schedule over unequal tiles leaves blocks idle: 0.7x of the per-tile kernel at N = 16k
    // causal before pairing). A head's units are consecutive, so tiles in flight together share
    // K and V in L2. The K/V ring and the barriers' phases run on across tiles: kv0 counts the
    // key tiles of this block's earlier tiles, q_phase their parity.
    const int m_blocks = (nq + kBM - 1) / kBM;
    constexpr int unit_tiles = CAUSAL ? 2 : 1;
    const int units_per_head = (m_blocks + unit_tiles - 1) / unit_tiles;
    const int n_units = PERSISTENT ? units_per_head * n_heads * n_batch : 1;
    // Query tile k (0, 1) of unit u, -1 for none; both roles loop over u = blockIdx.x, + G, ...
    auto unit_tile = [&](int u, int k) {
        const int pair = u % units_per_head;
        if (k == 0) return m_blocks - 1 - pair;
        return CAUSAL && pair != m_blocks - 1 - pair ? pair : -1;
    };
    auto set_tile = [&](int bh, int mb) {
        m_block = mb;
        h = bh % n_heads;
        hk = h / group;
        b = bh / n_heads;
        m0 = m_block * kBM;
        rows_valid = min(kBM, nq - m0);
        n_end = nk;
        if constexpr (kHi) n_end = max(0, min(nk, m0 + rows_valid + hi));
        n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    };
    int kv0 = 0;
    u32 q_phase = 0;
    // The persistent walk, once per role (the producer's loads, the math): a macro, because NVRTC
    // compiles a generic lambda's templated call operator as host code.
#define CUFLASH_FOR_EACH_TILE(ROLE_WORK)                             \
    for (int u = blockIdx.x; u < n_units; u += gridDim.x)            \
        for (int kt = 0; kt < unit_tiles; ++kt) {                    \
            const int mb = unit_tile(u, kt);                         \
            if (mb < 0) continue;                                    \
            set_tile(u / units_per_head, mb);                        \
            ROLE_WORK;                                               \
            kv0 += n_tiles;                                          \
            q_phase ^= 1;                                            \
        }

    // ltid: this thread's index among the loading threads (all of them, or the producer's, whose
    // loops stay rolled to fit its registers).
    auto load_k = [&](int j, int ltid) {
        const int n0 = j * BLOCK_N;
        load_sw128<HEAD_DIM, BLOCK_N, kLoad, !PRODUCER>(sK + (j % STAGES) * TileKV::kBytes, gK + n0 * k_sn, k_sn, nk_b - n0, d, ltid);
    };
    auto load_v = [&](int j, int ltid) {
        const int n0 = j * BLOCK_N;
        load_sw128<HEAD_DIM, BLOCK_N, kLoad, !PRODUCER>(sV + (j % STAGES) * TileKV::kBytes, gV + n0 * v_sn, v_sn, nk_b - n0, d, ltid);
    };
    // The math warpgroups' part: everything after the tiles start arriving.
    auto math = [&]() {
        float acc_o[1][kNO][4];
    #pragma unroll
        for (int ni = 0; ni < kNO; ++ni)
    #pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][ni][e] = 0.f;
        float acc_s[1][kNS][4];
        u32 p_frag[BLOCK_N / 16][4];
        OnlineSoftmax<2> softmax;
        float alpha[2];
        // d=256: rows keep a stale max within 2^8 (OnlineSoftmax STALE), so after the first tiles
        // O's rescale (128 FMULs per step) is skipped by whole warps (a vote on whether any of the
        // warp's rows moved its max). Against cuDNN (H200):
        // d=256 +2-4.5% in every cell (N 1k-4k, full 0.97/1.00/1.02 -> 1.01/1.04/1.06); d=128 full
        // -1.5-3%, causal within 1%; d=64 -2-5%: where O is small the vote and the branch cost more.
        // (d=192 not measured: off.)
        constexpr bool kStale = HEAD_DIM >= 256;
        bool moved = true;
        auto rescale_o = [&]() {
            if (!kStale || __any_sync(0xffffffffu, moved)) softmax.rescale(acc_o, alpha);
        };

        const int row0 = 64 * wg + 16 * warp + (lane >> 2);  // this thread's first row in the tile
        const u32 q_rows = sQ + 64 * wg * 128;                // this warpgroup's rows of each column block

        // S = Q K_j^T: HEAD_DIM/16 k-steps along the 128-byte rows of Q and K (K-major operands).
        auto issue_qk = [&](int j) {
            const u32 k_tile = sK + ((kv0 + j) % STAGES) * TileKV::kBytes;
    #pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                const u32 step = (kk & 3) * 32;  // 16 elements = 32 bytes into the swizzle atom
                const auto da = sw128_desc(q_rows + (kk >> 2) * TileQ::kBlockBytes + step, 16, 1024);
                const auto db = sw128_desc(k_tile + (kk >> 2) * TileKV::kBlockBytes + step, 16, 1024);
                Wgmma<T, BLOCK_N>::ss(acc_s[0], da, db, kk > 0);
            }
        };
        // O += P V_j: BLOCK_N/16 k-steps down V's rows (N-major operand: 64-column blocks apart by
        // one block of the tile, 8-row groups 1024 bytes apart).
        auto issue_pv = [&](int j) {
            const u32 v_tile = sV + ((kv0 + j) % STAGES) * TileKV::kBytes;
    #pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                Wgmma<T, HEAD_DIM>::rs(acc_o[0], p_frag[kk], sw128_desc(v_tile + kk * 16 * 128, TileKV::kBlockBytes, 1024), 1);
        };
        // Keys past the end and, under causality, after each row's diagonal (and, under a band,
        // before its lower limit) get -inf. Only tiles that straddle a boundary for this warp's
        // rows pay for it. (Under a band, rows and keys count from m0 and key tile j0.)
        auto mask = [&](int j) {
            const int n0 = j * BLOCK_N;
            const int m_base = BAND ? 0 : m0;
            const int warp_first = m_base + 64 * wg + 16 * warp;
            bool need_mask = (n0 + BLOCK_N > nk_b) || (kHi && n0 + BLOCK_N - 1 > warp_first + hi);
            if constexpr (BAND) need_mask = need_mask || n0 < warp_first + 15 + lo;
            if (need_mask) {
    #pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    mask_score_row<kHi, BAND>(acc_s[0], hf, m_base + row0 + 8 * hf, n0, nk_b, hi, lo, lane);
            }
        };
        // Ping-pong turns: warpgroup w waits on barrier 2 + w for its turn to issue GEMMs and passes
        // it to the next one (round robin) through that one's barrier; each turn is a bar.sync of
        // the waiting warpgroup met by a bar.arrive of the previous one (2 x 128 threads). The last
        // warpgroup opens with a pass (warpgroup 0 goes first) and skips its last one, so every
        // bar.sync meets exactly one bar.arrive.
        constexpr int kTurnThreads = 2 * 128;
        auto turn_wait = [&]() { named_barrier(2 + wg, kTurnThreads); };
        auto turn_pass = [&](bool last) {
            // (3 - wg for two: the spelling of the kernel measured on the H200, same SASS as before)
            const int next = WARPGROUPS == 2 ? 3 - wg : 2 + (wg + 1) % WARPGROUPS;
            if (!(last && wg == WARPGROUPS - 1)) named_barrier_arrive(next, kTurnThreads);
        };
        if constexpr (PINGPONG) {
            if (wg == WARPGROUPS - 1 && n_tiles > 0) named_barrier_arrive(2, kTurnThreads);
        }
        auto to_p = [&]() {
    #pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) acc_to_a<T>(p_frag[kk], acc_s[0], kk);
        };

        // (warp-specialized) Where P_j V_j's wgmma retires. Written after the softmax of tile j+1,
        // ptxas schedules that wait near the top of its basic block, i.e. before the softmax (SASS:
        // DEPBAR.LE gsb0 0 before the first MUFU.EX2), and the softmax never overlaps P_j V_j.
        // kWaitAtStart retires it at the next step's start (a block of its own), which restores the
        // overlap. Against cuDNN (H200): d=256 +0.3-4.7%,
        // d=128 causal persistent (N 2k-4k) +1-1.5%; but d=128 otherwise -2.5-5% and d=64
        // (ping-pong) -1-9%: where the other warpgroup already fills the tensor cores during the
        // softmax, overlapping it with its own P V only slows the wgmma. (The cp.async kernels keep
        // the early wait: the late one spills in the d=256 band kernel.)
        constexpr bool kWaitAtStart = PRODUCER && (HEAD_DIM == 256 || (HEAD_DIM == 128 && CAUSAL && PERSISTENT));
        // (TMA) The key tiles this warpgroup's own rows see: under a causal mask the tile's first 64
        // rows end up to kBM - 64 keys before its last (the 192-row d=64 tile, the 80- and 96-key
        // tiles at d=256 / 192), and a warpgroup whose rows all lie past nq sees none. It computes
        // n_mine tiles and only takes its turns and releases its ring slots for the rest, leaving
        // the tensor cores to the other warpgroups.
        int n_mine = n_tiles;
        if constexpr (kWgExtent) {
            const int wg_rows = min(64, rows_valid - 64 * wg);
            int wg_end = nk_b;
            if constexpr (kHi) wg_end = max(0, min(nk_b, m0 + 64 * wg + wg_rows + hi));
            n_mine = wg_rows > 0 ? min(n_tiles, (wg_end + BLOCK_N - 1) / BLOCK_N) : 0;
            // A warp-uniform loop bound for ptxas: derived from threadIdx, it kept the ring's
            // counters and barrier addresses in per-thread registers and every forward 5-10% slower
            // (H200).
            n_mine = warp_uniform(n_mine);
        }
        if constexpr (PINGPONG && kWgExtent) {  // (n_mine == 0) the turn of S_0, passed on
            if (n_mine == 0 && n_tiles > 0) {
                turn_wait();
                turn_pass(false);
            }
        }
        if (n_mine > 0) {  // S_0 and its probabilities before the loop (O is still zero)
            if constexpr (PRODUCER) {
                mbar_wait(full_q, q_phase);
                mbar_wait(full_k(kv0 % STAGES), (kv0 / STAGES) & 1);
            } else {
                cp_async_wait<STAGES - 1>();  // group 0: Q and K_0
            }
            // cp.async copies were written through the generic proxy; wgmma reads through the async one.
            if constexpr (!TMA) fence_proxy_async();
            if constexpr (!PRODUCER) __syncthreads();
            if constexpr (PINGPONG) turn_wait();
            wgmma_fence();
            issue_qk(0);
            wgmma_commit();
            if constexpr (PINGPONG) turn_pass(false);
            wgmma_wait<0>();
            fence_regs(acc_s[0]);
            if constexpr (PRODUCER) mbar_arrive(empty_k(kv0 % STAGES));
            if constexpr (PERSISTENT) {
                if (n_mine == 1) mbar_arrive(empty_q);  // the tile's last read of Q
            }
            mask(0);
            moved = softmax.template probs<1, kNS, kStale>(acc_s, scale_log2, alpha);  // (O is zero: its rescale in step 0 is harmless)
            if constexpr (!kWaitAtStart) to_p();
        }
        // One K/V tile. Called with a constant kNext, once in the loop and once for the last tile, so
        // that each inlined copy has one fixed sequence of wgmma groups (a branch around the next
        // tile's Q K^T makes ptxas serialize every wgmma).
        auto retire_pv = [&]() {
            wgmma_wait<0>();
            fence_regs(acc_o[0]);
            fence_regs(p_frag);
        };
        auto step = [&](int j, const bool kNext) {
            const int g = kv0 + j;  // the ring's count (across a persistent block's tiles)
            if constexpr (kWaitAtStart) {
                retire_pv();  // (step 0: none in flight)
                if (j > 0) mbar_arrive(empty_v((g - 1) % STAGES));
            }
            if constexpr (PRODUCER) {  // K_{j+1} and V_j have landed
                if (kNext) mbar_wait(full_k((g + 1) % STAGES), ((g + 1) / STAGES) & 1);
                mbar_wait(full_v(g % STAGES), (g / STAGES) & 1);
                if constexpr (!TMA) fence_proxy_async();  // TMA writes through the async proxy
            } else {
                // K_{j+1} and V_j have landed for every thread; every warpgroup is done with K_j (its
                // Q K^T retired last iteration) and V_{j-1}, whose slots the next loads reuse.
                cp_async_wait<STAGES - 2>();
                fence_proxy_async();
                __syncthreads();
                if (j + STAGES < n_tiles) load_k(j + STAGES, tid);
                if (j + STAGES - 1 < n_tiles) load_v(j + STAGES - 1, tid);
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
            if constexpr (PINGPONG) turn_wait();
            wgmma_fence();
            if (kNext) {
                issue_qk(j + 1);
                wgmma_commit();
            }
            issue_pv(j);
            wgmma_commit();
            if constexpr (PINGPONG) turn_pass(!kNext && (!kWgExtent || j + 1 == n_tiles));
            if (kNext) {  // softmax of tile j+1 while P_j V_j runs on the tensor cores
                wgmma_wait<1>();
                fence_regs(acc_s[0]);
                if constexpr (PRODUCER) mbar_arrive(empty_k((g + 1) % STAGES));
                if constexpr (PERSISTENT) {
                    if (j + 2 == n_mine) mbar_arrive(empty_q);  // the tile's last read of Q
                }
                mask(j + 1);
                moved = softmax.template probs<1, kNS, kStale>(acc_s, scale_log2, alpha);
            }
            if (!kWaitAtStart || !kNext) {  // (warp-specialized: the tile's last step, before the epilogue)
                retire_pv();
                if constexpr (PRODUCER) mbar_arrive(empty_v(g % STAGES));
                if (!kWaitAtStart && kNext) {
                    rescale_o();
                    to_p();
                }
            }
        };
        for (int j = 0; j + 1 < n_mine; ++j) step(j, true);
        if (n_mine > 0) step(n_mine - 1, false);
        if constexpr (kWgExtent) {
            // O is retired on every path here: else ptxas injects that wait at the first join after
            // the loop, inside the loop below, and then serializes every wgmma (C7518).
            wgmma_wait<0>();
            fence_regs(acc_o[0]);
            // The tiles past this warpgroup's rows: its turn passed on, each slot released once its
            // tile has landed (the producer refills a slot only after every release of its previous
            // tile, so waiting for "full" first keeps this release in the right phase).
            for (int j = n_mine; j < n_tiles; ++j) {
                const int g = kv0 + j, s = g % STAGES;
                const u32 parity = (g / STAGES) & 1;
                if constexpr (PINGPONG) {
                    turn_wait();
                    turn_pass(j + 1 == n_tiles);
                }
                mbar_wait(full_k(s), parity);
                mbar_arrive(empty_k(s));
                mbar_wait(full_v(s), parity);
                mbar_arrive(empty_v(s));
            }
        }
        // Every copy has landed and every wgmma read of Q is done before Q's rows hold the output.
        if constexpr (PRODUCER) {
            if (n_mine == 0) {
                mbar_wait(full_q, q_phase);  // Q's copies may still be landing in the rows reused below
                if constexpr (PERSISTENT) mbar_arrive(empty_q);
            }
            if constexpr (WG_EPILOGUE) named_barrier(5 + wg, 128);  // this warpgroup left its O rows
            else named_barrier(1, kMath);
        } else {
            cp_async_wait<0>();
            __syncthreads();
        }

        float row_lse[2];
        softmax.template finalize<1, kNO>(acc_o, scale_log2, row_lse);
        if constexpr (SPLIT) {
            if (split_merge<kNO, kMath, kBM>(split, piece, split_tile, tid, lane, row0, acc_o, row_lse)) return;
        }

        // Stage O in this thread's rows of the Q tile, then store 16 bytes per thread along rows.
    #pragma unroll
        for (int hf = 0; hf < 2; ++hf)
    #pragma unroll
            for (int di = 0; di < kNO; ++di) {
                const u32 addr = sO + TileQ::offset(row0 + 8 * hf, di) + 4 * (lane & 3);
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(acc_o[0][di][2 * hf], acc_o[0][di][2 * hf + 1])));
            }
        if constexpr (WG_EPILOGUE) named_barrier(5 + wg, 128);
        else if constexpr (PRODUCER) named_barrier(1, kMath);
        else __syncthreads();
        if constexpr (BAND) {  // re-read rather than keep live through the loop (registers)
            if (band.cu_q != nullptr) q_row0 = band.cu_q[blockIdx.z];
        }
        u16* gO = o + b * o_sb + h * o_sh + (i64)(q_row0 + m0) * o_sn;
        // (WG_EPILOGUE: this warpgroup's rows, i counts from its first row's first chunk)
        constexpr int kStoreThreads = WG_EPILOGUE ? 128 : kMath;
    #pragma unroll
        for (int it = 0; it < kBM * TileQ::kChunks / kMath; ++it) {
            const int i = it * kStoreThreads + (WG_EPILOGUE ? 64 * wg * TileQ::kChunks + (tid & 127) : tid);
            const int row = i / TileQ::kChunks, c = i % TileQ::kChunks;
            if (row < rows_valid && c * 8 < d) {
                uint4 val;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                             : "r"(sO + TileQ::offset(row, c)));
                *reinterpret_cast<uint4*>(gO + row * o_sn + c * 8) = val;
            }
        }
        if ((lane & 3) == 0) {
            float* gL = lse + ((i64)b * (PERSISTENT || SPLIT ? (u32)n_heads : gridDim.y) + h) * nq + (q_row0 + m0);
    #pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                if (row0 + 8 * hf < rows_valid) gL[row0 + 8 * hf] = row_lse[hf];
        }
    };
    if constexpr (PRODUCER) {
        if (tid == 0) {
            // "full": every loading thread's cp.async arrival, or the one TMA thread's expect_tx.
            constexpr int kFull = TMA ? 1 : kLoad;
            mbar_init(full_q, kFull);
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(full_k(s), kFull);
                mbar_init(full_v(s), kFull);
                mbar_init(empty_k(s), kMath);
                mbar_init(empty_v(s), kMath);
            }
            if constexpr (PERSISTENT) mbar_init(empty_q, kMath);
            if constexpr (TMA) fence_mbar_init();
        }
        __syncthreads();  // the last block-wide barrier: the roles split here
        // One if/else per role, so that ptxas applies each branch's setmaxnreg to its code.
        if (TMA && wg == WARPGROUPS) {
            // One thread issues every copy, in the order the math warpgroups consume them (Q and
            // K_0, then K_{j+1} before V_j). Each tile is HEAD_DIM/64 boxes of 64 columns.
            setmaxnreg_dec<Tr::kProducerRegs>();
            if (tid == kMath) {
                auto issue = [&](u32 dst, const TmaDesc* map, int rows, int row0, int head, u32 bar) {
                    mbar_arrive_expect_tx(bar, (HEAD_DIM / 64) * rows * 128);
    #pragma unroll
                    for (int cb = 0; cb < HEAD_DIM / 64; ++cb)
                        tma_load_4d(dst + cb * rows * 128, map, 64 * cb, row0, head, b, bar);
                };
                auto issue_k = [&](int j) {
                    const int g = kv0 + j, s = g % STAGES;
                    mbar_wait(empty_k(s), ((g / STAGES) & 1) ^ 1);
                    issue(sK + s * TileKV::kBytes, maps.k, BLOCK_N, piece_k0 + j * BLOCK_N, hk, full_k(s));
                };
                auto tile_loads = [&]() {
                    if constexpr (PERSISTENT) {
                        // K_0 needs only its ring slot; Q waits until the previous tile's last Q K^T retired.
                        if (n_tiles > 0) issue_k(0);
                        mbar_wait(empty_q, q_phase ^ 1);
                        issue(sQ, maps.q, kBM, m0, h, full_q);
                    } else {
                        issue(sQ, maps.q, kBM, m0, h, full_q);
                        if (n_tiles > 0) issue_k(0);
                    }
                    for (int j = 0; j < n_tiles; ++j) {
                        if (j + 1 < n_tiles) issue_k(j + 1);
                        const int g = kv0 + j, s = g % STAGES;
                        mbar_wait(empty_v(s), ((g / STAGES) & 1) ^ 1);
                        issue(sV + s * TileKV::kBytes, maps.v, BLOCK_N, piece_k0 + j * BLOCK_N, hk, full_v(s));
                    }
                };
                if constexpr (PERSISTENT) {
                    CUFLASH_FOR_EACH_TILE(tile_loads())
                } else {
                    tile_loads();
                }
            }
        } else if (!TMA && wg == WARPGROUPS) {
            // Producer: fill slot j % STAGES once the math warpgroups released its previous tile
            // (the n-th refill waits for phase n-1 of "empty"; a fresh barrier passes parity 1).
            setmaxnreg_dec<Tr::kProducerRegs>();
            const int ltid = tid - kMath;
            load_sw128<HEAD_DIM, kBM, kLoad, false>(sQ, gQ, q_sn, rows_valid, d, ltid);
            cp_async_mbar_arrive(full_q);
            for (int j = 0; j < n_tiles; ++j) {
                const int s = j % STAGES;
                const u32 parity = ((j / STAGES) & 1) ^ 1;
                mbar_wait(empty_k(s), parity);
                load_k(j, ltid);
                cp_async_mbar_arrive(full_k(s));
                mbar_wait(empty_v(s), parity);
                load_v(j, ltid);
                cp_async_mbar_arrive(full_v(s));
            }
            cp_async_wait<0>();
        } else {
            setmaxnreg_inc<Tr::kMathRegs>();
            if constexpr (PERSISTENT) {
                CUFLASH_FOR_EACH_TILE(math())
            } else {
                math();
            }
        }
    } else {
        // Commit group g holds K tile g and V tile g-1 (group 0 also Q): the loop's iteration j
        // needs K_{j+1} and V_j, i.e. group j+1, and issues group j+STAGES.
        load_sw128<HEAD_DIM, kBM, kThreads>(sQ, gQ, q_sn, rows_valid, d, tid);
#pragma unroll
        for (int g = 0; g < STAGES; ++g) {
            if (g < n_tiles) load_k(g, tid);
            if (g >= 1 && g - 1 < n_tiles) load_v(g - 1, tid);
            cp_async_commit();
        }
        math();
    }
}
#undef CUFLASH_FOR_EACH_TILE

// The same kernel fed by the bulk tensor copy engine: Q, K and V as rank-4 tensor maps (d, rows,
// heads, batch) with 64 x rows boxes (Q: kBlockM rows, K/V: BLOCK_N); the pointers and strides
// of Q, K and V are the plain kernel's (unused but for a uniform launch).
#define FWD_TMA_PARAMS                                                                                          \
    const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_k,                             \
        const __grid_constant__ TmaDesc tmap_v, const u16 *__restrict__ q, const u16 *__restrict__ k,           \
        const u16 *__restrict__ v, u16 *__restrict__ o, float *__restrict__ lse, i64 q_sb, i64 q_sh, i64 q_sn, \
        i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn, int nq,      \
        int nk, int d, int group, int causal_off, float scale_log2
#define FWD_TMA_ARGS                                                                                            \
    q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, nq, nk, d, group,  \
        causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr}, FwdMaps{&tmap_q, &tmap_k, &tmap_v}
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma(FWD_TMA_PARAMS) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, false, WG_EPILOGUE>(
        FWD_TMA_ARGS);
}

// The TMA kernel as a persistent one: gridDim.x blocks, one per SM, each walking its share of the
// work units (query tiles; causal: pairs of them) of n_batch x n_heads (attn_fwd_wgmma_body's
// unit_tile). Its producer fetches the next tile's first K and its Q while the math warpgroups
// finish this tile (P V and the O store), which a fresh block per tile leaves exposed - at N = 1k
// a block has only 8 key tiles to hide them.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_persistent(FWD_TMA_PARAMS, int n_heads, int n_batch) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, true, WG_EPILOGUE>(
        FWD_TMA_ARGS, n_heads, n_batch);
}
// The key split (FwdSplit): a 1-D grid of splits x (query tiles) blocks, piece-major per tile, so
// each tile's last piece (which merges) is launched after the others. A kernel of its own: the
// piece bounds in the plain body's loop change ptxas's schedule of it (2-4% slower, measured).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_split(FWD_TMA_PARAMS, int n_heads, int splits, float* __restrict__ part_o,
                         float* __restrict__ part_lse, unsigned* __restrict__ flags) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, false, true, false, true, PINGPONG, false,
                        WG_EPILOGUE, true>(FWD_TMA_ARGS, n_heads, 0, FwdSplit{splits, part_o, part_lse, flags});
}
#undef FWD_TMA_PARAMS
#undef FWD_TMA_ARGS

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PRODUCER = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + (PRODUCER ? 128 : 0), 1)
attn_fwd_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse,
               i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
               i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
               int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, PRODUCER, false>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr});
}

// Sliding window and/or packed sequences (the arguments of attn_fwd_band): both bounds at run time
// (an open side clamps away) and per-sequence lengths. A kernel of its own so the plain kernels'
// code stays as it was. At d = 64 two blocks share an SM (the plain kernel fits 128 registers
// on its own; the band's bounds need the hint).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PRODUCER = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + (PRODUCER ? 128 : 0), HEAD_DIM <= 64 && !PRODUCER ? 2 : 1)
attn_fwd_wgmma_band(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                    int nq, int nk, int d, int group, int hi_off, float scale_log2,
                    int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, true, PRODUCER, true>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, hi_off, scale_log2, FwdBand{lo_off, align, cu_q, cu_k});
}
