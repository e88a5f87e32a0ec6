"""Stream decode probe (GPU machine): cuDNN vs cuflash's decode with and without the stream kernel
(attn_decode_stream) on the peers' decode grid, A B A B rounds in one process, timed like
benchmarks/peers.py (L2 flushed, launch hidden behind a GPU spin). Each variant's output is
compared with cuDNN's first.

    python tools/decode_stream_probe.py out.json [--rounds 3]
"""
import json
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "tools")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode  # noqa: E402
from decode_cells import CELLS, decode_inputs  # noqa: E402

rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
out = []
for L, B, hkv in CELLS:
    q, k, v, nbytes = decode_inputs(L, B, hkv)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def ours(mode):
        def f():
            gpu_decode.STREAM = mode
            return cuflash.attention(qc, kc, vc)
        return f

    impls = {"cudnn": cudnn, "base": ours(False), "stream": ours(True)}
    ref = cudnn().float()
    row = {"L": L, "B": B, "hkv": hkv, "ms": {k_: [] for k_ in impls}, "err": {}}
    for name in ("base", "stream"):
        o = torch.from_dlpack(impls[name]()).float()
        row["err"][name] = float((o - ref).abs().max())
    for _ in range(rounds):
        for name, f in impls.items():
            row["ms"][name].append(timer(f)[0])
    gpu_decode.STREAM = None
    med = {k_: sorted(v_)[len(v_) // 2] for k_, v_ in row["ms"].items()}
    row["median_ms"] = med
    row["x_cudnn"] = {k_: med["cudnn"] / med[k_] for k_ in ("base", "stream")}
    print("STREAM L=%d B=%d Hkv=%d  cudnn %.1f us  base %.1f us (x%.3f)  stream %.1f us (x%.3f)  err %s"
          % (L, B, hkv, med["cudnn"] * 1e3, med["base"] * 1e3, row["x_cudnn"]["base"], med["stream"] * 1e3,
             row["x_cudnn"]["stream"], row["err"]), flush=True)
    out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
