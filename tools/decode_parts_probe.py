"""Where one decode call's GPU time goes, cuflash next to cuDNN and FlashAttention-2 (torch SDPA):
every GPU activity of one call after warm-up (tools/bwd_parts_probe.timeline: CUPTI through
torch.profiler, queued behind a GPU spin), so that kernel counts, durations and the gaps between
them can be compared.

    python3 tools/decode_parts_probe.py [B,Hkv,L[,Hq] ...]    (Hq=32 unless given, d=128, bf16; default B=1 cells)
"""
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bwd_parts_probe import timeline

import cuflash


def main(cells):
    for cell in cells:
        b, hkv, n, *rest = (int(x) for x in cell.split(","))
        hq = rest[0] if rest else 32
        tq = torch.randn(b, hq, 1, 128, device="cuda", dtype=torch.bfloat16)
        tk, tv = (torch.randn(b, hkv, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))
        tag = f"B={b} Hq={hq} Hkv={hkv} L={n}"
        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):
            def peer(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
            timeline(peer, f"{name} {tag}")
        timeline(lambda: cuflash.attention(q, k, v), f"cuflash.attention {tag}")
        run = cuflash.prepare_attention(q, k, v)
        timeline(lambda: run(q, k, v), f"cuflash prepared {tag} {run.kernel}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["1,8,8192", "1,8,32768", "1,8,131072", "8,8,16384", "64,8,4096"])
