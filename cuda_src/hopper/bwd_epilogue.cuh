// The Hopper backward's end of a unit: dK (times the softmax scale, S = scale * Q K^T) and dV
// from the math warpgroups' accumulators to global memory; rows past nk and columns past d dropped.
#pragma once
#include "hopper/bwd_dq.cuh"

// PERSISTENT or (TMA and two Q buffers hold a K/V tile): staged in shared memory and stored 16
// bytes per thread along rows, instead of 4-byte stores down the accumulator's rows. The cp.async
// kernel, where the staging spills at d = 128, and tiles whose K/V block outgrows two Q buffers
// store from registers.
template <typename Tr, bool TMA, bool PERSISTENT>
constexpr bool kBwdStagedStore = PERSISTENT || (TMA && 2 * Tr::TileQ::kBytes >= Tr::TileKV::kBytes);

template <typename T, typename Tr, bool TMA, bool WS, bool PERSISTENT, int kND>
__device__ __forceinline__ void bwd_store_dkdv(const float (&acc_dk)[kND][4], const float (&acc_dv)[kND][4], const BwdSmem<Tr>& sm,
                                               u16* gdk, u16* gdv, i64 dk_sn, i64 dv_sn, float scale, int keys_valid, int d, int tid,
                                               int key_row, int dkv_nb0, int lane) {
    using TileKV = typename Tr::TileKV;
    constexpr int kMathThreads = Tr::kThreads;
    if constexpr (kBwdStagedStore<Tr, TMA, PERSISTENT>) {
        // dK in the Q buffers and dV in the dO buffers: free once all math warpgroups pass the
        // barrier (every copy into them was waited for, every wgmma reading them is done).
        // PERSISTENT: in K and V's own tiles, since the producer may already be filling the Q/dO
        // ring with the next unit's tiles.
        const u32 stage_k = PERSISTENT ? sm.sK : sm.sQ, stage_v = PERSISTENT ? sm.sV : sm.sdO;
        if constexpr (WS) {
            named_barrier(1, kMathThreads);
        } else {
            bwd_dq_staged_read<Tr>(tid);  // (staged dQ) the last step's tiles read
            __syncthreads();
        }
        // (WS: the thread index read afresh, so that the compiler cannot compute the staging
        // addresses before the step loop and keep them live through it: they spilled.)
        const int etid = WS ? thread_index_volatile() : tid;
        const int erow = (Tr::kSplitD ? 0 : 64 * (etid >> 7)) + 16 * ((etid >> 5) & 3) + ((etid & 31) >> 2), equad = etid & 3;
        const int enb0 = Tr::kSplitD ? (etid >> 7) * kND : 0;  // (split head dim) the warpgroup's first column block
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int ni = 0; ni < kND; ++ni) {
                const u32 off = TileKV::offset(erow + 8 * hf, enb0 + ni) + 4 * equad;
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(stage_k + off),
                             "r"(pack2<T>(acc_dk[ni][2 * hf] * scale, acc_dk[ni][2 * hf + 1] * scale)));
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(stage_v + off), "r"(pack2<T>(acc_dv[ni][2 * hf], acc_dv[ni][2 * hf + 1])));
            }
        if constexpr (WS) named_barrier(1, kMathThreads);
        else __syncthreads();
#pragma unroll
        for (int it = 0; it < Tr::kBlockN * TileKV::kChunks / kMathThreads; ++it) {
            const int i = it * kMathThreads + etid;
            const int row = i / TileKV::kChunks, c = i % TileKV::kChunks;
            if (row < keys_valid && c * 8 < d) {
                uint4 vk, vv;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(vk.x), "=r"(vk.y), "=r"(vk.z), "=r"(vk.w) : "r"(stage_k + TileKV::offset(row, c)));
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(vv.x), "=r"(vv.y), "=r"(vv.z), "=r"(vv.w) : "r"(stage_v + TileKV::offset(row, c)));
                *reinterpret_cast<uint4*>(gdk + row * dk_sn + c * 8) = vk;
                *reinterpret_cast<uint4*>(gdv + row * dv_sn + c * 8) = vv;
            }
        }
    } else {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = key_row + 8 * hf;
            if (row >= keys_valid) continue;
#pragma unroll
            for (int ni = 0; ni < kND; ++ni) {
                const int col = (dkv_nb0 + ni) * 8 + 2 * (lane & 3);
                if (col < d) {
                    *reinterpret_cast<u32*>(gdk + row * dk_sn + col) = pack2<T>(acc_dk[ni][2 * hf] * scale, acc_dk[ni][2 * hf + 1] * scale);
                    *reinterpret_cast<u32*>(gdv + row * dv_sn + col) = pack2<T>(acc_dv[ni][2 * hf], acc_dv[ni][2 * hf + 1]);
                }
            }
        }
    }
}
