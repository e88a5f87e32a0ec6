"""A V head dim different from Q/K's (DeepSeek-style MLA prefill, (d, dv) = (192, 128); (128, 64)):
cuflash's forward and backward against torch SDPA's backends that take the shape, in one process
on the same inputs.

    python benchmarks/head_dim_v.py --out head_dim_v.json      # on a GPU with torch and CuPy
    python benchmarks/head_dim_v.py --dry-run                  # the plan, anywhere

Rows are peers.py's with a "dv" field. "tflops" counts 2 N^2 (d + dv) per head (Q K^T at d, P V at
dv; the 4 N^2 d convention where dv = d), halved when causal, backward 2.5x; "tbps" counts q, k,
(do, o) at their own widths. A backend that refuses the shape is an "unsupported" row with torch's
reason. "max_abs_diff_vs_cudnn" is the largest difference of cuflash's output (forward) or dq, dk,
dv (backward) from cuDNN's, where cuDNN ran.
"""

from __future__ import annotations

import sys

from bench_main import bench_arguments, dash, failure_reason, ratio_column, run_cases
from peers import BACKWARD_FLOP_FACTOR, DEVICE, Case, Timer, _torch_dtype, record, torch_stream_ptr

HEAD_DIMS = ((192, 128), (128, 64))
SHAPES = ((4, 16, 4096), (1, 16, 16384))  # (B, H, N): B * N = 16k tokens
PEERS = ("torch-cudnn", "torch-efficient", "torch-flash")


def plan(head_dims=HEAD_DIMS, shapes=SHAPES, causals=(False, True), ops=("fwd", "bwd"), dtype="bfloat16"):
    """[(Case, dv)]: Case.d is q's and k's head dim."""
    return [(Case(op, dtype, d, b, h, h, n, n, c), dv) for d, dv in head_dims for b, h, n in shapes
            for c in causals for op in ops]


def flops(case: Case, dv: int) -> float:
    f = 2.0 * case.b * case.hq * case.nq * case.nk * (case.d + dv)
    if case.causal:
        f /= 2
    return f * (BACKWARD_FLOP_FACTOR if case.op == "bwd" else 1.0)


def logical_bytes(case: Case, dv: int) -> int:
    """Each input read once, each output written once (16-bit; lse left out)."""
    q = case.b * case.hq * case.nq
    kv = case.b * case.hkv * case.nk
    if case.op == "fwd":
        elems = q * case.d + kv * (case.d + dv) + q * dv
    else:  # q, k, v, o, do in; dq, dk, dv out
        elems = q * case.d + kv * (case.d + dv) + 2 * q * dv + q * case.d + kv * (case.d + dv)
    return 2 * elems


def row(case, dv, impl, status, ms=None, **extra):
    r = record(case, impl, status, ms, dv=dv, **extra)
    if ms:
        r["tflops"] = flops(case, dv) / (ms * 1e-3) / 1e12
        r["tflops_exact"] = None
        r["tbps"] = logical_bytes(case, dv) / (ms * 1e-3) / 1e12
    return r


class HeadDimV:
    def __init__(self, timer):
        import cupy
        import torch

        import cuflash
        from cuflash.api.interop import external_stream

        self.torch, self.cupy, self.cuflash, self.timer = torch, cupy, cuflash, timer
        self._stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)

    def cell(self, case, dv, rows):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch, cp = self.torch, self.cupy
        torch.manual_seed(0)
        dt = _torch_dtype(case.dtype)
        q = torch.randn(case.b, case.hq, case.nq, case.d, device=DEVICE, dtype=dt)
        k = torch.randn(case.b, case.hkv, case.nk, case.d, device=DEVICE, dtype=dt)
        v = torch.randn(case.b, case.hkv, case.nk, dv, device=DEVICE, dtype=dt)
        do = torch.randn(case.b, case.hq, case.nq, dv, device=DEVICE, dtype=dt)
        causal = "top_left" if case.causal else False
        with self._stream():
            qc, kc, vc, doc = (cp.from_dlpack(t) for t in (q, k, v, do))
            if case.op == "fwd":
                fn = lambda: self.cuflash.attention(qc, kc, vc, causal=causal)  # noqa: E731
            else:
                _, vjp = self.cuflash.attention_vjp(qc, kc, vc, causal=causal)
                fn = lambda: vjp(doc)  # noqa: E731
            ours = fn()

        def timed():
            with self._stream():
                return fn()
        ours_t = [torch.from_dlpack(x.view(cp.int16)).view(dt) for x in (ours if isinstance(ours, tuple) else (ours,))]
        ms, _ = self.timer(timed)
        cuflash_row = row(case, dv, "cuflash", "ok", ms)
        rows.append(cuflash_row)
        backends = {"torch-cudnn": SDPBackend.CUDNN_ATTENTION, "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "torch-flash": SDPBackend.FLASH_ATTENTION}
        for impl in PEERS:
            def sdpa(*args):
                with sdpa_kernel([backends[impl]]):
                    return F.scaled_dot_product_attention(*args, is_causal=case.causal)
            try:
                if case.op == "fwd":
                    theirs = [sdpa(q, k, v)]
                    peer_fn = lambda: sdpa(q, k, v)  # noqa: E731
                else:
                    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                    o = sdpa(*leaves)
                    theirs = list(torch.autograd.grad(o, leaves, do, retain_graph=True))
                    peer_fn = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)  # noqa: E731
                ms, _ = self.timer(peer_fn)
            except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape is a row
                rows.append(row(case, dv, impl, "unsupported", reason=failure_reason(exc)))
                continue
            rows.append(row(case, dv, impl, "ok", ms))
            if impl == "torch-cudnn":
                cuflash_row["max_abs_diff_vs_cudnn"] = max((a.float() - b.float()).abs().max().item()
                                                           for a, b in zip(ours_t, theirs))


def add_vs_cudnn(rows):
    """vs_cudnn: cuDNN's time at the same shape, head dims and mask over the row's."""
    ratio_column(rows, "vs_cudnn", lambda r: (r["op"], r["d"], r["dv"], r["b"], r["nq"], r["causal"]),
                 lambda r: r["impl"] == "torch-cudnn")


def main(argv=None):
    args = bench_arguments(__doc__, seconds_per_impl=0.4).parse_args(argv)
    cases = plan()
    if args.dry_run:
        for c, dv in cases:
            print(c.label, f"dv={dv}")
        return 0
    runner = HeadDimV(Timer(3, 20, args.seconds_per_impl))
    doc = run_cases(cases, run_case=lambda case_dv, rows: runner.cell(*case_dv, rows),
                    error_row=lambda case_dv, reason: row(*case_dv, "cuflash", "error", reason=reason),
                    out=args.out, derive=add_vs_cudnn)
    for r in doc["bench"]:
        print(f"{r['op']:4} d={r['d']}/{r['dv']} {r['impl']:15} B={r['b']} N={r['nq']:6} causal={r['causal']!s:5} "
              f"ms={dash(r['ms'], '.3f'):>8} TFLOP/s={dash(r.get('tflops'), '.0f'):>5} "
              f"x_cudnn={dash(r.get('vs_cudnn'), '.3f')} {r['status']} {r.get('reason', '')[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
