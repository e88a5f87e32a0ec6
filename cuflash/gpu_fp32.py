"""Float32 forward on the GPU: the tile table and launch spec of cuda_src/attn_fwd_fp32.cu.

float32 inputs are computed in float64 on the FMA pipes (the float32 -> float64 conversion is
exact) and rounded to float32 once at the end. Neither TF32 tensor cores nor float32 FMA chains
meet the accuracy rule the tests hold every dtype to: at most twice the error of the naive
formula with each primitive op (each matmul included) exact and then rounded to float32. A
float32 dot product over d terms or sum over Nk keys rounds many times and lands at 1.5-4x of
that bound on random inputs; float64 leaves only the final rounding.

The 16-bit kernels' table is cuflash/schedule.py's FORWARD_TILES; this module keeps the float32
one next to the code that reads it, keyed by the same padded head-dim buckets
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
