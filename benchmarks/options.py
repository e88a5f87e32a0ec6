"""Score modifiers side by side: cuflash's forward, backward and one-token decode with softcap,
ALiBi or sinks against cuflash without them (the plain kernels) and, forward and backward, against
FlexAttention with the same ``score_mod`` (torch.compile'd; sinks have no score_mod form and no
peer), in one process on the same inputs.

    python benchmarks/options.py --out options.json            # on a GPU with torch and CuPy
    python benchmarks/options.py --dry-run                     # the plan, anywhere

Rows are peers.py's ("op", "impl", shape, "ms", "tflops" by the 4 N^2 d convention, halved when
causal, backward 2.5x) with an "option" field (none, softcap, alibi, sinks); "vs_plain" is the
plain cuflash time of the same cell over this row's time. Each FlexAttention row carries its
output's largest difference from cuflash's ("max_abs_diff_vs_cuflash", forward only).
"""

from __future__ import annotations

import sys

from bench_main import bench_arguments, dash, failure_reason, ratio_column, run_cases
from peers import DEVICE, Case, Timer, _torch_dtype, record, torch_stream_ptr

OPTIONS = ("none", "softcap", "alibi", "sinks")
SOFTCAP = 30.0  # Gemma-2's attention cap
SHAPES = ((4, 16, 4096), (1, 16, 16384))  # (B, H, N): B * N = 16k tokens, H * d = 2048
# Decode (one token, split-KV kernel): (B, Hq, Hkv, L), peers.py's GQA decode shapes.
DECODE_SHAPES = ((8, 32, 8, 16384), (1, 32, 8, 131072))


def plan(ns, causal, d=128, dtype="bfloat16", decode=True):
    cases = [Case(op, dtype, d, b, h, h, n, n, c) for op in ("fwd", "bwd") for b, h, n in SHAPES if n in ns
             for c in causal]
    if decode:
        cases += [Case("decode", dtype, d, b, hq, hkv, 1, n, False) for b, hq, hkv, n in DECODE_SHAPES]
    return cases


def _alibi_slopes(h):
    """The ALiBi paper's geometric slopes for h heads (h a power of two)."""
    return [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]


class Options:
    def __init__(self, timer, flex=True):
        import cupy
        import torch

        import cuflash
        from cuflash.api.interop import external_stream

        self.torch, self.cupy, self.cuflash, self.timer = torch, cupy, cuflash, timer
        self._stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)
        self.want_flex, self.flex, self.flex_missing = flex, None, None
        if flex:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention

                self.flex = torch.compile(flex_attention, dynamic=False)
                self.block_mask = create_block_mask
            except Exception as exc:  # noqa: BLE001 - recorded as the peer's status
                self.flex_missing = f"{type(exc).__name__}: {exc}"[:300]

    def mods(self, option, h):
        """cuflash's keyword arguments for an option (CuPy arrays on the device)."""
        cp = self.cupy
        if option == "softcap":
            return {"softcap": SOFTCAP}
        if option == "alibi":
            return {"alibi_slopes": cp.asarray(_alibi_slopes(h), dtype=cp.float32)}
        if option == "sinks":
            return {"sinks": cp.linspace(-1.0, 2.0, h, dtype=cp.float32)}
        return {}

    def score_mod(self, option, h, nq, nk):
        torch = self.torch
        if option == "softcap":
            return lambda s, b, hh, qi, kj: SOFTCAP * torch.tanh(s / SOFTCAP)
        if option == "alibi":
            slopes = torch.tensor(_alibi_slopes(h), device=DEVICE, dtype=torch.float32)
            return lambda s, b, hh, qi, kj: s - slopes[hh] * (qi + nk - nq - kj).abs()
        return None

    def cell(self, case, option, rows):
        torch, cp = self.torch, self.cupy
        torch.manual_seed(0)
        dt = _torch_dtype(case.dtype)
        q, do = (torch.randn(case.b, case.hq, case.nq, case.d, device=DEVICE, dtype=dt) for _ in range(2))
        k, v = (torch.randn(case.b, case.hkv, case.nk, case.d, device=DEVICE, dtype=dt) for _ in range(2))
        with self._stream():
            qc, kc, vc, doc = (cp.from_dlpack(t) for t in (q, k, v, do))
        mods = self.mods(option, case.hq)
        causal = "top_left" if case.causal else False
        with self._stream():
            if case.op in ("fwd", "decode"):
                o_cf = self.cuflash.attention(qc, kc, vc, causal=causal, **mods)
                fn = lambda: self.cuflash.attention(qc, kc, vc, causal=causal, **mods)  # noqa: E731
            else:
                _, vjp = self.cuflash.attention_vjp(qc, kc, vc, causal=causal, **mods)
                fn = lambda: vjp(doc)  # noqa: E731

        def timed():
            with self._stream():
                return fn()
        ms, _ = self.timer(timed)
        rows.append(record(case, "cuflash", "ok", ms, option=option))
        sm = self.score_mod(option, case.hq, case.nq, case.nk)
        if option not in ("none", "softcap", "alibi") or not self.want_flex or case.op == "decode":
            return
        if self.flex is None:
            rows.append(record(case, "torch-flex", "unsupported", reason=self.flex_missing, option=option))
            return
        try:
            bm = None
            if case.causal:
                bm = self.block_mask(lambda b, h, qi, kj: kj <= qi, None, None, case.nq, case.nk, device=DEVICE)
            if case.op == "fwd":
                o = self.flex(q, k, v, score_mod=sm, block_mask=bm)
                o_t = torch.from_dlpack(o_cf.view(cp.int16)).view(dt)  # (through the bits: CuPy's bfloat16)
                diff = (o.float() - o_t.float()).abs().max().item()
                flex_fn = lambda: self.flex(q, k, v, score_mod=sm, block_mask=bm)  # noqa: E731
                extra = {"max_abs_diff_vs_cuflash": diff}
            else:
                leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                o = self.flex(*leaves, score_mod=sm, block_mask=bm)
                flex_fn = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)  # noqa: E731
                extra = {}
            ms, _ = self.timer(flex_fn)
            rows.append(record(case, "torch-flex", "ok", ms, option=option, **extra))
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a row, not a crash
            rows.append(record(case, "torch-flex", "error", reason=failure_reason(exc), option=option))


def add_vs_plain(rows):
    """vs_plain: plain cuflash's time at the same shape and mask over the row's."""
    ratio_column(rows, "vs_plain", lambda r: (r["op"], r["b"], r["nq"], r["nk"], r["causal"]),
                 lambda r: r["impl"] == "cuflash" and r["option"] == "none")


def main(argv=None):
    ap = bench_arguments(__doc__, seconds_per_impl=0.8)
    ap.add_argument("--n", default="4096,16384", help="comma list of sequence lengths")
    ap.add_argument("--causal", default="1", help="comma list of 0/1")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--no-flex", action="store_true", help="cuflash only (no FlexAttention rows)")
    args = ap.parse_args(argv)
    cases = plan([int(x) for x in args.n.split(",")], [c == "1" for c in args.causal.split(",")])
    options = args.options.split(",")
    if args.dry_run:
        for c in cases:
            print(c.label, options)
        return 0
    runner = Options(Timer(3, 20, args.seconds_per_impl), flex=not args.no_flex)
    doc = run_cases([(case, option) for case in cases for option in options],
                    run_case=lambda case_option, rows: runner.cell(*case_option, rows),
                    error_row=lambda case_option, reason: record(case_option[0], "cuflash", "error", reason=reason,
                                                                 option=case_option[1]),
                    out=args.out, derive=add_vs_plain)
    for r in doc["bench"]:
        print(f"{r['op']:6} {r['option']:8} {r['impl']:11} B={r['b']:2} N={r['nq']:6} L={r['nk']:6} "
              f"causal={r['causal']!s:5} ms={dash(r['ms'], '.3f'):>8} "
              f"vs_plain={dash(r.get('vs_plain'), '.3f')} {r['status']} {r.get('reason', '')[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
