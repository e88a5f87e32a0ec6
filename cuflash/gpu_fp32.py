"""Float32 on the GPU: tile tables, specs and launches of cuda_src/attn_fwd_fp32.cu and attn_bwd_fp32.cu.

float32 inputs are computed in float64 on the FMA pipes (the float32 -> float64 conversion is
exact) and rounded to float32 once at the end. Neither TF32 tensor cores nor float32 FMA chains
meet the accuracy rule the tests hold every dtype to: at most twice the error of the naive
formula with each primitive op (each matmul included) exact and then rounded to float32. A
float32 dot product over d terms or sum over Nk keys rounds many times and lands at 1.5-4x of
that bound on random inputs; float64 leaves only the final rounding.

The 16-bit kernels' tables are in cuflash/schedule.py; this module keeps the float32 ones next
to the code that reads them, keyed by the same padded head-dim buckets
(schedule.HEAD_DIM_BUCKETS).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import schedule
from ._build import KernelSpec

_LANES = 8  # threads across the keys / head dim of one row group (the kernel's kLanes)
_PAD = 2  # doubles of padding per shared-memory row (the kernel's kLd / kLdP)


@dataclass(frozen=True)
class Fp32TileConfig:
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    threads: int  # 8 lanes x (threads / 8) row groups
    reason: str

    @property
    def rows_per_thread(self) -> int:
        return self.block_m // (self.threads // _LANES)

    def smem_bytes(self, head_dim: int) -> int:
        """float64 Q, K and V tiles (head_dim + 2 a row) and P tile (block_n + 2 a row).

        Mirrors F64Traits::kSmemBytes; the kernel traps if launched with less."""
        row = head_dim + _PAD
        return 8 * ((self.block_m + 2 * self.block_n) * row + self.block_m * (self.block_n + _PAD))


# Cost model behind the rows. float64 tiles make shared memory (227 KiB a block) the binding
# limit. The FMA pipe does 2 warp-DFMAs a clock per SM against one 128-byte shared wavefront: with
# 8 lanes across keys a warp's 16-byte K loads fill exactly one wavefront, so a step costs
# RM + RN wavefronts for 2 * RM * RN DFMAs; RM = 2, RN >= 4 keeps the FMA pipe the bottleneck
# (RM = 1 at d = 256 is just at the limit). In P V each V load serves 2 * RM DFMAs.
FORWARD_TILES_FP32: dict[int, Fp32TileConfig] = {
    32: Fp32TileConfig(64, 32, 256, "RM=2, RN=4: 51 KiB smem; 2 blocks (16 warps) per SM, capped by 128 registers; RN=8 spills at that cap"),
    64: Fp32TileConfig(64, 32, 256, "RM=2, RN=4: 83 KiB smem, 2 blocks per SM (64-key tiles would allow only 1)"),
    128: Fp32TileConfig(64, 32, 256, "RM=2, RN=4: 147 KiB smem, 1 block of 8 warps; each K/V fetch serves 64 queries"),
    192: Fp32TileConfig(64, 32, 256, "RM=2, RN=4: 211 KiB smem, 1 block of 8 warps"),
    256: Fp32TileConfig(32, 32, 256, "RM=1, RN=4: a 64-row Q tile alone would take 129 KiB; 202 KiB smem, 1 block of 8 warps"),
}


def forward_spec_fp32(d: int, causal: bool, vec: bool):
    """(KernelSpec, Fp32TileConfig) of the float32 forward for head dim d (or a bucket).

    ``vec`` is ignored: tiles are fetched element by element (to be converted to float64 on the
    way into shared memory, which rules out cp.async), and each fetched element feeds 2 * block_m
    float64 FMAs, so wider loads would not change the speed; one instantiation therefore serves
    every stride and alignment."""
    del vec
    hd = schedule.head_dim_bucket(d)
    t = FORWARD_TILES_FP32[hd]
    expr = f"attn_fwd_f32<{hd}, {t.block_m}, {t.block_n}, {t.threads}, {'true' if causal else 'false'}>"
    return KernelSpec("attn_fwd_fp32.cu", expr, t.threads, t.smem_bytes(hd)), t


def all_forward_specs_fp32():
    """Every float32 instantiation (gpu.all_forward_specs reaches them through gpu.forward_spec)."""
    return [forward_spec_fp32(hd, causal, False)[0] for hd in schedule.HEAD_DIM_BUCKETS for causal in (False, True)]


# ---------------------------------------------------------------------------------------------
# Backward (cuda_src/attn_bwd_fp32.cu): attn_bwd_f32_dq (query tiles: the exact row statistics
# lse2 and D, then dQ) and attn_bwd_f32_kv (key tiles: dK, dV over the group's query heads).


@dataclass(frozen=True)
class Fp32BackwardTile:
    dq_block_m: int  # attn_bwd_f32_dq: query rows per block
    dq_block_n: int  # ... keys per K/V tile
    kv_block_n: int  # attn_bwd_f32_kv: keys per block
    kv_block_m: int  # ... query rows per Q/dO tile
    threads: int  # both kernels: 8 lanes x (threads / 8) row groups
    reason: str

    def dq_smem_bytes(self, head_dim: int) -> int:
        """float64 Q, dO, K, V tiles and the dS tile; mirrors F64BwdDqTraits::kSmemBytes."""
        row = head_dim + _PAD
        return 8 * ((2 * self.dq_block_m + 2 * self.dq_block_n) * row + self.dq_block_m * (self.dq_block_n + _PAD))

    def kv_smem_bytes(self, head_dim: int) -> int:
        """float64 K, V, Q, dO tiles, P^T and dS^T, and the tile's lse2 and D; mirrors
        F64BwdKvTraits::kSmemBytes."""
        row = head_dim + _PAD
        return 8 * ((2 * self.kv_block_n + 2 * self.kv_block_m) * row
                    + 2 * self.kv_block_n * (self.kv_block_m + _PAD) + 2 * self.kv_block_m)


# Same cost model as the forward's table (shared memory binds; RM + RN 16-byte loads feed
# 2 * RM * RN DFMAs). Each kernel holds four float64 head-dim tiles (the forward three), so the
# tiles are at most the forward's; the K/V kernel keeps dK and dV (2 * d / 8 doubles a key row)
# in registers, hence one key row per thread.
BACKWARD_TILES_FP32: dict[int, Fp32BackwardTile] = {
    32: Fp32BackwardTile(64, 32, 32, 32, 256, "dq RM=2 RN=4, 68 KiB; kv RM=1 RN=4, 51.5 KiB (2 blocks per SM each)"),
    64: Fp32BackwardTile(64, 32, 32, 32, 256, "dq RM=2 RN=4, 116 KiB; kv RM=1 RN=4, 83.5 KiB (2 blocks per SM)"),
    128: Fp32BackwardTile(64, 32, 32, 32, 256, "dq RM=2 RN=4, 212 KiB; kv RM=1 RN=4, 147.5 KiB"),
    192: Fp32BackwardTile(32, 32, 32, 32, 256, "dq RM=1 RN=4, 202.5 KiB (64 query rows would take 308 KiB); kv 211.5 KiB"),
    256: Fp32BackwardTile(32, 16, 32, 16, 256, "dq RM=1 RN=2, 198 KiB; kv RM=1 RN=2, 203 KiB (32-row Q/dO tiles would take "
                          "275.5 KiB); dK and dV take 128 registers a thread"),
}


def backward_specs_fp32(d: int, causal: bool):
    """({"dq": KernelSpec, "kv": KernelSpec}, head-dim bucket, Fp32BackwardTile) for head dim d."""
    hd = schedule.head_dim_bucket(d)
    t = BACKWARD_TILES_FP32[hd]
    c = "true" if causal else "false"
    return {
        "dq": KernelSpec("attn_bwd_fp32.cu", f"attn_bwd_f32_dq<{hd}, {t.dq_block_m}, {t.dq_block_n}, {t.threads}, {c}>",
                         t.threads, t.dq_smem_bytes(hd)),
        "kv": KernelSpec("attn_bwd_fp32.cu", f"attn_bwd_f32_kv<{hd}, {t.kv_block_n}, {t.kv_block_m}, {t.threads}, {c}>",
                         t.threads, t.kv_smem_bytes(hd)),
    }, hd, t


def all_backward_specs_fp32():
    return [s for hd in schedule.HEAD_DIM_BUCKETS for causal in (False, True)
            for s in backward_specs_fp32(hd, causal)[0].values()]


def backward_workspace_bytes(p) -> int:
    """The float64 row statistics lse2 and D (B * Hq * Nq each) attn_bwd_f32_dq hands to attn_bwd_f32_kv."""
    return 2 * 8 * p.batch * p.hq * p.nq


_LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


def backward_fp32(p, do4, q4, k4, v4, dq4, dk4, dv4):
    """dq4, dk4, dv4 (B, H, N, d) float32 views with a unit head-dim stride receive the gradients.

    The saved lse and O are not read (see attn_bwd_fp32.cu): the row statistics are recomputed in
    float64. Deterministic by construction (no atomics)."""
    import cupy
    import numpy as np

    from ._build import get_function
    from .gpu import _elem_strides, _unit_d

    if p.batch == 0 or p.hkv == 0:
        return
    do4, q4, k4, v4 = (_unit_d(a) for a in (do4, q4, k4, v4))
    specs, _, t = backward_specs_fp32(p.d, p.causal is not None)
    off = np.int32(p.causal_offset if p.causal is not None else 0)
    # Python floats are doubles: the scale reaches the float64 arithmetic unrounded.
    scale_log2, scale = np.float64(p.scale * _LOG2E), np.float64(p.scale)
    lse2 = cupy.empty((p.batch, p.hq, p.nq), dtype=np.float64)
    dsum = cupy.empty((p.batch, p.hq, p.nq), dtype=np.float64)

    def strides(*arrays):
        return [np.int64(s) for a in arrays for s in _elem_strides(a)[:3]]

    dims = (np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group), off, scale_log2, scale)
    for b0 in range(0, p.batch, _MAX_GRID_YZ):
        sl = slice(b0, min(p.batch, b0 + _MAX_GRID_YZ))
        nb = sl.stop - b0
        if p.nq > 0 and p.hq > 0:
            get_function(specs["dq"])(
                (-(-p.nq // t.dq_block_m), p.hq, nb), (t.threads,),
                (q4[sl], k4[sl], v4[sl], do4[sl], dq4[sl], lse2[sl], dsum[sl],
                 *strides(q4, k4, v4, do4, dq4), *dims),
                shared_mem=specs["dq"].smem_bytes)
        if p.nk > 0:  # also when nq == 0: the blocks then write dK = dV = 0
            get_function(specs["kv"])(
                (-(-p.nk // t.kv_block_n), p.hkv, nb), (t.threads,),
                (q4[sl], k4[sl], v4[sl], do4[sl], lse2[sl], dsum[sl], dk4[sl], dv4[sl],
                 *strides(q4, k4, v4, do4, dk4, dv4), np.int32(p.hq), *dims),
                shared_mem=specs["kv"].smem_bytes)
