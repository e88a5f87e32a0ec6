"""Float32 plans: the tile tables and kernel specs of cuda_src/attn_fwd_fp32.cu, attn_bwd_fp32.cu
(FMA pipes, every head dim and GPU) and attn_fp32_mma.cu (float64 tensor cores, sm_90, head dims
up to 128).

float32 inputs are computed in float64 (the float32 -> float64 conversion is exact, products of
two float32 values are exact in float64) and rounded to float32 once at the end. Neither TF32
tensor cores nor float32 FMA chains meet the accuracy rule the tests hold every dtype to
(cuflash.testing): a float32 dot product over d terms or a sum over Nk keys rounds many times;
float64 leaves only the final rounding.

The 16-bit kernels' tables are in cuflash.plan.schedule; these are keyed by the same padded
head-dim buckets (schedule.HEAD_DIM_BUCKETS).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import config
from . import schedule
from .spec import KernelSpec
from .target import Target

_LANES = 8  # threads across the keys / head dim of one row group (the kernel's kLanes)


_PAD = 2  # doubles of padding per shared-memory row (the kernel's kLd / kLdP)


_MMA_PAD = 4  # doubles of padding per row of the tensor-core kernels' tiles (MmaF64Layout::kLd)


@dataclass(frozen=True)
class Fp32TileConfig:
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    threads: int  # FMA kernel: 8 lanes x (threads / 8) row groups; mma: warps of 16 query rows
    reason: str
    mma: bool = False  # attn_fwd_f32_mma (float64 tensor cores, sm_90) instead of attn_fwd_f32

    @property
    def rows_per_thread(self) -> int:
        return self.block_m // (self.threads // _LANES)

    def smem_bytes(self, head_dim: int) -> int:
        """FMA kernel: float64 Q, K and V tiles (head_dim + 2 a row) and P tile (block_n + 2 a row),
        F64Traits::kSmemBytes. mma: Q, K and V (head_dim + 4 a row), MmaFwdTraits::kSmemBytes.
        The kernels trap if launched with less."""
        if self.mma:
            return 8 * (self.block_m + 2 * self.block_n) * (head_dim + _MMA_PAD)
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


# The float64 tensor-core kernels (cuda_src/attn_fp32_mma.cu; sm_90's mma.sync m16n8k8 .f64 at
# 66 TFLOP/s against 29 for DFMA chains on the H200) for head dims up to 128:
# each warp keeps 16 rows of O (head_dim / 2 doubles a thread) in registers, which 192 and 256
# would overflow. A warp's k-step loads 4 A + 2 B doubles per 8-key mma (8 clocks of the SM's
# tensor pipe; 2 shared wavefronts each).
FORWARD_TILES_FP32_MMA: dict[int, Fp32TileConfig] = {
    32: Fp32TileConfig(128, 64, 256, "8 warps x 16 rows, 64-key tiles: 72 KiB (236 registers: one block, 8 warps per SM)", mma=True),
    64: Fp32TileConfig(128, 32, 256, "8 warps x 16 rows, 32-key tiles: 102 KiB (64-key tiles spill at 4 warps)",
                       mma=True),
    128: Fp32TileConfig(128, 32, 256, "8 warps x 16 rows, 32-key tiles (O 64 + S 16 doubles a thread): 198 KiB; 37 TFLOP/s at "
                        "N=4k, where 4 warps (64 rows, 132 KiB: one block of 4 warps per SM) ran at 18.9", mma=True),
}


def mma_runs(d: int, target: Target | None) -> bool:
    """Whether float32 head dim d runs on the float64 tensor cores: a bucket of
    FORWARD_TILES_FP32_MMA, CUFLASH_KERNELS=auto, and an sm_90 target."""
    if target is None or schedule.head_dim_bucket(d) not in FORWARD_TILES_FP32_MMA:
        return False
    return config.hopper_kernels() and target.hopper


def forward_spec_fp32(d: int, causal: bool, vec: bool, tile: Fp32TileConfig | None = None,
                      target: Target | None = None):
    """(KernelSpec, Fp32TileConfig) of the float32 forward for head dim d (or a bucket); without
    a tile, the tensor-core kernel where mma_runs on the target, else FORWARD_TILES_FP32's.

    ``vec`` is ignored: tiles are fetched element by element (to be converted to float64 on the
    way into shared memory, which rules out cp.async), and each fetched element feeds 2 * block_m
    float64 FMAs, so wider loads would not change the speed; one instantiation therefore serves
    every stride and alignment."""
    del vec
    hd = schedule.head_dim_bucket(d)
    t = tile or (FORWARD_TILES_FP32_MMA[hd] if mma_runs(d, target) else FORWARD_TILES_FP32[hd])
    c = "true" if causal else "false"
    if t.mma:
        expr = f"attn_fwd_f32_mma<{hd}, {t.block_n}, {t.threads // 32}, {c}>"
        return KernelSpec("attn_fp32_mma.cu", expr, t.threads, t.smem_bytes(hd)), t
    expr = f"attn_fwd_f32<{hd}, {t.block_m}, {t.block_n}, {t.threads}, {c}>"
    return KernelSpec("attn_fwd_fp32.cu", expr, t.threads, t.smem_bytes(hd)), t


def all_forward_specs_fp32():
    """Every float32 forward instantiation: the FMA kernel at every bucket (other GPUs,
    CUFLASH_KERNELS=mma_sync) and the tensor-core one where it exists."""
    tiles = [(hd, FORWARD_TILES_FP32[hd]) for hd in schedule.HEAD_DIM_BUCKETS] + list(FORWARD_TILES_FP32_MMA.items())
    return [forward_spec_fp32(hd, causal, False, t)[0] for hd, t in tiles for causal in (False, True)]


@dataclass(frozen=True)
class Fp32BackwardTile:
    dq_block_m: int  # attn_bwd_f32_dq: query rows per block
    dq_block_n: int  # ... keys per K/V tile
    kv_block_n: int  # attn_bwd_f32_kv: keys per block
    kv_block_m: int  # ... query rows per Q/dO tile
    threads: int  # FMA kernels: 8 lanes x (threads / 8) row groups (mma: see dq_threads, kv_threads)
    reason: str
    mma: bool = False  # attn_bwd_f32_mma_dq / _kv (float64 tensor cores, sm_90)

    @property
    def dq_threads(self) -> int:
        return 256 if self.mma else self.threads  # mma: 2 warps (key halves) x 4 x 16 query rows

    @property
    def kv_threads(self) -> int:
        return 256 if self.mma else self.threads  # mma: 4 warp pairs x 16 keys

    def dq_smem_bytes(self, head_dim: int) -> int:
        """float64 Q, dO, K, V tiles and (FMA kernel) the dS tile; mirrors F64BwdDqTraits /
        MmaBwdDqTraits::kSmemBytes."""
        if self.mma:
            return 8 * (2 * self.dq_block_m + 2 * self.dq_block_n) * (head_dim + _MMA_PAD)
        row = head_dim + _PAD
        return 8 * ((2 * self.dq_block_m + 2 * self.dq_block_n) * row + self.dq_block_m * (self.dq_block_n + _PAD))

    def kv_smem_bytes(self, head_dim: int) -> int:
        """float64 K, V, Q, dO tiles, P^T and dS^T (mma: P^T handed between the warps of a pair),
        and the tile's lse2 and D; mirrors F64BwdKvTraits / MmaBwdKvTraits::kSmemBytes."""
        if self.mma:
            return 8 * ((2 * self.kv_block_n + 2 * self.kv_block_m) * (head_dim + _MMA_PAD)
                        + self.kv_block_n // 16 * self.kv_block_m * 16 + 2 * self.kv_block_m)
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


# The tensor-core backward (attn_fp32_mma.cu): the dQ kernel's warp pairs hold 16 query rows of
# dQ each (one warp per half of every key tile; with 4 warps per SM its backward took 25.7 ms at
# B=1 H=16 N=4k d=128), the K/V kernel's warp pairs 16 keys (dV in the even warp, dK in the odd).
BACKWARD_TILES_FP32_MMA: dict[int, Fp32BackwardTile] = {
    32: Fp32BackwardTile(64, 64, 64, 32, 0, "dq 64 x 64-key tiles, 72 KiB; kv 64 keys x 32-row Q/dO tiles, 70.5 KiB", mma=True),
    64: Fp32BackwardTile(64, 32, 64, 32, 0, "dq 64 x 32-key tiles, 102 KiB (64-key tiles spill); kv 64 keys x 32-row Q/dO tiles, 118.5 KiB", mma=True),
    128: Fp32BackwardTile(64, 32, 64, 32, 0, "dq 64 x 32-key tiles (each warp half of them: S, dP and dQ 80 doubles a "
                          "thread), 198 KiB; kv 64 keys x 32-row Q/dO tiles, 214.5 KiB",
                          mma=True),
}


def backward_specs_fp32(d: int, causal: bool, tile: Fp32BackwardTile | None = None, target: Target | None = None):
    """({"dq": KernelSpec, "kv": KernelSpec}, head-dim bucket, Fp32BackwardTile) for head dim d;
    without a tile, the tensor-core kernels where mma_runs on the target, else BACKWARD_TILES_FP32's."""
    hd = schedule.head_dim_bucket(d)
    t = tile or (BACKWARD_TILES_FP32_MMA[hd] if mma_runs(d, target) else BACKWARD_TILES_FP32[hd])
    c = "true" if causal else "false"
    if t.mma:
        return {
            "dq": KernelSpec("attn_fp32_mma.cu", f"attn_bwd_f32_mma_dq<{hd}, {t.dq_block_n}, {c}>", t.dq_threads,
                             t.dq_smem_bytes(hd)),
            "kv": KernelSpec("attn_fp32_mma.cu", f"attn_bwd_f32_mma_kv<{hd}, {t.kv_block_m}, {c}>", t.kv_threads,
                             t.kv_smem_bytes(hd)),
        }, hd, t
    return {
        "dq": KernelSpec("attn_bwd_fp32.cu", f"attn_bwd_f32_dq<{hd}, {t.dq_block_m}, {t.dq_block_n}, {t.threads}, {c}>",
                         t.threads, t.dq_smem_bytes(hd)),
        "kv": KernelSpec("attn_bwd_fp32.cu", f"attn_bwd_f32_kv<{hd}, {t.kv_block_n}, {t.kv_block_m}, {t.threads}, {c}>",
                         t.threads, t.kv_smem_bytes(hd)),
    }, hd, t


def all_backward_specs_fp32():
    tiles = [(hd, BACKWARD_TILES_FP32[hd]) for hd in schedule.HEAD_DIM_BUCKETS] + list(BACKWARD_TILES_FP32_MMA.items())
    return [s for hd, t in tiles for causal in (False, True) for s in backward_specs_fp32(hd, causal, t)[0].values()]


def backward_workspace_bytes(p) -> int:
    """The float64 row statistics lse2 and D (B * Hq * Nq each) attn_bwd_f32_dq hands to attn_bwd_f32_kv."""
    return 2 * 8 * p.batch * p.hq * p.nq
