// The Hopper forward's shared memory: Q's tile, the K and V rings, (persistent, 16-bit) O's staging tile,
// and the mbarriers of the warp-specialized kernels.
#pragma once
#include "hopper/fwd_traits.cuh"

template <typename Tr, bool PERSISTENT>
struct FwdSmem {
    static constexpr int kStages = Tr::kStages;
    static constexpr bool kOwnO = PERSISTENT && !Tr::kFp8;  // O's staging tile of its own
    u32 sQ, sK, sV, sO, sBar;
    __device__ __forceinline__ explicit FwdSmem(const unsigned char* smem_raw) {
        sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
        sK = sQ + Tr::TileQ::kBytes;
        sV = sK + kStages * Tr::TileK::kBytes;
        // PERSISTENT: O is staged in its own tile, so that the next tile's Q can land during the
        // epilogue; (e4m3) none: O is stored from the accumulators (fwd_store_tile_direct).
        sO = kOwnO ? sV + kStages * Tr::TileV::kBytes : sQ;
        sBar = sV + kStages * Tr::TileV::kBytes + (kOwnO ? Tr::TileO::kBytes : 0);
    }
    // Ring slot s of K and V (V's slots are narrower where its head dim is: Tr::kHeadDimV).
    __device__ __forceinline__ u32 k_slot(int s) const { return sK + s * Tr::TileK::kBytes; }
    __device__ __forceinline__ u32 v_slot(int s) const { return sV + s * Tr::TileV::kBytes; }
    // mbarriers (PRODUCER): Q full, then K full, V full, K empty, V empty per stage, (PERSISTENT) Q empty.
    __device__ __forceinline__ u32 full_q() const { return sBar; }
    __device__ __forceinline__ u32 full_k(int s) const { return sBar + 8 * (1 + s); }
    __device__ __forceinline__ u32 full_v(int s) const { return sBar + 8 * (1 + kStages + s); }
    __device__ __forceinline__ u32 empty_k(int s) const { return sBar + 8 * (1 + 2 * kStages + s); }
    __device__ __forceinline__ u32 empty_v(int s) const { return sBar + 8 * (1 + 3 * kStages + s); }
    __device__ __forceinline__ u32 empty_q() const { return sBar + 8 * (1 + 4 * kStages); }  // Q's last reader is done
};
