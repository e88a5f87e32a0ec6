// Split-KV decoding: a few query tokens against a long K/V cache (FlashDecoding's idea).
//
// The work is bound by reading the cache once, so parallelism comes from the keys: a block owns
// one (K/V split, K/V head, sequence) and its warps stream interleaved key tiles through private
// cp.async rings (no block barrier in the loop). All query rows that read one K/V head - the GQA
// group times the Nq new tokens - are packed into the rows of one mma tile, so the cache is read
// once per K/V head, not once per query head (with a block table, the cache is paged). Warps merge
// their (max, sum, O) in shared memory;
// with several splits each block writes a normalized partial O and its log-sum-exp, and the last
// split of each (K/V head, sequence) to finish merges them with the log-sum-exp rule (or
// attn_decode_combine, a second kernel, does) - or, with 2, 4 or 8 splits on
// sm_90, attn_decode_cluster runs the splits of one (K/V head, sequence) as one thread-block
// cluster that merges them through distributed shared memory (no workspace, no second kernel).
// RING 3 (wide rows: MQA with many query heads) turns the block around: the block copies each
// step's keys as RING 1 does, and warp w computes rows 16w..16w+15 over all of them, FlashAttention's
// forward order - each K/V tile read once from shared memory per row tile, no warp merge at the end.
// RING 4: the same rows with FA2's copies - one K and one V buffer (STAGES 1) of twice the keys.
#include "common.cuh"
#include "softmax.cuh"
#include "tile_load.cuh"
#include "decode_common.cuh"
#include "decode_loads.cuh"
#include "decode_block.cuh"

// One block of the split-KV launch: its split's keys (decode_block.cuh's main loop of RING), then the
// block's end - decode_merge_store (CLUSTER == 0: O and LSE, or the split's partials for
// attn_decode_combine) or the cluster merge (CLUSTER splits form one cluster; part_o / part_lse unused).
// KV (kv_e4m3.cuh): KvSame, or KvE4m3 for an e4m3 cache (k and v then address bytes in pairs: their
// strides count 16-bit words) with its descales `scales`.
// MOD: score modifiers `mods` (score_mod.cuh, DecodeMods; with WINDOW's band mask).
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          int CLUSTER, bool WINDOW, int RING, typename KV = KvSame, bool MOD = false>
__device__ __forceinline__ void
attn_decode_block(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                  u16* __restrict__ o, float* __restrict__ lse, float* __restrict__ part_o,
                  float* __restrict__ part_lse, int* __restrict__ split_done, const int* __restrict__ kv_lens, const int* __restrict__ block_table,
                  i64 bt_sb, int page_shift, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                  i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                  int hq, int nq, int nk, int d, int group, int align, int chunk, float scale_log2, int band_lo,
                  int band_hi, int row_blocks, KvDescales scales = {}, const ScoreModArgs& mods = ScoreModArgs{}) {
    using Tr = DecodeTraits<HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, KV>;
    constexpr int kRows = Tr::kRows, kNO = HEAD_DIM / 8, kKvCols = Tr::kKvCols;
    constexpr bool kE4m3 = KV::kE4m3;
    static_assert(!kE4m3 || (RING <= 2 && VEC), "e4m3 K/V: the per-warp and block rings, 16-byte copies");
    const int kv_d = kE4m3 ? d / 2 : d;  // K/V columns in 16-bit words
    // RING 3 / 4: warps own row tiles (one each; warps past ROW_TILES only copy), the block ring's keys
    constexpr bool kRowSplit = RING >= 3;
    constexpr int kWarpTiles = kRowSplit ? 1 : ROW_TILES;
    static_assert(!kRowSplit || (ROW_TILES <= WARPS && CLUSTER == 0), "RING 3: a row tile per warp, no cluster merge");
    static_assert(!kRowSplit || kRows * HEAD_DIM * 4 <= Tr::kRingBytes, "RING 3: the rings hold the block's O");
    static_assert(RING == 0 || STAGES >= 2 || (RING == 4 && STAGES == 1), "the block ring keeps a step in flight");
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, n_splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u16* ring = sQ + kRows * HEAD_DIM + warp * Tr::kRingElems;  // this warp's K then V stages (RING 0)
    float* s_stat = reinterpret_cast<float*>(sQ + kRows * HEAD_DIM + WARPS * Tr::kRingElems);  // [WARPS][kRows][2]

    const DecodeSpan<CAUSAL, WINDOW> span(kv_lens, b, nk, nq, align, split, chunk, band_lo, band_hi);
    const int s0 = span.s0, s1 = span.s1;
    const int n_tiles = (max(0, s1 - s0) + BLOCK_N - 1) / BLOCK_N;

    // Row blocks: a K/V head whose packed rows exceed one tile is run as `row_blocks` blocks, each
    // `group` of its query heads (hk counts (K/V head, row block) pairs; q, o, lse and the partials
    // index by it): K/V head hk / row_blocks, read once per row block (from L2 when they run together).
    const int hkv_head = hk / row_blocks;
    const u16* gK = k + b * k_sb + hkv_head * k_sh;
    const u16* gV = v + b * v_sb + hkv_head * v_sh;
    KV kv{};
    if constexpr (kE4m3) kv.k_scale = scales.k[b * scales.sb + hkv_head * scales.sh];
    float acc_o[kWarpTiles][kNO][4];
    OnlineSoftmax<2 * kWarpTiles> softmax;
    zero_acc(acc_o);
    const int row0 = kRowSplit ? warp * 16 : 0;  // the warp's first block row
    const DecodeRowTokens<kWarpTiles, WINDOW> rows(lane, nq, row0);
    DecodeMods<kWarpTiles, MOD> mod;
    if constexpr (MOD) {
        static_assert(WINDOW, "the modifiers run with the band mask");
        // (ALiBi's rows in warp 0's row statistics, idle until the merge; filled before Q's barrier)
        mod.init(mods, reinterpret_cast<float2*>(s_stat));
        // A sink counts once per row: one warp of split 0 starts its state with it (RING 3 / 4: each
        // row's warp), as one more key without a value. Every merge after it - the warps', the
        // cluster's, the last split's, attn_decode_combine - adds states by the log-sum-exp rule, so
        // the sink reaches the row's sum and LSE once and nothing else changes (adding it at each of
        // those five ends instead would touch them all).
        if (split == 0 && (kRowSplit || warp == 0)) mod.add_sinks(softmax, mods, hk, group, nq, row0, lane);
    }
    // The K/V copies (decode_loads.cuh): RING > 0 the block ring's steps (kv_load.step; K's STAGES
    // slots then V's), RING 0 this warp's tiles (kv_load.warp_tile); a block table pages the cache.
    const int n_steps = (max(0, s1 - s0) + Tr::kStepN - 1) / Tr::kStepN;  // (RING > 0)
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;  // (RING 0)
    u16* ringK = sQ + kRows * HEAD_DIM;
    u16* ringV = ringK + STAGES * Tr::kStepTile;
    const DecodeKvLoader<kKvCols, BLOCK_N, WARPS, STAGES, VEC> kv_load{
        k, v, block_table, bt_sb, page_shift, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, b, hkv_head, s0, s1, kv_d, warp,
        lane, gK, gV, ring, ringK, ringV};
    // Q rows, packed and zero-padded, then into registers (reused for every key tile). With one row
    // tile and at most two 8-column pieces of Q per thread (d <= 128), Q's loads go out first and
    // the first K/V copies right behind them, so Q is in place when K_0 lands (block trace, H200:
    // the block's start 2.8-4.6 -> 1.3-1.8 us, the d=128 decode cells +0-2.7%). Elsewhere Q's
    // loads follow the K/V copies: held in registers across the K/V issue, they made ptxas spill
    // (d=192; d=64 with two row tiles and a window). Two row tiles at d=128 (four pieces) go first
    // too: their start 3.3-4.1 -> 2.8-3.1 us, no spills (block trace, H200, Hq=32/64 Hkv=1).
    using QPack = DecodeQPack<HEAD_DIM, ROW_TILES, Tr::kThreads>;
    constexpr bool kQFirst = (ROW_TILES == 1 && QPack::kItems <= 2) || (HEAD_DIM == 128 && QPack::kItems <= 4);
    // Q's pieces loaded all at once after the K/V issue (below) at d=128: up to 8 per thread, the
    // wide-rows blocks' 64 rows (A/B, two passes, x cuDNN: Hq=64 B=4 L=16k 0.96 -> 1.04, B=64
    // 1.51 -> 1.54, Hq=128 B=16 L=8k 1.76 -> 1.80). Not at d=64: its wide blocks' 4 pieces ran ~1%
    // slower all at once (Hq=64 B=16 L=16k 1.57 -> 1.55). All pieces' loads, then the stores: one
    // round trip (piece by piece, 4 of them: a block's start was 3.3-4.4 us with two row tiles
    // against 1.5 with one; the wide-rows blocks' 8 pieces at d=128 5.6-6.7 us, B=1 Hq=64 Hkv=1;
    // block trace, H200). One piece at a time otherwise: all of them loaded before any store
    // spilled at d=192 too.
    constexpr bool kQBatch = HEAD_DIM == 128 && QPack::kItems <= 8;
    QPack qpack;
    if constexpr (kQFirst) qpack.load(q, q_sb, q_sh, q_sn, b, hk, group, nq, d);
    decode_prefetch<RING, STAGES>(kv_load, n_steps, my_tiles);
    if constexpr (kQFirst) {
        qpack.template store<kE4m3>(sQ);
    } else if constexpr (kQBatch) {
        qpack.load(q, q_sb, q_sh, q_sn, b, hk, group, nq, d);
        qpack.template store<kE4m3>(sQ);
    } else {
        decode_pack_q<HEAD_DIM, ROW_TILES, Tr::kThreads, kE4m3>(sQ, q, q_sb, q_sh, q_sn, b, hk, group, nq, d);
    }
    if constexpr (MOD)
        mod.template fill<Tr::kThreads, kRows>(mods, b, hk, group, nq, kv_lens ? min(kv_lens[b], nk) : nk);
    __syncthreads();
    const u32 sbase = smem_addr(smem);
    DecodeQ<HEAD_DIM, kWarpTiles> qa(sbase + row0 * HEAD_DIM * 2, lane);  // (16-row offsets keep the swizzle's phase)

    if constexpr (RING == 4)
        decode_loop_fa2_rows<T, Tr, CAUSAL, WINDOW>(qa, kv_load, sbase, n_steps, s0, s1, rows, span.lo0, span.hi0, nq,
                                                    warp, lane, softmax, acc_o, scale_log2, mod);
    else if constexpr (RING > 0)
        decode_loop_block_ring<T, Tr, CAUSAL, WINDOW, RING>(qa, kv_load, sbase, n_steps, s0, s1, rows, span.lo0,
                                                            span.hi0, nq, warp, lane, softmax, acc_o, scale_log2, kv,
                                                            mod);
    else
        decode_loop_warp_ring<T, Tr, CAUSAL, WINDOW>(qa, kv_load, sbase, my_tiles, s0, s1, rows, span.lo0, span.hi0, nq,
                                                     warp, lane, softmax, acc_o, scale_log2, kv, mod);
    cp_async_wait<0>();
    if constexpr (MOD && !kRowSplit) __syncthreads();  // every warp is done with ALiBi's rows in s_stat
    if constexpr (kE4m3) {  // O = (P v8) v_descale: linear, so before the warps' and the splits' merges
        const float vs = scales.v[b * scales.sb + hkv_head * scales.sh];
#pragma unroll
        for (int mi = 0; mi < kWarpTiles; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNO; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[mi][ni][e] *= vs;
    }
    decode_block_end<T, Tr, CLUSTER, RING, kE4m3>(softmax, acc_o, smem, s_stat, warp, lane, o, lse, part_o, part_lse,
                                                   split_done, o_sb, o_sh, o_sn, b, hk, split, n_splits, hq, nq, d,
                                                   group, scale_log2);
}

#define DECODE_PARAMS                                                                                               \
    const u16 *__restrict__ q, const u16 *__restrict__ k, const u16 *__restrict__ v, u16 *__restrict__ o,           \
        float *__restrict__ lse
#define DECODE_TAIL_PARAMS                                                                                          \
    const int *__restrict__ kv_lens, const int *__restrict__ block_table, i64 bt_sb, int page_shift, i64 q_sb,      \
        i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh,         \
        i64 o_sn, int hq, int nq, int nk, int d, int group, int align, int chunk, float scale_log2, int band_lo, \
        int band_hi, int row_blocks
#define DECODE_TAIL_ARGS                                                                                            \
    kv_lens, block_table, bt_sb, page_shift, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh,      \
        o_sn, hq, nq, nk, d, group, align, chunk, scale_log2, band_lo, band_hi, row_blocks

// Grid (splits, Hkv x row_blocks, B). With splits > 1 the partials are merged either by the last split of each
// (sequence, K/V head) (split_done: a zeroed counter per pair, decode_last_split_merges) or, with
// split_done null (where the planner measured it faster: gpu_decode.last_split_merges), by
// attn_decode_combine launched next - as this kernel's programmatic dependent where it pays: its
// blocks are then resident and waiting (griddepcontrol.wait) by the time the last split ends.
// WINDOW: a sliding window (band_lo / band_hi, DecodeSpan), only the keys some token sees read.
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          bool WINDOW = false, int RING = 0>
__global__ void __launch_bounds__(WARPS * 32)
attn_decode(DECODE_PARAMS, float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ split_done,
            DECODE_TAIL_PARAMS) {
    pdl_launch_dependents();
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, 0, WINDOW, RING>(
        q, k, v, o, lse, part_o, part_lse, split_done, DECODE_TAIL_ARGS);
}

// attn_decode with an e4m3 K/V cache (kv_e4m3.cuh): k and v address the caches' bytes in pairs (their
// strides in 16-bit words), k_descale / v_descale float32 at b * ds_sb + K/V head * ds_sh.
// Its __launch_bounds__' blocks per SM (0: none given): fp16 q with 32-key tiles of d=128, left free,
// ptxas held at 168 registers (3 blocks of 128 threads per SM) and spilled 32 bytes; bf16 fits there.
template <typename T, int HEAD_DIM, int BLOCK_N>
__host__ __device__ constexpr int decode_kv8_min_blocks() {
    return !T::is_bf16 && HEAD_DIM == 128 && BLOCK_N == 32 ? 1 : 0;
}
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          bool WINDOW = false, int RING = 0>
__global__ void __launch_bounds__(WARPS * 32, decode_kv8_min_blocks<T, HEAD_DIM, BLOCK_N>())
attn_decode_kv8(DECODE_PARAMS, float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ split_done,
                DECODE_TAIL_PARAMS, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
                i64 ds_sb, i64 ds_sh) {
    pdl_launch_dependents();
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, 0, WINDOW, RING, KvE4m3>(
        q, k, v, o, lse, part_o, part_lse, split_done, DECODE_TAIL_ARGS, KvDescales{k_descale, v_descale, ds_sb, ds_sh});
}

// __launch_bounds__' blocks per SM of the modifier kernels (0: none given). Two or more row tiles per
// warp at d <= 64: left free, ptxas held some of them at 168 registers (3 blocks of 128 threads per SM)
// and spilled 8-72 bytes; with 1 they take 192-255 (174-255 where ptxas was left free and did not
// spill: 2 blocks per SM either way). Elsewhere 1 would raise d=128's 168 registers to 200 (3 blocks
// per SM down to 2).
template <int HEAD_DIM, int ROW_TILES, int RING>
__host__ __device__ constexpr int decode_mod_min_blocks() {
    return RING < 3 && ROW_TILES > 1 && HEAD_DIM <= 64 ? 1 : 0;
}

// attn_decode with score modifiers (score_mod.cuh: softcap, ALiBi, sinks; cuflash.attention's
// softcap= / alibi_slopes= / sinks= in decode shapes): the band mask's instantiation (its run-time
// bounds cover no mask, causal and windows, as attn_fwd_band_mod's do), so one kernel per tile. alibi
// is sequence * alibi_sb + query head, sinks one per query head; a zero cap_ex2 / null pointer leaves
// a modifier off.
#define DECODE_MOD_PARAMS                                                                                           \
    float cap_ex2, float cap_out, float inv_scale, const float *__restrict__ alibi, int alibi_sb,                    \
        const float *__restrict__ sinks
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool VEC, int RING = 0>
__global__ void __launch_bounds__(WARPS * 32, decode_mod_min_blocks<HEAD_DIM, ROW_TILES, RING>())
attn_decode_mod(DECODE_PARAMS, float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ split_done,
                DECODE_TAIL_PARAMS, DECODE_MOD_PARAMS) {
    pdl_launch_dependents();
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, false, VEC, 0, true, RING, KvSame, true>(
        q, k, v, o, lse, part_o, part_lse, split_done, DECODE_TAIL_ARGS, KvDescales{},
        ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, sinks});
}

#if __CUDA_ARCH__ >= 900
// Grid (CLUSTER, Hkv, B), the cluster size fixed at compile time (a plain launch then forms the
// clusters): the CLUSTER splits of one (K/V head, sequence) merge in distributed shared memory.
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          int CLUSTER, bool WINDOW = false, int RING = 0>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(WARPS * 32)
attn_decode_cluster(DECODE_PARAMS, DECODE_TAIL_PARAMS) {
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, CLUSTER, WINDOW, RING>(
        q, k, v, o, lse, nullptr, nullptr, nullptr, DECODE_TAIL_ARGS);
}
// attn_decode_cluster with an e4m3 K/V cache (as attn_decode_kv8).
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          int CLUSTER, bool WINDOW = false, int RING = 0>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(WARPS * 32)
attn_decode_cluster_kv8(DECODE_PARAMS, DECODE_TAIL_PARAMS, const float* __restrict__ k_descale,
                        const float* __restrict__ v_descale, i64 ds_sb, i64 ds_sh) {
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, CLUSTER, WINDOW, RING, KvE4m3>(
        q, k, v, o, lse, nullptr, nullptr, nullptr, DECODE_TAIL_ARGS, KvDescales{k_descale, v_descale, ds_sb, ds_sh});
}
// attn_decode_cluster with score modifiers (as attn_decode_mod).
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, bool VEC, int CLUSTER,
          int RING = 0>
__global__ void __cluster_dims__(CLUSTER, 1, 1)
__launch_bounds__(WARPS * 32, decode_mod_min_blocks<HEAD_DIM, ROW_TILES, RING>())
attn_decode_cluster_mod(DECODE_PARAMS, DECODE_TAIL_PARAMS, DECODE_MOD_PARAMS) {
    attn_decode_block<T, HEAD_DIM, ROW_TILES, BLOCK_N, WARPS, STAGES, false, VEC, CLUSTER, true, RING, KvSame, true>(
        q, k, v, o, lse, nullptr, nullptr, nullptr, DECODE_TAIL_ARGS, KvDescales{},
        ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, sinks});
}
#endif
#undef DECODE_PARAMS
#undef DECODE_MOD_PARAMS
#undef DECODE_TAIL_PARAMS
#undef DECODE_TAIL_ARGS

// Merge the splits of every (row, K/V head, sequence) (decode_combine_slices: the log-sum-exp rule
// the last split applies in attn_decode when it merges, in slices of the splits). Grid (blocks of
// kCombineThreads covering a pair's rows x HEAD_DIM / 4 column groups x decode_merge_lanes slices,
// Hkv, B), a slice of one group per thread; launched after the split kernel (or as its programmatic
// dependent: it may start early and waits for the partials with griddepcontrol.wait).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kCombineThreads) attn_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                    u16* __restrict__ o, float* __restrict__ lse,
                                    i64 o_sb, i64 o_sh, i64 o_sn, int hq, int hkv, int nq, int group, int d, int n_splits) {
    pdl_wait();
    decode_combine_slices<T, HEAD_DIM>(part_o, part_lse, o, lse, o_sb, o_sh, o_sn, blockIdx.z, blockIdx.y, hkv, n_splits,
                                       hq, nq, d, group, blockIdx.x, threadIdx.x);
}
