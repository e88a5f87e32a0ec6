"""Side by side on one GPU: cuflash against torch SDPA's backends and the materializing reference.

One process, one set of inputs per shape: q, k, v are created once as torch CUDA tensors (fresh
random normal) and viewed as CuPy arrays through DLPack (zero-copy), so every implementation reads
the same bytes. Each implementation's output is checked before it is timed:

* against a float64 result computed on the GPU for sampled query rows of every (batch, head)
  (forward, decode) or for one (batch, K/V head) slice (backward), and
* against torch-flash's output on the whole tensor (or the first peer that ran, if flash refused).

cuflash (and the reference) fail the check ("mismatch", still timed and reported) when their
error against float64 exceeds 2x torch-flash's error plus one rounding of the output, or their
whole-tensor difference from torch-flash exceeds what those two bounds allow (3x flash's error plus
one rounding, relative to the values' magnitude), or any element is not finite. Timing: CUDA events on torch's current stream (cuflash
runs on that same stream), warm-up first, L2 flushed between repeats by writing a 256 MiB buffer
outside the timed region, median of the repeats. By default a GPU spin queued before each start
event hides the host's launch overhead (device time only); ``--count-launch`` keeps it in.
The process exits 1 when any cuflash result is a "mismatch".

Usage (on the GPU machine, from the repository root):

    python benchmarks/peers.py --out peers.json                 # the full forward grid
    python benchmarks/peers.py --quick --ops fwd,bwd,decode --out quick.json
    python benchmarks/peers.py --dry-run                        # the plan only, no GPU, no torch
    python benchmarks/peers.py --fp8 --d 128,256 --n 8192,16384 --out fp8.json   # + e4m3 rows

``--fp8``: after each forward case at a head dim and length of FP8_D / FP8_N, the same shape with
float8_e4m3fn q, k, v (dtype "float8_e4m3fn": the bf16 inputs quantized per (batch, head), the
quantization not timed; cuflash's e4m3 kernel, its vt pass timed with it; o bfloat16). torch's SDPA
takes no float8 inputs, so its backends' rows say "unsupported". The e4m3 row's check: its error
against float64 of the dequantized values on the sampled rows within 2x the error of the FP8
arithmetic emulated on those rows (e4m3 P against the row max) plus one rounding of o.

The file imports neither torch nor CuPy at module level, so ``--dry-run`` runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

TOKENS = 16384  # B * N of the forward grid (docs/performance.md)
MODEL_WIDTH = 2048  # H * d of the forward grid
GRID_N = (512, 1024, 2048, 4096, 8192, 16384)
GRID_D = (64, 128, 256)
DECODE_LENGTHS = (4096, 16384, 65536)
DECODE_HEADS = ((8, 32, 8), (64, 32, 8), (8, 32, 32))  # (B, Hq, Hkv)
DECODE_D = 128

PEERS = ("torch-flash", "torch-cudnn", "torch-efficient")
IMPLS = ("cuflash",) + PEERS + ("reference",)
# The materializing reference keeps S and P (and temporaries) in float32: the peers note measured
# about 4 float32 matrices of B*H*Nq*Nk in CuPy's pool. Skip it where that estimate is too large.
REFERENCE_BYTES_PER_PAIR = 16
REFERENCE_BACKWARD_BYTES_PER_PAIR = 24  # P, dP, their product and dS live together
REFERENCE_MAX_BYTES = 40e9
BACKWARD_FLOP_FACTOR = 2.5
L2_FLUSH_BYTES = 256 << 20
L2_CLEAN_BYTES = 96 << 20  # > the H200's 60 MiB L2
FP8 = "float8_e4m3fn"  # --fp8 rows: e4m3 q, k, v with per-(batch, head) descales, o bfloat16
FP8_D = (128, 256)
FP8_N = (8192, 16384)
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, FP8: 2.0**-8}  # (FP8: o's bfloat16)
ITEMSIZE = {"bfloat16": 2, "float16": 2, FP8: 1}
DEVICE = "cuda"  # torch device of the inputs


def _pair_count(causal, nq, nk):
    """Exact (query, key) pairs per head, from the package's own mask accounting."""
    try:
        from cuflash.core.masks import pair_count
    except ImportError:  # run as `python benchmarks/peers.py` from a checkout
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from cuflash.core.masks import pair_count
    return pair_count(causal, nq, nk)


@dataclass(frozen=True)
class Case:
    """One shape of one operation; layout (B, H, N, d)."""

    op: str  # "fwd", "bwd" or "decode"
    dtype: str
    d: int
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    causal: bool  # torch's is_causal (top-left); cuflash gets causal="top_left"

    @property
    def label(self) -> str:
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}/{self.hkv}"
        mask = " causal" if self.causal else ""
        return f"{self.op} {self.dtype} d={self.d} B={self.b} H={heads} Nq={self.nq} Nk={self.nk}{mask}"

    def flops(self) -> float:
        """Peers' convention: 4*B*H*Nq*Nk*d, halved when causal; backward 2.5x the forward."""
        f = 4.0 * self.b * self.hq * self.nq * self.nk * self.d
        if self.causal:
            f /= 2
        return f * (BACKWARD_FLOP_FACTOR if self.op == "bwd" else 1.0)

    def flops_exact(self) -> float:
        """4 * (pairs the mask really keeps) * d per head, same backward factor."""
        pairs = _pair_count("top_left" if self.causal else None, self.nq, self.nk)
        f = 4.0 * self.b * self.hq * pairs * self.d
        return f * (BACKWARD_FLOP_FACTOR if self.op == "bwd" else 1.0)

    def logical_bytes(self) -> int:
        """Each input read once and each output written once.

        forward/decode: q, k, v read + o written; backward: q, k, v, o, do read + dq, dk, dv written
        (the float32 lse is left out: it is d/2 times smaller than o)."""
        q_elems = self.b * self.hq * self.nq * self.d
        kv_elems = self.b * self.hkv * self.nk * self.d
        if self.dtype == FP8 and self.op == "decode":  # an e4m3 K/V cache: q and o stay 16-bit
            return 2 * q_elems * 2 + 2 * kv_elems
        if self.dtype == FP8:  # e4m3 q, k, v; bfloat16 o
            return q_elems + 2 * kv_elems + 2 * q_elems
        if self.op == "bwd":
            elems = 3 * q_elems + 2 * kv_elems + q_elems + 2 * kv_elems
        else:
            elems = 2 * q_elems + 2 * kv_elems
        return elems * ITEMSIZE[self.dtype]

    def reference_bytes(self) -> int:
        per_pair = REFERENCE_BACKWARD_BYTES_PER_PAIR if self.op == "bwd" else REFERENCE_BYTES_PER_PAIR
        return per_pair * self.b * self.hq * self.nq * self.nk


def forward_grid(ds=GRID_D, ns=GRID_N, dtypes=("bfloat16",)):
    cases = []
    for dtype in dtypes:
        for d in ds:
            for n in ns:
                for causal in (False, True):
                    h = MODEL_WIDTH // d
                    cases.append(Case("fwd", dtype, d, TOKENS // n, h, h, n, n, causal))
    return cases


def parse_decode_shapes(text):
    """--decode-shapes: a comma list of BxHqxHkvxL or BxHqxHkvxLxd (one bf16 query token per
    sequence; d defaults to DECODE_D) -> [(b, hq, hkv, L, d)]; ValueError naming the bad item."""
    shapes = []
    for item in (t for t in text.split(",") if t):
        parts = item.split("x")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (4, 5) or min(nums) < 1 or nums[1] % nums[2]:
            raise ValueError(f"--decode-shapes: {item!r} is not BxHqxHkvxL[xd] with Hkv dividing Hq")
        b, hq, hkv, n = nums[:4]
        shapes.append((b, hq, hkv, n, nums[4] if len(nums) == 5 else DECODE_D))
    return shapes


def build_plan(ops=("fwd",), quick=False, d_filter=None, n_filter=None, dtypes=None, decode_shapes=None, fp8=False):
    """The list of Cases to run, in order. `quick` keeps a few shapes for a smoke run. `dtypes`
    (fwd/bwd): every head dim in each of these dtypes, instead of the default grid (bf16 at every
    head dim, fp16 at d=128 only, which keeps the final check's run under its time limit).
    `decode_shapes` ((b, hq, hkv, L, d) each): these decode shapes instead of the issue's grid.
    `fp8`: each bfloat16 forward case at a head dim of FP8_D and a length of FP8_N is followed by
    the same shape in FP8."""
    if quick:
        base = forward_grid(ds=(64, 128), ns=(1024, 4096))
        decode = [Case("decode", "bfloat16", DECODE_D, 8, 32, 8, 1, 4096, False),
                  Case("decode", "bfloat16", DECODE_D, 8, 32, 32, 1, 4096, False)]
    else:
        base = (forward_grid(dtypes=tuple(dtypes)) if dtypes
                else forward_grid() + forward_grid(ds=(128,), dtypes=("float16",)))
        decode = [Case("decode", "bfloat16", DECODE_D, b, hq, hkv, 1, L, False)
                  for L in DECODE_LENGTHS for (b, hq, hkv) in DECODE_HEADS]
    if decode_shapes:
        decode = [Case("decode", "bfloat16", d, b, hq, hkv, 1, L, False) for b, hq, hkv, L, d in decode_shapes]
    plan = []
    for op in ops:
        if op == "fwd":
            plan += base
        elif op == "bwd":
            plan += [Case("bwd", c.dtype, c.d, c.b, c.hq, c.hkv, c.nq, c.nk, c.causal) for c in base]
        elif op == "decode":
            plan += decode
        else:
            raise ValueError(f"--ops: unknown op {op!r}; expected fwd, bwd or decode")
    if d_filter:
        plan = [c for c in plan if c.d in d_filter]
    if n_filter:
        plan = [c for c in plan if c.nk in n_filter]
    if fp8:
        plan = [x for c in plan for x in ([c, Case(c.op, FP8, c.d, c.b, c.hq, c.hkv, c.nq, c.nk, c.causal)]
                                          if c.op == "fwd" and c.dtype == "bfloat16" and c.d in FP8_D
                                          and c.nk in FP8_N else [c])]
    return plan


def judge(cand_err, peer_err, checked_scale, cand_vs_peer, full_scale, unit_roundoff, finite=True):
    """"ok" or "mismatch" for a candidate's output.

    cand_err / peer_err: max abs error of the candidate / the peer against float64 on the checked
    part (sampled rows, or one head's gradients); checked_scale: max abs of the float64 result
    there. The candidate may be off by 2x the peer's error plus one rounding. cand_vs_peer: max abs
    difference between the two on the whole tensor, whose max abs is full_scale; errors grow with
    the values, so the checked errors are carried over relative to their scale: the difference
    may reach 3x the peer's relative error (2x for the candidate, 1x for the peer) plus one
    rounding, times full_scale."""
    if not finite or any(map(math.isnan, (cand_err, cand_vs_peer))):
        return "mismatch"
    if cand_err > 2.0 * peer_err + unit_roundoff * checked_scale:
        return "mismatch"
    peer_rel = peer_err / checked_scale if checked_scale > 0 else peer_err
    if cand_vs_peer > (3.0 * peer_rel + unit_roundoff) * max(full_scale, checked_scale):
        return "mismatch"
    return "ok"


def record(case: Case, impl: str, status: str, ms=None, **extra):
    """One row of the JSON's "bench" list."""
    row = {"op": case.op, "impl": impl, "dtype": case.dtype, "d": case.d, "b": case.b,
           "hq": case.hq, "hkv": case.hkv, "nq": case.nq, "nk": case.nk, "causal": case.causal,
           "ms": ms, "tflops": None, "tbps": None, "tflops_exact": None,
           "max_abs_err_vs_flash": None, "status": status}
    if ms:
        row["tflops"] = case.flops() / (ms * 1e-3) / 1e12
        row["tflops_exact"] = case.flops_exact() / (ms * 1e-3) / 1e12
        row["tbps"] = case.logical_bytes() / (ms * 1e-3) / 1e12
    row.update(extra)
    return row


# --------------------------------------------------------------------------------------------
# GPU side: everything below imports torch / CuPy inside functions.


class Timer:
    """CUDA-event timing on torch's current stream with an L2 flush before each repeat.

    The flush writes 256 MiB, then reads another buffer larger than L2 so the cache holds clean
    lines: otherwise the op would pay for writing the flush's dirty lines back. With
    ``hide_launch`` a GPU spin is queued before the start event, so the host's launch overhead
    (Python, argument checks) overlaps it and the events see device time only."""

    SPIN_CYCLES = 1_000_000  # about 0.5 ms at the H200's 1.98 GHz

    def __init__(self, warmup, repeats, seconds_per_impl, hide_launch=True):
        import torch

        self.torch = torch
        self.warmup = warmup
        self.repeats = repeats
        self.seconds = seconds_per_impl
        self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
        self.clean_buf = torch.ones(L2_CLEAN_BYTES, dtype=torch.uint8, device=DEVICE)
        self.spin = getattr(torch.cuda, "_sleep", None) if hide_launch else None

    def flush(self):
        self.flush_buf.zero_()
        self.clean_buf.max()
        if self.spin is not None:
            self.spin(self.SPIN_CYCLES)

    def __call__(self, fn):
        """(median ms, repeats) of fn(); fn runs on torch's current stream."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        # One timed call sizes the repeat count so a slow implementation stays within budget.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        first = start.elapsed_time(end)
        n = max(3, min(self.repeats, int(self.seconds * 1e3 / max(first, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in events:
            self.flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events), n


def measure_ceilings(timer):
    import torch

    read = read_ceiling(timer)
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms, _ = timer(lambda: torch.mm(a, b))
    matmul = 2.0 * n**3 / (ms * 1e-3) / 1e12
    del a, b
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms, _ = timer(lambda: dst.copy_(src))
    copy = 2.0 * (1 << 30) / (ms * 1e-3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": matmul, "copy_tbps": copy, "read_tbps": read}


# A read-only stream (the decode kernels' traffic without their math): 16-byte streaming loads,
# UNROLL of them in flight per thread, one word written per thread so the loads are not dead.
# CHUNKED: each block reads its own contiguous share of the buffer (as a decode block streams its
# (sequence, head)'s cache); else a grid-stride loop (every block in every DRAM page).
_READ_KERNEL = r"""
template <int UNROLL, bool CHUNKED>
__global__ void read_only(const uint4* __restrict__ src, long long n, unsigned* __restrict__ sink) {
    unsigned acc = 0;
    long long i, end, stride;
    if (CHUNKED) {
        const long long per = (n + gridDim.x - 1) / gridDim.x;
        i = blockIdx.x * per + threadIdx.x;
        end = min(n, (blockIdx.x + 1) * per);
        stride = blockDim.x;
    } else {
        i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        end = n;
        stride = (long long)gridDim.x * blockDim.x;
    }
    for (; i + (UNROLL - 1) * stride < end; i += UNROLL * stride) {
        uint4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) x[u] = __ldcs(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
    for (; i < end; i += stride) { uint4 x = __ldcs(src + i); acc ^= x.x ^ x.y ^ x.z ^ x.w; }
    sink[(long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""
READ_BYTES = 4 << 30  # about 0.9 ms at the H200's rate: the launch's ramp is a small share
READ_CONFIGS = [(chunked, unroll, threads, blocks_per_sm) for chunked in (True, False) for unroll in (4, 8)
                for threads, blocks_per_sm in ((256, 4), (256, 8), (512, 2), (512, 4))]


def torch_stream_ptr() -> int:
    import torch

    return torch.cuda.current_stream().cuda_stream


def read_ceiling(timer, detail=None) -> float:
    """TB/s of the fastest read-only stream over READ_CONFIGS: the device's read rate, which the
    copy's read + write rate understates for decoding (the highest a plain kernel reached here,
    not a proven peak)."""
    import cupy

    names = [f"read_only<{u}, {'true' if c else 'false'}>" for c, u, _, _ in READ_CONFIGS]
    module = cupy.RawModule(code=_READ_KERNEL, options=("-std=c++17",), name_expressions=sorted(set(names)))
    src = cupy.empty(READ_BYTES // 4, dtype=cupy.uint32)
    n = READ_BYTES // 16  # 16-byte units
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    sink = cupy.empty(max(t * b for _, _, t, b in READ_CONFIGS) * sms, dtype=cupy.uint32)
    best = 0.0
    from cuflash.api.interop import external_stream

    with external_stream(torch_stream_ptr(), cupy.cuda.Device().id):  # between the timer's events
        src[:] = 0x5A5A5A5A  # on this stream, before the timed reads
        for name, (_, _, threads, blocks_per_sm) in zip(names, READ_CONFIGS):
            fn = module.get_function(name)
            ms, _ = timer(lambda: fn((blocks_per_sm * sms,), (threads,), (src, cupy.int64(n), sink)))
            tbps = READ_BYTES / (ms * 1e-3) / 1e12
            best = max(best, tbps)
            if detail is not None:
                detail.append((name, threads, blocks_per_sm, tbps))
    del src, sink
    cupy.get_default_memory_pool().free_all_blocks()
    return best


def sample_rows(nq, seed):
    """Query rows to check against float64: tile edges, both ends, and random rows."""
    import random

    edges = {0, 1, 63, 64, 127, 128, 129, nq // 2, nq - 129, nq - 128, nq - 65, nq - 2, nq - 1}
    rows = {r for r in edges if 0 <= r < nq}
    rng = random.Random(seed)
    while len(rows) < min(nq, 24):
        rows.add(rng.randrange(nq))
    return sorted(rows)


def exact_rows(q, k, v, rows, causal, scale):
    """float64 attention for the given query rows of every (batch, head): (B, Hq, R, d)."""
    import torch

    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    idx = torch.tensor(rows, device=q.device)
    out = torch.empty((b, hq, len(rows), d), dtype=torch.float64, device=q.device)
    cols = torch.arange(nk, device=q.device)
    for bi in range(b):  # one batch at a time keeps decode's long K/V caches small in float64
        qs = q[bi][:, idx, :].double().reshape(hkv, group * len(rows), d)
        s = torch.matmul(qs, k[bi].double().transpose(-1, -2)) * scale  # (Hkv, G*R, Nk)
        if causal:  # top-left: key j visible to row i iff j <= i
            visible = cols[None, :] <= idx[:, None]  # (R, Nk)
            s = s.reshape(hkv, group, len(rows), nk).masked_fill(~visible, -math.inf).reshape(s.shape)
        p = torch.softmax(s, dim=-1)
        out[bi] = torch.matmul(p, v[bi].double()).reshape(hq, len(rows), d)
    return out


def quantize_e4m3(x):
    """(x8 float8_e4m3fn, descale float32 (B, H)) of a (B, H, N, d) tensor: each (batch, head)'s
    amax maps to e4m3's largest finite value, 448 (cuflash.fp8.quantize's per-head scales)."""
    import torch

    amax = x.float().abs().amax(dim=(2, 3))
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    x8 = (x.float() / descale[..., None, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x8, descale


def emulated_rows_fp8(q8, k8, v8, qd, kd, vd, rows, causal, scale):
    """An FP8 kernel's arithmetic for the given query rows (cuflash.fp8.emulate_attention's, P
    against the row max): float32 scores of the e4m3 values times scale * qd * kd, P = exp(S - m)
    rounded to e4m3, o = (P8 v8) * vd / l, in float64 on the GPU: (B, Hq, R, d)."""
    import torch

    b, hq, nq, d = q8.shape
    hkv, nk = k8.shape[1], k8.shape[2]
    group = hq // hkv
    idx = torch.tensor(rows, device=q8.device)
    out = torch.empty((b, hq, len(rows), d), dtype=torch.float64, device=q8.device)
    cols = torch.arange(nk, device=q8.device)
    heads = torch.arange(hq, device=q8.device) // group
    for bi in range(b):  # (float8 tensors cast before indexing: not every torch indexes float8)
        qs = q8[bi].double()[:, idx, :]  # (Hq, R, d)
        kb, vb = k8[bi].double()[heads], v8[bi].double()[heads]
        s = torch.matmul(qs, kb.transpose(-1, -2)).float().double()
        factor = (scale * qd[bi].double() * kd[bi][heads].double()).float().double()
        s = (s * factor[:, None, None]).float().double()
        if causal:
            s = s.masked_fill(~(cols[None, :] <= idx[:, None]), -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m).float()
        ell = p.double().sum(dim=-1, keepdim=True)
        p8 = p.to(torch.float8_e4m3fn).double()
        acc = torch.matmul(p8, vb).float().double()
        out[bi] = acc * vd[bi][heads].double()[:, None, None] / ell
    return out


def exact_backward_slice(q, k, v, do, bi, kh, causal, scale, chunk=2048):
    """float64 (dq (G, Nq, d), dk (Nk, d), dv (Nk, d)) of batch bi, K/V head kh and its query heads."""
    import torch

    hq, nq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    qh = q[bi, kh * group:(kh + 1) * group].double()
    doh = do[bi, kh * group:(kh + 1) * group].double()
    kk, vv = k[bi, kh].double(), v[bi, kh].double()
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kk)
    dv = torch.zeros_like(vv)
    cols = torch.arange(nk, device=q.device)
    for r0 in range(0, nq, chunk):
        r1 = min(nq, r0 + chunk)
        s = torch.matmul(qh[:, r0:r1], kk.T) * scale  # (G, r, Nk)
        if causal:
            rows = torch.arange(r0, r1, device=q.device)
            s = s.masked_fill(~(cols[None, :] <= rows[:, None]), -math.inf)
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, vv)
        dv += torch.einsum("grn,grd->nd", p, doh[:, r0:r1])
        dp = torch.matmul(doh[:, r0:r1], vv.T)
        ds = p * (dp - (doh[:, r0:r1] * o).sum(-1, keepdim=True))
        dq[:, r0:r1] = torch.matmul(ds, kk) * scale
        dk += torch.einsum("grn,grd->nd", ds, qh[:, r0:r1]) * scale
    return dq, dk, dv


def _torch_dtype(name):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _dtype_name(dtype):
    return "float16" if dtype.name == "float16" else "bfloat16"


def _sdpa_backend(impl):
    from torch.nn.attention import SDPBackend

    return {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
            "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]


def _refusal(exc, caught):
    """torch explains a refused backend in warnings; keep them with the error."""
    why = [str(w.message).splitlines()[0] for w in caught]
    return "; ".join([f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"] + why)[:600]


class Runner:
    def __init__(self, args, timer):
        import cupy
        import torch

        import cuflash

        self.args = args
        self.timer = timer
        self.torch = torch
        self.cupy = cupy
        self.cuflash = cuflash
        try:
            from cuflash.backends import reference
        except ImportError as exc:
            reference = None
            self.reference_missing = f"cuflash.backends.reference is not importable: {exc}"
        self.reference = reference

    # -- helpers ---------------------------------------------------------------------------
    def on_torch_stream(self):
        """Make CuPy launch on torch's current stream so both sit between the same events."""
        from cuflash.api.interop import external_stream

        return external_stream(torch_stream_ptr(), self.cupy.cuda.Device().id)

    def as_cupy(self, t):
        with self.on_torch_stream():
            a = self.cupy.from_dlpack(t)
        if a.data.ptr != t.data_ptr():
            raise RuntimeError("cupy.from_dlpack copied the tensor; the comparison needs one buffer")
        return a

    def as_torch(self, a):
        try:
            return self.torch.from_dlpack(a)
        except Exception:  # noqa: BLE001 - a DLPack without bfloat16: move the bits as int16
            if a.dtype.itemsize != 2:
                raise
            return self.torch.from_dlpack(a.view(self.cupy.int16)).view(_torch_dtype(_dtype_name(a.dtype)))

    def peak_extra_bytes_torch(self, fn):
        torch = self.torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - before

    def peak_extra_bytes_cupy(self, fn):
        """The most bytes fn's own allocations held at once (a CuPy memory hook: the asv suite's
        peak_live_bytes, so both report the same quantity)."""
        suites = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks")
        if suites not in sys.path:
            sys.path.append(suites)
        from bench_attention import peak_live_bytes

        self.torch.cuda.synchronize()
        return peak_live_bytes(self.cupy, fn)

    def free(self):
        self.torch.cuda.synchronize()
        self.cupy.get_default_memory_pool().free_all_blocks()
        self.torch.cuda.empty_cache()

    def inputs(self, case, seed):
        torch = self.torch
        torch.manual_seed(seed)
        dt = _torch_dtype(case.dtype)
        q = torch.randn(case.b, case.hq, case.nq, case.d, device=DEVICE, dtype=dt)
        k = torch.randn(case.b, case.hkv, case.nk, case.d, device=DEVICE, dtype=dt)
        v = torch.randn(case.b, case.hkv, case.nk, case.d, device=DEVICE, dtype=dt)
        return q, k, v

    def sdpa(self, case, q, k, v):
        import torch.nn.functional as F

        kwargs = {"is_causal": case.causal}
        if case.hq != case.hkv:
            kwargs["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def cuflash_causal(self, case):
        return "top_left" if case.causal else False

    # -- forward and decode ----------------------------------------------------------------
    def _skip_reason(self, case, impl, deadline, needs):
        """Why `impl` is not run for `case` (time budget, reference missing or too large), or None."""
        if time.monotonic() > deadline:
            return "--max-seconds budget spent"
        if impl == "reference":
            if self.reference is None:
                return self.reference_missing
            if case.reference_bytes() > REFERENCE_MAX_BYTES:
                return f"{needs} need about {case.reference_bytes() / 1e9:.0f} GB"
        return None

    def run_forward(self, case, seed, deadline):
        import warnings

        torch = self.torch
        rows_out = []
        q, k, v = self.inputs(case, seed)
        scale = 1.0 / math.sqrt(case.d)
        rows = sample_rows(case.nq, seed)
        exact = exact_rows(q, k, v, rows, case.causal, scale)
        out_scale = exact.abs().max().item()
        u = UNIT_ROUNDOFF[case.dtype]
        qc, kc, vc = (self.as_cupy(t) for t in (q, k, v))

        def fn_for(impl):
            if impl == "cuflash":
                def run():
                    with self.on_torch_stream():
                        return self.cuflash.attention(qc, kc, vc, causal=self.cuflash_causal(case))
                return run, "cupy"
            if impl == "reference":
                def run():
                    with self.on_torch_stream():
                        return self.reference.attention(qc, kc, vc, causal=self.cuflash_causal(case))
                return run, "cupy"
            backend = _sdpa_backend(impl)

            def run():
                from torch.nn.attention import sdpa_kernel

                with sdpa_kernel([backend]):
                    return self.sdpa(case, q, k, v)
            return run, "torch"

        # Peers first, so the candidates are judged against torch-flash's output.
        order = [i for i in PEERS + ("cuflash", "reference") if i in self.args.impls]
        check_out, check_peer, peer_err = None, None, None
        for impl in order:
            skip = self._skip_reason(case, impl, deadline, "S and P")
            if skip:
                rows_out.append(record(case, impl, "skipped", reason=skip))
                continue
            run, lib = fn_for(impl)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        measure = self.peak_extra_bytes_cupy if lib == "cupy" else self.peak_extra_bytes_torch
                        o, peak = measure(run)
                    except NotImplementedError as exc:
                        rows_out.append(record(case, impl, "unsupported", reason=str(exc)[:600]))
                        continue
                    except RuntimeError as exc:
                        if "out of memory" in str(exc).lower() or impl not in PEERS:
                            raise
                        rows_out.append(record(case, impl, "skipped", reason=_refusal(exc, caught)))
                        continue
                ot = self.as_torch(o) if lib == "cupy" else o
                finite = bool(torch.isfinite(ot).all().item())
                err = (ot[:, :, rows, :].double() - exact).abs().max().item()
                if check_out is None:  # the first peer that ran is the yardstick
                    check_out, check_peer, peer_err = ot, impl, err
                diff = (ot.float() - check_out.float())
                vs_peer = diff.abs().max().item()
                rel = (diff.double().norm() / check_out.double().norm()).item()
                del diff
                if impl in ("cuflash", "reference"):
                    full_scale = check_out.abs().max().item()
                    status = judge(err, peer_err, out_scale, vs_peer, full_scale, u, finite)
                else:
                    status = "ok" if finite else "mismatch"
                if ot is not check_out:
                    del o, ot
                ms, n = self.timer(run)
                rows_out.append(record(case, impl, status, ms, max_abs_err_vs_flash=vs_peer,
                                       rel_err_vs_flash=rel, check_peer=check_peer,
                                       max_abs_err_vs_exact_sampled=err, out_max_abs=out_scale,
                                       peak_extra_bytes=peak, repeats=n))
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the run
                oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
                rows_out.append(record(case, impl, "skipped" if oom else "error",
                                       reason=f"{type(exc).__name__}: {str(exc)[:500]}"))
            finally:
                self.free()
        del q, k, v, qc, kc, vc, check_out
        self.free()
        return rows_out

    # -- forward with float8_e4m3fn inputs ----------------------------------------------------
    def run_forward_fp8(self, case, seed, deadline):
        """cuflash's e4m3 kernel on the case's shape (per-(batch, head) descales, o bfloat16),
        checked against float64 of the dequantized values on sampled rows (module docstring);
        torch's SDPA backends and the reference: "unsupported" rows."""
        torch = self.torch
        rows_out = []
        for impl in (i for i in PEERS + ("reference",) if i in self.args.impls):
            rows_out.append(record(case, impl, "unsupported", reason="takes no float8_e4m3fn inputs"))
        if "cuflash" not in self.args.impls:
            return rows_out
        if time.monotonic() > deadline:
            return rows_out + [record(case, "cuflash", "skipped", reason="--max-seconds budget spent")]
        q, k, v = self.inputs(Case(case.op, "bfloat16", case.d, case.b, case.hq, case.hkv, case.nq, case.nk,
                                   case.causal), seed)
        (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(x) for x in (q, k, v))
        del q, k, v
        deq = [x8.float() * dd[..., None, None] for x8, dd in ((q8, qd), (k8, kd), (v8, vd))]
        scale = 1.0 / math.sqrt(case.d)
        rows = sample_rows(case.nq, seed)
        exact = exact_rows(*deq, rows, case.causal, scale)
        del deq
        emulated = emulated_rows_fp8(q8, k8, v8, qd, kd, vd, rows, case.causal, scale)
        emu_err = (emulated - exact).abs().max().item()
        out_scale = exact.abs().max().item()
        args = [self.as_cupy(x.view(torch.uint8)) for x in (q8, k8, v8)]
        descales = dict(zip(("q_descale", "k_descale", "v_descale"), (self.as_cupy(x) for x in (qd, kd, vd))))

        def run():
            with self.on_torch_stream():
                return self.cuflash.attention(*args, causal=self.cuflash_causal(case), **descales)
        try:
            try:
                o, peak = self.peak_extra_bytes_cupy(run)
            except NotImplementedError as exc:
                return rows_out + [record(case, "cuflash", "unsupported", reason=str(exc)[:600])]
            ot = self.as_torch(o)
            finite = bool(torch.isfinite(ot).all().item())
            err = (ot[:, :, rows, :].double() - exact).abs().max().item()
            ok = finite and err <= 2.0 * emu_err + UNIT_ROUNDOFF[FP8] * out_scale
            del o, ot
            ms, n = self.timer(run)
            rows_out.append(record(case, "cuflash", "ok" if ok else "mismatch", ms,
                                   max_abs_err_vs_exact_sampled=err, emulated_err_vs_exact_sampled=emu_err,
                                   out_max_abs=out_scale, peak_extra_bytes=peak, repeats=n))
        except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
            oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
            rows_out.append(record(case, "cuflash", "skipped" if oom else "error",
                                   reason=f"{type(exc).__name__}: {str(exc)[:500]}"))
        finally:
            self.free()
        return rows_out

    # -- backward --------------------------------------------------------------------------
    def run_backward(self, case, seed, deadline):
        import warnings

        torch = self.torch
        rows_out = []
        q, k, v = self.inputs(case, seed)
        do = torch.randn_like(q)
        scale = 1.0 / math.sqrt(case.d)
        bi, kh = case.b - 1, case.hkv - 1  # the last slice: catches batch/head indexing errors
        group = case.hq // case.hkv
        exact = exact_backward_slice(q, k, v, do, bi, kh, case.causal, scale)
        scales = [g.abs().max().item() for g in exact]
        u = UNIT_ROUNDOFF[case.dtype]

        def slices(grads):
            dq, dk, dv = grads
            return dq[bi, kh * group:(kh + 1) * group], dk[bi, kh], dv[bi, kh]

        order = [i for i in PEERS + ("cuflash", "reference") if i in self.args.impls]
        check, check_peer, peer_errs = None, None, None
        for impl in order:
            skip = self._skip_reason(case, impl, deadline, "P, dP and dS")
            if skip:
                rows_out.append(record(case, impl, "skipped", reason=skip))
                continue
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        if impl == "cuflash":
                            qc, kc, vc, doc = (self.as_cupy(t) for t in (q, k, v, do))
                            with self.on_torch_stream():
                                _, vjp = self.cuflash.attention_vjp(qc, kc, vc, causal=self.cuflash_causal(case))

                            def run():
                                with self.on_torch_stream():
                                    return vjp(doc)
                            grads, peak = self.peak_extra_bytes_cupy(run)
                            grads = tuple(self.as_torch(g) for g in grads)
                        elif impl == "reference":
                            qc, kc, vc, doc = (self.as_cupy(t) for t in (q, k, v, do))
                            ref, causal = self.reference, self.cuflash_causal(case)
                            with self.on_torch_stream():
                                o_ref, lse_ref = ref.attention(qc, kc, vc, causal=causal, return_lse=True)

                            def run():
                                with self.on_torch_stream():
                                    return ref.attention_backward(doc, qc, kc, vc, o_ref, lse_ref, causal=causal)
                            grads, peak = self.peak_extra_bytes_cupy(run)
                            grads = tuple(self.as_torch(g) for g in grads)
                        else:
                            from torch.nn.attention import sdpa_kernel

                            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                            with sdpa_kernel([_sdpa_backend(impl)]):
                                o = self.sdpa(case, *leaves)

                            def run():
                                return torch.autograd.grad(o, leaves, do, retain_graph=True)
                            grads, peak = self.peak_extra_bytes_torch(run)
                    except NotImplementedError as exc:
                        rows_out.append(record(case, impl, "unsupported", reason=str(exc)[:600]))
                        continue
                    except RuntimeError as exc:
                        if "out of memory" in str(exc).lower() or impl not in PEERS:
                            raise
                        rows_out.append(record(case, impl, "skipped", reason=_refusal(exc, caught)))
                        continue
                finite = all(bool(torch.isfinite(g).all().item()) for g in grads)
                errs = [(g.double() - e).abs().max().item() for g, e in zip(slices(grads), exact)]
                if check is None:
                    check, check_peer, peer_errs = grads, impl, errs
                vs_peer, num, den = [], 0.0, 0.0
                for g, c in zip(grads, check):
                    diff = g.float() - c.float()
                    vs_peer.append(diff.abs().max().item())
                    num += diff.double().pow(2).sum().item()
                    den += c.double().pow(2).sum().item()
                    del diff
                rel = math.sqrt(num / den) if den else float("nan")
                if impl in ("cuflash", "reference"):
                    full_scales = [c.abs().max().item() for c in check]
                    verdicts = [judge(e, pe, sc, vp, fs, u, finite)
                                for e, pe, sc, vp, fs in zip(errs, peer_errs, scales, vs_peer, full_scales)]
                    status = "mismatch" if "mismatch" in verdicts else "ok"
                else:
                    status = "ok" if finite else "mismatch"
                ms, n = self.timer(run)
                names = ("dq", "dk", "dv")
                rows_out.append(record(case, impl, status, ms, max_abs_err_vs_flash=max(vs_peer),
                                       rel_err_vs_flash=rel, check_peer=check_peer,
                                       max_abs_err_vs_flash_per_grad=dict(zip(names, vs_peer)),
                                       max_abs_err_vs_exact_slice=dict(zip(names, errs)),
                                       peak_extra_bytes=peak, repeats=n))
            except Exception as exc:  # noqa: BLE001
                oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
                rows_out.append(record(case, impl, "skipped" if oom else "error",
                                       reason=f"{type(exc).__name__}: {str(exc)[:500]}"))
            finally:
                grads = o = run = leaves = vjp = o_ref = lse_ref = None  # noqa: F841 - drop this impl's buffers
                self.free()
        del q, k, v, do, check
        self.free()
        return rows_out


# --------------------------------------------------------------------------------------------
# Output


def write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)  # a run cut short still leaves a whole file


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def table(rows):
    """Per shape: cuflash's rate, each peer's, and cuflash/peer = peer ms / cuflash ms (>1: cuflash faster)."""
    shapes = {}
    for r in rows:
        key = (r["op"], r["dtype"], r["d"], r["b"], r["hq"], r["hkv"], r["nq"], r["nk"], r["causal"])
        shapes.setdefault(key, {})[r["impl"]] = r
    impls = [i for i in IMPLS if any(i in s for s in shapes.values())]
    head = f"{'op':6} {'dtype':8} {'d':>3} {'B':>3} {'H':>5} {'Nq':>5} {'Nk':>5} {'c':1}"
    for i in impls:
        head += f" | {i:>15}" + ("" if i == "cuflash" else f" {'cf/peer':>7}")
    lines = ["rate: TFLOP/s (decode: TB/s); cf/peer = peer ms / cuflash ms; "
             "! mismatch, u unsupported, s skipped, e error", head]
    for key, by in shapes.items():
        op, dtype, d, b, hq, hkv, nq, nk, causal = key
        heads = f"{hq}" if hq == hkv else f"{hq}/{hkv}"
        line = f"{op:6} {dtype:8} {d:>3} {b:>3} {heads:>5} {nq:>5} {nk:>5} {'y' if causal else 'n'}"
        cf = by.get("cuflash")
        for i in impls:
            r = by.get(i)
            if r is None:
                cell, ratio = "", ""
            else:
                rate = r["tbps"] if op == "decode" else r["tflops"]
                mark = {"ok": "", "mismatch": "!", "unsupported": "u", "skipped": "s", "error": "e"}[r["status"]]
                cell = f"{rate:.1f}{mark}" if rate is not None else mark
                ratio = "-"
                if cf and cf.get("ms") and r.get("ms"):
                    ratio = f"{r['ms'] / cf['ms']:.2f}"
            line += f" | {cell:>15}" + ("" if i == "cuflash" else f" {ratio:>7}")
        lines.append(line)
    return "\n".join(lines)


def plan_table(plan):
    lines = [f"{'case':60} {'GFLOP':>10} {'GFLOP exact':>12} {'MB moved':>9} {'ref GB':>7}"]
    for c in plan:
        lines.append(f"{c.label:60} {c.flops() / 1e9:10.1f} {c.flops_exact() / 1e9:12.1f} "
                     f"{c.logical_bytes() / 1e6:9.1f} {c.reference_bytes() / 1e9:7.1f}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON file to write (rewritten after every shape)")
    ap.add_argument("--ops", default="fwd", help="comma list of fwd, bwd, decode (default fwd)")
    ap.add_argument("--quick", action="store_true", help="a few shapes: d 64/128, N 1024/4096, bf16")
    ap.add_argument("--d", default="", help="comma list: keep only these head dims")
    ap.add_argument("--n", default="", help="comma list: keep only these key lengths")
    ap.add_argument("--dtypes", default="",
                    help="comma list of bfloat16, float16: the forward/backward grid at every head dim in each "
                         "(default: bf16 everywhere, fp16 at d=128)")
    ap.add_argument("--decode-shapes", default="",
                    help="comma list of BxHqxHkvxL[xd]: these decode shapes (bf16, one token) instead of the grid")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30, help="most timed repeats per implementation")
    ap.add_argument("--seconds-per-impl", type=float, default=1.5,
                    help="fewer repeats (at least 3) for implementations slower than this in total")
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop starting new work after this long; the JSON is still written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count-launch", action="store_true",
                    help="let the events include host launch gaps (no GPU spin before each repeat)")
    ap.add_argument("--fp8", action="store_true",
                    help=f"after each bf16 forward case at d in {FP8_D}, N in {FP8_N}: the same shape with "
                         "float8_e4m3fn inputs (cuflash's e4m3 kernel)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (shapes, FLOPs); no GPU")
    args = ap.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    if not args.ops or set(args.ops) - {"fwd", "bwd", "decode"}:
        ap.error(f"--ops: expected a comma list of fwd, bwd, decode; got {','.join(args.ops)!r}")
    args.impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; expected some of {IMPLS}")
    args.d = [int(x) for x in args.d.split(",") if x]
    args.n = [int(x) for x in args.n.split(",") if x]
    args.dtypes = [t for t in args.dtypes.split(",") if t]
    try:
        args.decode_shapes = parse_decode_shapes(args.decode_shapes)
    except ValueError as exc:
        ap.error(str(exc))
    if set(args.dtypes) - {"bfloat16", "float16"}:
        ap.error(f"--dtypes: expected a comma list of bfloat16, float16; got {','.join(args.dtypes)!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_seconds
    plan = build_plan(args.ops, args.quick, args.d, args.n, args.dtypes, args.decode_shapes, args.fp8)
    if args.dry_run:
        print(plan_table(plan))
        print(f"{len(plan)} cases, {sum(c.flops() for c in plan) / 1e12:.1f} TFLOP in one pass of each")
        if args.out:
            write_json(args.out, {"dry_run": True, "plan": [dict(asdict(c), flops=c.flops(),
                                                                  flops_exact=c.flops_exact(),
                                                                  logical_bytes=c.logical_bytes(),
                                                                  reference_bytes=c.reference_bytes())
                                                             for c in plan]})
        return 0

    import cupy
    import torch

    timer = Timer(args.warmup, args.repeats, args.seconds_per_impl, hide_launch=not args.count_launch)
    doc = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "torch": torch.__version__, "cupy": cupy.__version__, "args": sys.argv[1:],
           "timing": "CUDA events, median; L2 flushed (256 MiB written, 96 MiB read) before each "
                     + ("repeat" if args.count_launch else "repeat, then a GPU spin hides host launch time"),
           "ceilings": measure_ceilings(timer), "bench": [], "complete": False}
    print(f"{doc['device']}: matmul {doc['ceilings']['matmul_tflops']:.0f} TFLOP/s, "
          f"copy {doc['ceilings']['copy_tbps']:.2f} TB/s (read + write), read {doc['ceilings']['read_tbps']:.2f} TB/s",
          flush=True)
    runner = Runner(args, timer)
    for i, case in enumerate(plan):
        if time.monotonic() > deadline:
            doc["not_run"] = [c.label for c in plan[i:]]
            print(f"--max-seconds reached: {len(plan) - i} cases not run", flush=True)
            break
        run = (runner.run_backward if case.op == "bwd" else runner.run_forward_fp8 if case.dtype == FP8
               else runner.run_forward)
        rows = run(case, args.seed + i, deadline)
        doc["bench"] += rows
        summary = ", ".join(f"{r['impl']} {_fmt(r['ms'], '.3f')} ms {r['status']}" for r in rows)
        print(f"[{time.monotonic() - started:6.0f}s] {case.label}: {summary}", flush=True)
        if args.out:
            write_json(args.out, doc)
    else:
        doc["complete"] = True
    if args.out:
        write_json(args.out, doc)
    print(table(doc["bench"]))
    mismatches = [r for r in doc["bench"] if r["status"] == "mismatch" and r["impl"] == "cuflash"]
    if mismatches:
        print(f"{len(mismatches)} cuflash result(s) did not match: see status 'mismatch' in the JSON")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
