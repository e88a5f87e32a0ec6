"""The e4m3 (FP8) forward's band kernel - sliding windows and packed sequences - against its dense
kernel, in one process on the same total tokens (16 heads, N = 16k, d = 128 and 256, per-tensor
descales, o bfloat16).

    python benchmarks/fp8_band.py --out fp8_band.json     # on an sm_90 GPU with torch and CuPy
    python benchmarks/fp8_band.py --dry-run                # the plan, anywhere

A window or a packing does less work than the dense grid, so rows compare rates, not times: each
row's "tflops" and "tflops_exact" count the pairs the call really sees (cuflash.flops with the
window or the sequence offsets, 4 * pairs * d), and "vs_dense" is that rate over the dense
kernel's on the same tokens (the plain forward, causal for the causal rows). Rows are peers.py's
with "dtype": "float8_e4m3fn" and a "shape" of "dense", "window (w, 0)", "packed s x n" (the
offsets read on the host: one device-to-host copy that waits for the device, so the timed span
holds the host's work after it) or "packed s x n, max_seqlen" (max_seqlen_q / max_seqlen_k given,
validate=False: no host read, the kernel's own time).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench_main import bench_arguments, dash, run_cases
from peers import DEVICE, FP8, Case, Timer, record, torch_stream_ptr

HEADS, TOKENS = 16, 16384
WINDOWS = (1024, 4096)  # left reach: each query sees the previous w keys and itself
SEQUENCES = (8, 32)  # packed sequences of TOKENS / s tokens each


@dataclass(frozen=True)
class BandCase(Case):
    """peers.Case of the call's tokens (B = 1, H = HEADS, N = TOKENS), with the band: shape "dense",
    "window" (reach ``size``) or "packed" (``size`` sequences of TOKENS / size tokens)."""

    shape: str = "dense"
    size: int = 0
    lengths: bool = False  # packed: max_seqlen_q / max_seqlen_k and validate=False

    @property
    def what(self) -> str:
        return {"dense": "dense", "window": f"window ({self.size}, 0)",
                "packed": f"packed {self.size} x {TOKENS // max(self.size, 1)}"
                          + (", max_seqlen" if self.lengths else "")}[self.shape]

    @property
    def label(self) -> str:
        return f"fwd e4m3 d={self.d} H={HEADS} N={TOKENS} {self.what}{' causal' if self.causal else ''}"


def band_case(d, causal, shape="dense", size=0, lengths=False) -> BandCase:
    return BandCase("fwd", FP8, d, 1, HEADS, HEADS, TOKENS, TOKENS, causal, shape, size, lengths)


def plan(ds=(128, 256)):
    cases = []
    for d in ds:
        for causal in (False, True):
            cases.append(band_case(d, causal))
            cases += [band_case(d, causal, "packed", s, lengths) for s in SEQUENCES for lengths in (False, True)]
        cases += [band_case(d, False, "window", w) for w in WINDOWS]  # (w, 0): causal within the reach
    return cases


def exact_flops(case: BandCase, cu_seqlens=None) -> int:
    """4 * visible pairs * d of the case (cuflash.accounting.flops)."""
    import cuflash

    shape = (TOKENS, HEADS, case.d) if case.shape == "packed" else (1, HEADS, TOKENS, case.d)
    kw = {"layout": "bshd", "cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens} if case.shape == "packed" else {}
    window = (case.size, 0) if case.shape == "window" else None
    return cuflash.flops(shape, shape, causal="top_left" if case.causal else False, window=window, **kw).flops


def quantize_e4m3_tensor(x):
    """(x8 float8_e4m3fn, descale float32 (1,)) of a tensor: its amax maps to e4m3's largest
    finite value, 448."""
    import torch

    amax = x.float().abs().amax()
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float().reshape(1)
    return (x.float() / descale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), descale


class Fp8Band:
    def __init__(self, timer):
        import cupy
        import torch

        import cuflash
        from cuflash.api.interop import external_stream

        self.torch, self.cupy, self.cuflash, self.timer = torch, cupy, cuflash, timer
        self._stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)

    def cell(self, case: BandCase, rows):
        torch, cp = self.torch, self.cupy
        torch.manual_seed(0)
        # per-tensor descales: packed inputs take one factor per tensor
        parts = [quantize_e4m3_tensor(torch.randn(1, HEADS, TOKENS, case.d, device=DEVICE, dtype=torch.bfloat16))
                 for _ in "qkv"]
        descales = {f"{n}_descale": p[1] for n, p in zip("qkv", parts)}
        kw = {"causal": "top_left" if case.causal else False}
        cu = None
        with self._stream():
            if case.shape == "packed":  # (total, H, d): the tokens of one row, sequence after sequence
                arrays = [cp.from_dlpack(p[0].view(torch.uint8)[0].transpose(0, 1).contiguous()) for p in parts]
                n = TOKENS // case.size
                cu = cp.arange(0, TOKENS + 1, n, dtype=cp.int32)
                kw.update(layout="bshd", cu_seqlens_q=cu, cu_seqlens_k=cu)
                if case.lengths:
                    kw.update(max_seqlen_q=n, max_seqlen_k=n, validate=False)
            else:
                arrays = [cp.from_dlpack(p[0].view(torch.uint8)) for p in parts]
                if case.shape == "window":
                    kw["window"] = (case.size, 0)
            ds = {k: cp.from_dlpack(v) for k, v in descales.items()}

        def run():
            with self._stream():
                return self.cuflash.attention(*arrays, **kw, **ds)
        run()
        ms, n = self.timer(run)
        flops = exact_flops(case, None if cu is None else cu.get().tolist())
        rate = flops / (ms * 1e-3) / 1e12
        rows.append(record(case, "cuflash", "ok", ms, shape=case.what,
                           tflops=rate, tflops_exact=rate, repeats=n))


def add_ratios(rows):
    """vs_dense: the row's exact rate over the dense row's of its head dim and mask (rates, not
    times: the rows do different work)."""
    dense = {(r["d"], r["causal"]): r["tflops_exact"] for r in rows if r.get("shape") == "dense" and r["tflops_exact"]}
    for r in rows:
        base = dense.get((r["d"], r["causal"]))
        r["vs_dense"] = r["tflops_exact"] / base if base and r["tflops_exact"] else None


def main(argv=None):
    args = bench_arguments(__doc__, seconds_per_impl=0.5).parse_args(argv)
    cases = plan()
    if args.dry_run:
        for c in cases:
            print(c.label)
        return 0
    runner = Fp8Band(Timer(3, 30, args.seconds_per_impl))
    doc = run_cases(cases, runner.cell,
                    error_row=lambda case, reason: record(case, "cuflash", "error", reason=reason,
                                                          shape=case.what),
                    out=args.out, derive=add_ratios)
    for r in doc["bench"]:
        mask = "causal" if r["causal"] else "full"
        print(f"d={r['d']:3} {r.get('shape', '-'):34} {mask:6} ms={dash(r['ms'], '.3f'):>7} TFLOP/s={dash(r.get('tflops_exact'), '.0f'):>5} "
              f"vs_dense={dash(r.get('vs_dense'), '.3f')} {r['status']} {r.get('reason', '')[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
