"""Time the float32 forward and backward (float64 arithmetic) next to torch's float32 SDPA (math /
efficient backends) on the same inputs: python3 tools/fp32_time.py [B H N d]. Prints ms and
TFLOP/s (4 N^2 d forward, 2.5x backward, full attention)."""
import sys

import cupy as cp
import numpy as np
import torch

import cuflash

b, h, n, d = (int(x) for x in sys.argv[1:5]) if len(sys.argv) > 4 else (1, 16, 4096, 128)
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(4))


def ms(fn, reps=5):
    fn()
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / reps


o, lse = cuflash.attention(q, k, v, return_lse=True)
flops = 4.0 * b * h * n * n * d
f = ms(lambda: cuflash.attention(q, k, v, return_lse=True))
g = ms(lambda: cuflash.attention_backward(do, q, k, v, o, lse))
print(f"cuflash float32 B={b} H={h} N={n} d={d}: fwd {f:.2f} ms {flops / f / 1e9:.1f} TFLOP/s, "
      f"bwd {g:.2f} ms {2.5 * flops / g / 1e9:.1f} TFLOP/s")
tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda").requires_grad_(True) for x in (q, k, v, do))
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
    try:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            tf = ms(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))
            tb = ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True))
        print(f"torch {name} float32: fwd {tf:.2f} ms, bwd {tb:.2f} ms")
    except Exception as exc:  # noqa: BLE001
        print(f"torch {name} float32: {type(exc).__name__}: {exc}")
