// The key order of vt, the transposed V of the e4m3 forward (hopper/fwd_fp8.cuh): within each
// group of 32 keys, position p holds key kFp8KeyOfPos(p). fp8_vt.cu writes vt in this order and
// fwd_p_to_e4m3 packs P in it; cuflash.kernels.fp8_forward.KEY_OF_POS is the same table.
#pragma once

constexpr int kFp8KeyGroup = 32;  // vt's keys are permuted (and padded) in groups of this many

// p = 4 c + i (c, i in 0..3) -> 2 c + (i & 1) + 8 (i >> 1); + 16 for p >= 16.
__host__ __device__ constexpr int kFp8KeyOfPos(int p) {
    return (p & 16) | (((p >> 2) & 3) << 1) | (p & 1) | (((p >> 1) & 1) << 3);
}

// What fwd_p_to_e4m3 relies on: positions 4 c + i hold keys 2 c + (those of c = 0), i.e. a lane's
// A positions (its c) take the accumulator columns the same lane holds.
__host__ __device__ constexpr bool fp8_keys_follow_lanes() {
    for (int half = 0; half < 32; half += 16)
        for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i)
                if (kFp8KeyOfPos(half + 4 * c + i) != kFp8KeyOfPos(half + i) + 2 * c) return false;
    return true;
}
static_assert(fp8_keys_follow_lanes(), "vt's key order must follow the accumulator's lane layout");
