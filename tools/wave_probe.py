"""Does the last partial wave of query tiles cost the forward what its share of a wave says?
(GPU machine.) For each head dim and length, cuflash and cuDNN are timed (benchmark Timer, same
process, same torch-made inputs) at the benchmark's batch x heads (16k tokens x hidden 2048:
a fractional number of waves of 128-row tiles on 132 SMs) and at batch x heads that make a whole
number of waves. If the partial wave costs a whole wave, TFLOP/s at the whole-wave shape is
higher by (whole waves) / (fractional waves); a kernel without that loss runs both alike.

    python3 tools/wave_probe.py out.json [--d 128,256] [--n 1024,4096,16384]
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers import Timer  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402


def arg(flag, default):
    return [int(x) for x in (sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default).split(",")]


SMS = torch.cuda.get_device_properties(0).multi_processor_count
ROWS = {64: 192, 128: 128, 256: 128}  # query rows per tile of the table's kernels
timer = Timer(warmup=2, repeats=20, seconds_per_impl=0.6)
out = []
for d in arg("--d", "64,128,256"):
    heads = 2048 // d
    for n in arg("--n", "1024,4096,16384"):
        tiles_per_head = math.ceil(n / ROWS[d])
        bench_bh = (16384 // n) * heads
        # the nearest batch x heads at or above the benchmark's whose tiles fill whole waves
        whole_bh = next(bh for bh in range(bench_bh, 8 * bench_bh) if bh * tiles_per_head % SMS == 0)
        for causal in (False, True):
            for bh in (bench_bh, whole_bh):
                q, k, v = (torch.randn(1, bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
                flops = 4 * bh * n * n * d / (2 if causal else 1)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    cudnn_ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                ours_ms, _ = timer(lambda: cuflash.attention(qc, kc, vc, causal="top_left" if causal else False))
                row = {"d": d, "n": n, "causal": causal, "bh": bh, "tiles": bh * tiles_per_head,
                       "waves": bh * tiles_per_head / SMS, "cuflash_ms": ours_ms, "cudnn_ms": cudnn_ms,
                       "cuflash_tflops": flops / ours_ms / 1e9, "cudnn_tflops": flops / cudnn_ms / 1e9,
                       "x_cudnn": cudnn_ms / ours_ms}
                print(f"WAVE d={d} n={n} causal={int(causal)} bh={bh} waves={row['waves']:.2f} "
                      f"cuflash {row['cuflash_tflops']:.0f} TF cudnn {row['cudnn_tflops']:.0f} TF x{row['x_cudnn']:.3f}",
                      flush=True)
                out.append(row)
                del q, k, v, qc, kc, vc
json.dump(out, open(sys.argv[1], "w"), indent=1)
