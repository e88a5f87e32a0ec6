// The Hopper forward's epilogue: the normalized O of a tile staged through shared memory (Q's rows
// - with e4m3 inputs Q's and the K ring's, O's rows being twice Q's - or O's own tile when
// persistent) and stored 16 bytes per thread along rows, then the LSE; or (the persistent e4m3
// kernel, whose rings leave no room for O's tile) stored from the accumulators directly.
#pragma once
#include "hopper/fwd_traits.cuh"

// Where a tile's outputs go: O (rows of q_row0 + m0 on), the LSE (lse_heads heads per batch entry).
struct FwdOut {
    u16* o;
    float* lse;
    i64 o_sb, o_sh, o_sn;
    int nq;
    u32 lse_heads;  // (unsigned: the grid's dimension, when it is the head count)
    int d;
};

// The LSE of a thread's rows row0 and row0 + 8 (one lane of each quad stores).
__device__ __forceinline__ void fwd_store_lse(const float (&row_lse)[2], const FwdOut& out, int b, int h, int q_row,
                                              int rows_valid, int row0, int lane) {
    if ((lane & 3) == 0) {
        float* gL = out.lse + ((i64)b * out.lse_heads + h) * out.nq + q_row;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            if (row0 + 8 * hf < rows_valid) gL[row0 + 8 * hf] = row_lse[hf];
    }
}

// O from the accumulators straight to global memory, 4 bytes (two columns) per store: a warp's
// store writes 16 bytes of each of 8 rows, which L2 merges with the next block of columns'. No
// shared memory and no barrier: each warpgroup stores its rows as soon as its P V retired. q_row:
// the tile's first row; O's rows are 16-byte aligned and d a multiple of 8 (the launcher's).
template <typename T, int kNO>
__device__ __forceinline__ void fwd_store_tile_direct(const float (&acc_o)[1][kNO][4], const float (&row_lse)[2],
                                                      const FwdOut& out, int b, int h, int q_row, int rows_valid,
                                                      int row0, int lane) {
    u16* gO = out.o + b * out.o_sb + h * out.o_sh + (i64)q_row * out.o_sn;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = row0 + 8 * hf;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int di = 0; di < kNO; ++di) {
            const int col = 8 * di + 2 * (lane & 3);
            if (col < out.d)
                *reinterpret_cast<u32*>(gO + row * out.o_sn + col) = pack2<T>(acc_o[0][di][2 * hf], acc_o[0][di][2 * hf + 1]);
        }
    }
    fwd_store_lse(row_lse, out, b, h, q_row, rows_valid, row0, lane);
}

// Called by every math thread with its normalized O fragment (rows row0 and row0 + 8) and their
// log-sum-exp. WG_EPILOGUE: each math warpgroup stages and stores only its own 64 rows, behind its
// own barrier (5 + wg); else the math warpgroups (PRODUCER) or the whole block meet. BAND: packed
// sequences' first row (q_row0) re-read from cu_q here rather than kept live through the loop.
template <typename T, typename Tr, bool PRODUCER, bool WG_EPILOGUE, bool BAND, int kNO>
__device__ __forceinline__ void fwd_store_tile(const float (&acc_o)[1][kNO][4], const float (&row_lse)[2], u32 sO,
                                               const FwdOut& out, const int* cu_q, int b, int h, int q_row0, int m0,
                                               int rows_valid, int row0, int wg, int tid, int lane) {
    using TileO = typename Tr::TileO;  // (16-bit rows; e4m3 inputs: wider than Q's)
    constexpr int kMath = Tr::kMathThreads, kBM = Tr::kBlockM;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int di = 0; di < kNO; ++di) {
            const u32 addr = sO + TileO::offset(row0 + 8 * hf, di) + 4 * (lane & 3);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(acc_o[0][di][2 * hf], acc_o[0][di][2 * hf + 1])));
        }
    if constexpr (WG_EPILOGUE) named_barrier(5 + wg, 128);
    else if constexpr (PRODUCER) named_barrier(1, kMath);
    else __syncthreads();
    if constexpr (BAND) {
        if (cu_q != nullptr) q_row0 = cu_q[blockIdx.z];
    }
    u16* gO = out.o + b * out.o_sb + h * out.o_sh + (i64)(q_row0 + m0) * out.o_sn;
    // (WG_EPILOGUE: this warpgroup's rows, i counts from its first row's first chunk)
    constexpr int kStoreThreads = WG_EPILOGUE ? 128 : kMath;
#pragma unroll
    for (int it = 0; it < kBM * TileO::kChunks / kMath; ++it) {
        const int i = it * kStoreThreads + (WG_EPILOGUE ? 64 * wg * TileO::kChunks + (tid & 127) : tid);
        const int row = i / TileO::kChunks, c = i % TileO::kChunks;
        if (row < rows_valid && c * 8 < out.d) {
            uint4 val;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                         : "r"(sO + TileO::offset(row, c)));
            *reinterpret_cast<uint4*>(gO + row * out.o_sn + c * 8) = val;
        }
    }
    fwd_store_lse(row_lse, out, b, h, q_row0 + m0, rows_valid, row0, lane);
}
