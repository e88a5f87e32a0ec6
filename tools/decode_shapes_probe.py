"""Decode shapes outside the issue grid (GPU machine): cuflash next to cuDNN and FlashAttention-2
through torch SDPA, same process and inputs, timed like benchmarks/peers.py (L2 flushed, launch
hidden). Query tokens per sequence (speculative decoding), head dims, fp16/bf16, GQA groups.

    python3 tools/decode_shapes_probe.py out.json
"""
import json
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402

timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
SHAPES = [  # (B, Hq, Hkv, nq, L, d, dtype)
    (8, 32, 8, 1, 16384, 128, torch.bfloat16),
    (8, 32, 8, 4, 16384, 128, torch.bfloat16),
    (8, 32, 8, 8, 16384, 128, torch.bfloat16),
    (8, 32, 8, 16, 16384, 128, torch.bfloat16),
    (8, 32, 32, 4, 16384, 128, torch.bfloat16),
    (8, 32, 8, 1, 16384, 64, torch.bfloat16),
    (8, 32, 8, 1, 16384, 256, torch.bfloat16),
    (8, 32, 8, 4, 16384, 256, torch.bfloat16),
    (8, 32, 8, 1, 16384, 128, torch.float16),
    (8, 64, 8, 1, 16384, 128, torch.bfloat16),
    (1, 32, 8, 1, 131072, 128, torch.bfloat16),
    (32, 32, 8, 1, 2048, 128, torch.bfloat16),
]
out = []
for B, hq, hkv, nq, L, d, dt in SHAPES:
    q = torch.randn(B, hq, nq, d, device="cuda", dtype=dt)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=dt) for _ in range(2))
    nbytes = 2 * B * hkv * L * d * q.element_size() + 2 * q.numel() * q.element_size()
    row = {"B": B, "hq": hq, "hkv": hkv, "nq": nq, "L": L, "d": d, "dtype": str(dt), "us": {}}
    causal = nq > 1  # bottom-right: the new tokens see the cache and each other in order
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                if causal:  # SDPA's is_causal is top-left; a bottom-right mask for nq > 1
                    from torch.nn.attention.bias import causal_lower_right
                    mask = causal_lower_right(nq, L)
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
                else:
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                fn()
                ms, _ = timer(fn)
            row["us"][name] = ms * 1e3
        except Exception as e:  # noqa: BLE001
            row["us"][name] = repr(e)[:80]
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    kw = {"causal": "bottom_right"} if causal else {}
    try:
        ms, _ = timer(lambda: cuflash.attention(qc, kc, vc, **kw))
        row["us"]["cuflash"] = ms * 1e3
        run = cuflash.prepare_attention(qc, kc, vc, **kw)
        row["path"] = repr(run)[:160]
    except Exception as e:  # noqa: BLE001
        row["us"]["cuflash"] = repr(e)[:120]
    us = row["us"]
    best = min((v_ for k_, v_ in us.items() if k_ != "cuflash" and isinstance(v_, float)), default=None)
    cf = us.get("cuflash")
    print(f"B{B} H{hq}/{hkv} nq{nq} L{L} d{d} {str(dt)[6:]}: " + ", ".join(
        f"{k_} {v_:.1f}" if isinstance(v_, float) else f"{k_} {v_}" for k_, v_ in us.items())
        + (f" | cuflash TB/s {nbytes / cf / 1e6:.2f}, x best peer {best / cf:.3f}" if isinstance(cf, float) and best else "")
        + f" | {row.get('path')}", flush=True)
    out.append(row)
    del q, k, v, qc, kc, vc
json.dump(out, open(sys.argv[1], "w"), indent=1)
