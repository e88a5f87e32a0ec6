// The Hopper backward's work units: one K/V tile of one K/V head of one batch entry. A block does
// the unit of its grid position, or (PERSISTENT) units blockIdx.x, + gridDim.x, ... of key tiles x
// K/V heads x n_batch, key tile fastest. Every role walks the same units and counts steps across
// them, so the Q/dO ring's buffers and mbarrier phases and the dQ tiles' barriers run on.
// (Computed from the kernel's parameters where used: a value live across the role split is one
// the 24-register producer spills.)
#pragma once
#include "hopper/bwd_traits.cuh"

struct BwdUnit {
    int hk, b, n0, m_begin, per_head, n_steps;
};

template <typename Tr, bool CAUSAL, bool PERSISTENT>
struct BwdScheduler {
    static constexpr int kBlockM = Tr::kBlockM;
    BwdUnits units;
    int nq, group, causal_off;
    __device__ __forceinline__ int unit0() const { return PERSISTENT ? (int)blockIdx.x : 0; }
    __device__ __forceinline__ int n_units() const { return PERSISTENT ? units.count : 1; }
    __device__ __forceinline__ int unit_stride() const { return PERSISTENT ? (int)gridDim.x : 1; }
    __device__ __forceinline__ BwdUnit unit_at(int u) const {
        BwdUnit t;
        int n_block = blockIdx.x;
        t.hk = blockIdx.y;
        t.b = blockIdx.z;
        if constexpr (CAUSAL && !PERSISTENT) {  // key tile 0 (every query sees it) is the longest
            const LptPos pos = lpt_head_groups<Tr::kLptHeads>(gridDim.x, gridDim.y * gridDim.z, grid_linear_block());
            n_block = pos.rank;
            t.hk = pos.head % gridDim.y;
            t.b = pos.head / gridDim.y;
        }
        if constexpr (PERSISTENT) {
            n_block = u % units.kv_tiles;
            const int head_batch = u / units.kv_tiles;
            t.hk = head_batch % units.hkv;
            t.b = head_batch / units.hkv;
            // Causal: key tiles in reverse order every other head, so that a block's units (a
            // stride of about one head's worth apart) alternate long and short instead of all
            // sitting at one end of the diagonal (static round robin: up to 3x the work of others).
            if (CAUSAL && (head_batch & 1)) n_block = units.kv_tiles - 1 - n_block;
        }
        t.n0 = n_block * Tr::kBlockN;
        // Query tiles that can see any of the unit's keys: query i sees key j iff j <= i + off.
        t.m_begin = CAUSAL ? max(0, t.n0 - causal_off) / kBlockM : 0;
        t.per_head = max(0, (nq + kBlockM - 1) / kBlockM - t.m_begin);
        t.n_steps = t.per_head * group;  // (head, query tile) pairs, head-major
        return t;
    }
};

// (WS producer) every step of the block's units in order, with t (the unit), g (the block's steps
// before this one), h (query head) and m0 (first query row): (head, query tile) pairs head-major,
// h and mt advanced instead of a division per step, loops rolled (24 registers hold no unrolled
// copy). The body must not `continue`, and pragmas in it are written _Pragma (a #pragma line in
// a macro argument is dropped).
#define BWD_FOR_EACH_STEP(sched, ...)                                                             \
    {                                                                                             \
        int g = 0;                                                                                \
        _Pragma("unroll 1") for (int u = sched.unit0(); u < sched.n_units(); u += sched.unit_stride()) { \
            const BwdUnit t = sched.unit_at(u);                                                   \
            int h = t.hk * sched.group, mt = t.m_begin;                                           \
            _Pragma("unroll 1") for (int step = 0; step < t.n_steps; ++step, ++g) {               \
                const int m0 = mt * sched.kBlockM;                                                \
                __VA_ARGS__                                                                       \
                if (++mt * sched.kBlockM >= sched.nq) mt = t.m_begin, ++h;                        \
            }                                                                                     \
        }                                                                                         \
    }
