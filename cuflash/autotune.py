"""Autotuning, the measuring side: compile reports, the correctness check against the float64
reference, CUDA-event timing with a cold L2, the search over a shortlist of legal tiles
(plan.tuning), and ``cuflash.tune`` for tuning shapes ahead of time.

With ``CUFLASH_TUNE=1`` the dispatch autotunes a bucket on first use through GpuTuner (registered
with plan.tuning when this module is imported, as ``import cuflash`` does). Each candidate is
checked against the float64 reference on a small input with the accuracy rule of cuflash.testing
(a candidate that fails to compile, spills or gives a wrong answer is never picked), then timed
with CUDA events on fresh inputs of the caller's shapes (L2 flushed by writing 256 MiB before
every repeat; median). The winner goes to the tuning cache (plan.tuning.TuneCache).
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import testing
from .accounting import format_table, io_model
from .backends import cuda
from .backends.reference import float32_to_bfloat16
from .core import config
from .core.arrays import BFLOAT16, dtype_name
from .core.layout import to_bhsd
from .core.masks import normalize_causal
from .core.problem import Problem, validate_forward
from .kernels import build
from .kernels import device as device_mod
from .kernels.build import get_function
from .plan import device_limits, schedule, tuning
from .plan.device_limits import DeviceLimits, Occupancy, occupancy
from .plan.tuning import (FORWARD_OPS, HOPPER_OPS, TUNED_DTYPES, Candidate, CompileInfo, TuneCache, _cache,
                          _check_op, _memo, _memo_lock, bucket_key, candidates, op_buckets, same_tile, shortlist,
                          spec_for, table_tile, tile_from_dict, violations)

FLUSH_BYTES = 256 * 2**20  # more than 4x the H200's 60 MiB L2


# --------------------------------------------------------------------------- compile reports


_compile_memo: dict = {}
_compile_lock = threading.Lock()


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - only part of a cache key
        return "unknown"


def compile_offline_info(spec, arch: str = "sm_90a", cache: "TuneCache | None" = None) -> CompileInfo:
    """ptxas's register/spill report for spec (NVRTC through cuda.bindings, no GPU), memoized in
    this process and, with ``cache``, across processes (keyed by arch, NVRTC version, source hash)."""

    key = f"{arch}|nvrtc{_nvrtc_version()}|{build.source_hash(spec.source)}|{spec.expression}"
    with _compile_lock:
        hit = _compile_memo.get(key)
    if hit is None and cache is not None:
        rec = cache.compile_record(key)
        if rec is not None:
            hit = rec
    if hit is None:
        try:
            r = build.compile_offline(spec, arch)
            hit = CompileInfo(r.registers, r.spill_stores + r.spill_loads, r.stack_bytes, f"nvrtc {arch} (offline)")
        except build.CompileError as exc:
            hit = CompileInfo(None, 0, 0, f"nvrtc {arch} (offline)", _first_error(str(exc)))
        if cache is not None:
            cache.put_compile_record(key, hit)
    with _compile_lock:
        _compile_memo[key] = hit
    return hit


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()[:300]
    return log.strip().splitlines()[0][:300] if log.strip() else "compile failed"


def compile_device_info(spec) -> CompileInfo:
    """Compile spec for the current GPU (CuPy/NVRTC, as a launch would) and read its attributes."""
    try:
        fn = get_function(spec)
        regs, local = int(fn.num_regs), int(fn.local_size_bytes)
    except Exception as exc:  # noqa: BLE001 - CompileException, or a launch-config error
        return CompileInfo(None, 0, 0, "device", _first_error(str(exc)) or type(exc).__name__)
    return CompileInfo(regs, local, 0, "device")


# --------------------------------------------------------------------------- evaluation


@dataclass
class Evaluation:
    """What the search learned about one candidate."""
    candidate: Candidate
    status: str = "pending"  # illegal, compile failed, spills, does not fit, wrong, timing failed, ok, legal
    detail: str = ""
    compile: CompileInfo | None = None
    occupancy: Occupancy | None = None
    logical_bytes: int | None = None
    time_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_record(self) -> dict:
        c = self.compile
        o = self.occupancy
        return {
            "name": self.candidate.name, "tile": self.candidate.fields(), "status": self.status,
            "detail": self.detail, "registers": c.registers if c else None,
            "spill_bytes": c.spill_bytes if c else None, "smem_bytes": self.candidate.smem_bytes,
            "threads": self.candidate.threads,
            "blocks_per_sm": o.blocks_per_sm if o else None, "warps_per_sm": o.warps_per_sm if o else None,
            "logical_bytes": self.logical_bytes, "time_s": self.time_s,
        }


def evaluate_static(cand: Candidate, limits: DeviceLimits, compile_fn=None, io_fn=None) -> Evaluation:
    """Legality, compile report (when compile_fn is given) and occupancy of one candidate."""
    ev = Evaluation(cand)
    v = violations(cand, limits)
    if v:
        ev.status, ev.detail = "illegal", "; ".join(v)
        return ev
    if io_fn is not None:
        ev.logical_bytes = io_fn(cand)
    regs = None
    if compile_fn is not None:
        try:
            info = compile_fn(cand)
        except Exception as exc:  # noqa: BLE001 - a failed compile disqualifies, nothing more
            info = CompileInfo(None, 0, 0, "?", f"{type(exc).__name__}: {exc}"[:300])
        ev.compile = info
        if info.error is not None:
            ev.status, ev.detail = "compile failed", info.error
            return ev
        if not info.clean:
            ev.status = "spills"
            ev.detail = f"{info.spill_bytes} B spilled, {info.stack_bytes} B stack ({info.how})"
            regs = info.registers
        else:
            regs = info.registers
    ev.occupancy = occupancy(limits, cand.threads, regs, cand.smem_bytes)
    if ev.status == "spills":
        return ev
    if ev.occupancy.blocks_per_sm == 0:
        ev.status, ev.detail = "does not fit", ev.occupancy.limiter
        return ev
    ev.status = "legal"
    return ev


@dataclass
class SearchResult:
    op: str
    hd: int
    evaluations: list
    winner: Evaluation | None
    table: Evaluation | None  # the built-in table's candidate, when it was evaluated

    @property
    def best_tile(self):
        return self.winner.candidate.tile if self.winner else None


def search(cands, limits: DeviceLimits, *, compile_fn, check_fn, time_fn, io_fn=None, progress=None,
           table=None, budget_s: float | None = None) -> SearchResult:
    """Evaluate candidates in order and pick the fastest one that passed every check.

    compile_fn(cand) -> CompileInfo; check_fn(cand) returns None or True when the candidate's
    output is right (False, or any exception, means wrong); time_fn(cand) -> seconds. A candidate
    is a winner only if it is legal, compiles cleanly, fits on an SM, passes the check and has a
    finite positive time. ``progress(i, n, evaluation)`` is called after each candidate."""
    cands = list(cands)
    if not cands:
        raise ValueError("cands: nothing to search")
    op, hd = cands[0].op, cands[0].hd
    t0 = time.monotonic()
    evals = []
    for i, cand in enumerate(cands):
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            ev = Evaluation(cand, "not timed", "time budget spent")
        else:
            ev = evaluate_static(cand, limits, compile_fn, io_fn)
            if ev.status == "legal":
                _check_and_time(ev, check_fn, time_fn)
        evals.append(ev)
        if progress is not None:
            progress(i + 1, len(cands), ev)
    ok = [e for e in evals if e.ok]
    winner = min(ok, key=lambda e: e.time_s) if ok else None
    table_ev = None
    if table is not None:
        table_ev = next((e for e in evals if same_tile(op, e.candidate.tile, table)), None)
    return SearchResult(op, hd, evals, winner, table_ev)


def _check_and_time(ev: Evaluation, check_fn, time_fn):
    try:
        verdict = check_fn(ev.candidate)
    except Exception as exc:  # noqa: BLE001 - AssertionError (wrong values) or a launch failure
        ev.status, ev.detail = "wrong", f"{type(exc).__name__}: {exc}"[:500]
        return
    if verdict is False:
        ev.status, ev.detail = "wrong", "check returned False"
        return
    try:
        t = float(time_fn(ev.candidate))
    except Exception as exc:  # noqa: BLE001
        ev.status, ev.detail = "timing failed", f"{type(exc).__name__}: {exc}"[:500]
        return
    if not (math.isfinite(t) and t > 0):
        ev.status, ev.detail = "timing failed", f"time {t!r}"
        return
    ev.status, ev.time_s = "ok", t


# --------------------------------------------------------------------------- logical traffic


class _IoTile:
    """The two fields io_model reads of a config, for a backward tile (whose smem_bytes differs)."""
    def __init__(self, block_m, block_n, threads, smem):
        self.block_m, self.block_n, self.threads, self._smem = block_m, block_n, threads, smem

    def smem_bytes(self, head_dim, itemsize=2):
        return self._smem


def logical_bytes(cand: Candidate, shape, *, dtype="bfloat16", causal=False, nk=None, hkv=None) -> int:
    """Logical HBM bytes of the pass this candidate's kernel belongs to (accounting.io_model).

    "fwd", "fwd_wgmma": the forward; "bwd", "bwd_wgmma": the whole atomic-dQ backward; "bwd_dq": the
    deterministic dQ kernel alone (each of dq_split blocks per query tile reads Q, dO, LSE, D, K and V)."""

    t = cand.tile
    if cand.op == "fwd":
        return io_model(shape, t, dtype=dtype, causal=causal, pass_="fwd", nk=nk, hkv=hkv).bytes
    if cand.op == "fwd_wgmma":  # same traffic model; the Hopper tile's smem formula has no itemsize
        cfg = _IoTile(t.block_m, t.block_n, cand.threads, cand.smem_bytes)
        return io_model(shape, cfg, dtype=dtype, causal=causal, pass_="fwd", nk=nk, hkv=hkv).bytes
    if cand.op in ("bwd", "bwd_wgmma"):
        cfg = _IoTile(t.block_m, t.block_n, cand.threads, cand.smem_bytes)
        return io_model(shape, cfg, dtype=dtype, causal=causal, pass_="bwd", nk=nk, hkv=hkv).bytes
    cfg = _IoTile(t.dq_block_m, t.dq_block_n, cand.threads, cand.smem_bytes)
    m = io_model(shape, cfg, dtype=dtype, causal=causal, pass_="bwd", nk=nk, hkv=hkv, deterministic=True)
    reads = sum(e.bytes for e in m.entries if "(dQ kernel)" in e.name)
    acc = next(e for e in m.entries if e.name.endswith("dQ accumulator"))
    return t.dq_split * reads + acc.writes * acc.itemsize


# --------------------------------------------------------------------------- GPU tuner


def cuda_median_time(run, *, warmup=2, repeats=10, flush=None, max_total_s=3.0) -> float:
    """Median seconds of run() by CUDA events; ``flush`` (a device buffer) is rewritten before
    every repeat, outside the timed interval, so each repeat starts with a cold L2."""
    import cupy

    for _ in range(warmup):
        run()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeats):
        if flush is not None:
            flush.fill(i & 0xFF)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        if sum(times) > max_total_s and len(times) >= 3:
            break
    return statistics.median(times)


def _random_device(cupy, shape, dtype, rng):

    x = cupy.asarray(rng.standard_normal(shape, dtype=np.float32))
    return float32_to_bfloat16(cupy, x) if np.dtype(dtype) == BFLOAT16 else x.astype(dtype)


def _poisoned(cupy, shape, dtype):
    a = cupy.empty(shape, dtype=dtype)
    if np.dtype(dtype).itemsize == 2:
        a.view(cupy.uint16).fill(0x7FC0)  # NaN in float16 and bfloat16 alike
    else:
        a.fill(np.nan)
    return a


def forward_launcher(op: str):
    """The launch function that takes forward op's tile: cuda.forward would run a HopperTile
    through the mma.sync spec, so the wgmma op launches cuda.forward_wgmma directly."""
    return cuda.forward_wgmma if op == "fwd_wgmma" else cuda.forward


def backward_tile_kwargs(op: str, tile) -> dict:
    """The keyword backends.cuda.backward takes backward op's tile by: the wgmma K/V kernel's
    HopperBwdTile goes to hopper_tile (which also keeps the mma.sync tile out of the way)."""
    return {"hopper_tile": tile} if op == "bwd_wgmma" else {"tile": tile}


class GpuTuner:
    """Autotune one kernel for the shapes of problem p on the current GPU.

    The correctness check runs the candidate on a small problem with p's head dim, dtype, mask
    and GQA grouping (ragged lengths, several tiles) and applies cuflash.testing's rule against the
    float64 reference; timing uses fresh inputs of p's full shapes (extra device memory of about
    one more set of p's inputs and outputs while tuning)."""

    CHECK_N = 549  # > 2 x the largest block_m, and not a multiple of any tile

    def __init__(self, op, p, *, base=None, limits=None, seed=None, cupy=None):
        if cupy is None:  # tests pass a stand-in, so they run where CuPy is not installed
            import cupy
        self.cupy = cupy
        self.op = _check_op(op)
        self.p = p
        self.hd = schedule.head_dim_bucket(p.d)
        self.limits = limits or device_limits.from_cupy()
        if self.hd not in op_buckets(op):
            raise ValueError(f"{op}: head dim {p.d} (bucket {self.hd}) is not one of its buckets {op_buckets(op)}")
        if op in HOPPER_OPS and self.limits.cc != 90:
            raise ValueError(f"{op}: the wgmma kernel needs an sm_90 GPU; {self.limits.name} is cc {self.limits.cc}")
        if op == "bwd_wgmma":

            if not config.hopper_kernels():  # backends.cuda.backward would refuse every hopper_tile
                raise ValueError(f"{op}: {config.KERNELS}=mma_sync turns the wgmma backward off")
        self.base = base
        self.causal = p.causal is not None
        self.rng = np.random.default_rng(seed)
        self.shape = (p.batch, p.hq, p.hkv, p.nq, p.nk, p.d)
        self._check_data = None
        self._time_data = None
        self._flush = None

    # -- candidates
    def candidate_list(self, max_candidates=None):
        table = table_tile(self.op, self.hd)
        if self.op == "bwd_dq":
            base = self.base or schedule.BACKWARD_TILES[self.hd]
        else:
            base = None
        cands = candidates(self.op, self.hd, base)
        return shortlist(cands, max_candidates, self.limits, table)

    def compile(self, cand):
        return compile_device_info(spec_for(cand, self.p.dtype, self.causal))

    # -- correctness on a small problem
    def _small_problem(self):
        if self._check_data is not None:
            return self._check_data

        cp, p = self.cupy, self.p
        # Keep the sign of Nk - Nq (where the causal diagonal sits), bounded.
        nq = min(p.nq, self.CHECK_N)
        nk = nq + min(p.nk - p.nq, self.CHECK_N) if p.nk > p.nq else min(p.nk, self.CHECK_N)
        hkv = 1 if p.group > 1 else 2
        hq = 2
        host = testing.random_inputs(self.rng, (1, hq, nq, p.d), (1, hkv, nk, p.d), p.dtype)
        dev = [cp.asarray(a) for a in host]
        ps = validate_forward(*dev, causal=p.causal, scale=p.scale)
        q4, k4, v4 = (to_bhsd(a, ps, h, n) for a, h, n in zip(dev, (hq, hkv, hkv), (nq, nk, nk)))
        data = {"ps": ps, "host": host, "q4": q4, "k4": k4, "v4": v4}
        if self.op not in FORWARD_OPS:
            do_h = testing.random_array(self.rng, (1, hq, nq, p.d), p.dtype)
            data["do_host"], data["do4"] = do_h, cp.asarray(do_h)
            o4 = _poisoned(cp, q4.shape, p.dtype)
            lse3 = cp.full((1, hq, nq), np.nan, dtype=cp.float32)
            cuda.forward(ps, q4, k4, v4, o4, lse3, tile=schedule.forward_tile(p.d)[1])
            data["o4"], data["lse3"] = o4, lse3
        self._check_data = data
        return data

    def check(self, cand):

        cp, p = self.cupy, self.p
        s = self._small_problem()
        ps = s["ps"]
        if self.op in FORWARD_OPS:
            o4 = _poisoned(cp, s["q4"].shape, p.dtype)
            lse3 = cp.full((1, ps.hq, ps.nq), np.nan, dtype=cp.float32)
            forward_launcher(self.op)(ps, s["q4"], s["k4"], s["v4"], o4, lse3, tile=cand.tile)
            cp.cuda.Device().synchronize()
            testing.assert_forward_accurate(o4, lse3, *s["host"], causal=p.causal, scale=p.scale)
            return True

        grads = [_poisoned(cp, a.shape, p.dtype) for a in (s["q4"], s["k4"], s["v4"])]
        cuda.backward(ps, s["do4"], s["q4"], s["k4"], s["v4"], s["o4"], s["lse3"], *grads,
                              deterministic=self.op == "bwd_dq", **backward_tile_kwargs(self.op, cand.tile))
        cp.cuda.Device().synchronize()
        testing.assert_backward_accurate(grads, s["do_host"], *s["host"], causal=p.causal, scale=p.scale)
        return True

    # -- timing on the caller's shapes
    def _timing_data(self):
        if self._time_data is not None:
            return self._time_data

        cp, p = self.cupy, self.p
        q = _random_device(cp, p.q_shape(), p.dtype, self.rng)
        k = _random_device(cp, p.kv_shape(), p.dtype, self.rng)
        v = _random_device(cp, p.kv_shape(), p.dtype, self.rng)
        pt = validate_forward(q, k, v, causal=p.causal, scale=p.scale, layout=p.layout)
        q4, k4, v4 = to_bhsd(q, pt, pt.hq, pt.nq), to_bhsd(k, pt, pt.hkv, pt.nk), to_bhsd(v, pt, pt.hkv, pt.nk)
        o4 = cp.empty((pt.batch, pt.hq, pt.nq, pt.d), dtype=p.dtype)
        lse3 = cp.empty((pt.batch, pt.hq, pt.nq), dtype=cp.float32)
        data = {"pt": pt, "q4": q4, "k4": k4, "v4": v4, "o4": o4, "lse3": lse3}
        if self.op not in FORWARD_OPS:

            cuda.forward(pt, q4, k4, v4, o4, lse3, tile=schedule.forward_tile(p.d)[1])
            data["do4"] = _random_device(cp, o4.shape, p.dtype, self.rng)
            data["grads"] = (cp.empty_like(o4), cp.empty(k4.shape, dtype=p.dtype), cp.empty(v4.shape, dtype=p.dtype))
        self._time_data = data
        if self._flush is None:
            self._flush = cp.empty(FLUSH_BYTES, dtype=cp.uint8)
        return data

    def time(self, cand):
        t = self._timing_data()
        if self.op in FORWARD_OPS:
            fwd = forward_launcher(self.op)

            def run():
                fwd(t["pt"], t["q4"], t["k4"], t["v4"], t["o4"], t["lse3"], tile=cand.tile)
        else:

            def run():
                cuda.backward(t["pt"], t["do4"], t["q4"], t["k4"], t["v4"], t["o4"], t["lse3"], *t["grads"],
                                      deterministic=self.op == "bwd_dq", **backward_tile_kwargs(self.op, cand.tile))
        return cuda_median_time(run, flush=self._flush)

    def io(self, cand):
        p = self.p
        return logical_bytes(cand, (p.batch, p.hq, p.nq, p.d), dtype=p.dtype, causal=p.causal, nk=p.nk, hkv=p.hkv)

    def run(self, max_candidates=None, progress=None, budget_s=None) -> SearchResult:
        cands = self.candidate_list(max_candidates)
        try:
            return search(cands, self.limits, compile_fn=self.compile, check_fn=self.check, time_fn=self.time,
                          io_fn=self.io, progress=progress, table=table_tile(self.op, self.hd), budget_s=budget_s)
        finally:
            self._time_data = None
            self._flush = None


# --------------------------------------------------------------------------- ahead-of-time tuning


def _problem_for_shape(shape, dtype, causal, hkv=None):

    if len(shape) == 4:
        b, h, n, d = shape
        nk = n
    elif len(shape) == 5:
        b, h, n, nk, d = shape
    else:
        raise ValueError(f"shapes: expected (B, H, N, d) or (B, H, Nq, Nk, d), got {shape!r}")
    for name, x in zip(("B", "H", "N", "Nk", "d"), (b, h, n, nk, d)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"shapes: {name} must be a positive integer, got {x!r}")
    if d % 8:
        raise ValueError(f"shapes: head dim {d} is not a multiple of 8; only the vectorized kernels are tuned")
    hkv = h if hkv is None else hkv
    if h % hkv:
        raise ValueError(f"hkv: {hkv} must divide the {h} query heads")
    dt = _parse_dtype(dtype)
    import cupy

    return Problem(cupy, "bhsd", (int(b),), int(h), int(hkv), int(n), int(nk), int(d), dt,
                   normalize_causal(causal), 1.0 / math.sqrt(d))


def _parse_dtype(dtype):
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return BFLOAT16
    dt = np.dtype(dtype)
    if dt not in TUNED_DTYPES:
        raise TypeError(f"dtype: only float16 and bfloat16 kernels have tiles to tune, got {dtype_name(dt)}")
    return dt


def _text_progress(prefix, stream=None):
    """A progress bar redrawn in place (for a terminal: callers pass none when output is piped)."""
    stream = stream or sys.stderr

    def report(i, n, ev):
        width = 24
        filled = width * i // n
        t = f"{ev.time_s * 1e3:.4g} ms" if ev.time_s is not None else ev.status
        print(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {i}/{n} {ev.candidate.name}: {t}"[:160].ljust(100),
              end="\n" if i == n else "", file=stream, flush=True)

    return report


def ops_that_run(hd: int, cc: int) -> tuple:
    """The tuned kernels that backends.cuda.forward and backends.cuda.backward launch for 16-bit,
    16-byte-aligned inputs of head-dim bucket hd on compute capability cc (the conditions of
    plan.hopper.applies / backward_applies): the forward, "fwd_wgmma" or "fwd", and the backward's
    K/V kernel, "bwd_wgmma" or "bwd"."""

    hopper = cc == 90 and config.hopper_kernels()
    fwd = "fwd_wgmma" if hopper and hd in op_buckets("fwd_wgmma") else "fwd"
    bwd = "bwd_wgmma" if hopper and hd in op_buckets("bwd_wgmma") else "bwd"
    return (fwd, bwd)


def _current_device_cc() -> int:
    return device_mod.current().compute_capability


def tune(*shapes, ops="auto", causal=False, dtype="bfloat16", hkv=None, max_candidates=None,
         force=False, progress=True):
    """Autotune the tiles for these shapes ahead of time and store the winners in the cache.

    shapes: (B, H, N, d) tuples (or (B, H, Nq, Nk, d)); ops: "auto" (the tuned kernels that run for
    each shape on this GPU, see :func:`ops_that_run`) or any of "fwd", "fwd_wgmma", "bwd",
    "bwd_dq", "bwd_wgmma"; max_candidates: how many candidates to time per bucket (None: every legal one).
    Buckets already in the cache are skipped unless ``force``. Returns {bucket key string:
    SearchResult or None (cached)}. The winners are used when CUFLASH_TUNE is 1 or "cached".
    Needs a CUDA device (sm_90 for "fwd_wgmma" and "bwd_wgmma"); an op that cannot run for a shape raises
    ValueError before anything is timed."""
    if not shapes:
        raise ValueError("shapes: give at least one (B, H, N, d) shape")
    auto = ops == "auto"
    if isinstance(ops, str) and not auto:
        ops = (ops,)
    if not auto:
        for op in ops:
            _check_op(op)
    problems = [_problem_for_shape(tuple(shape), dtype, causal, hkv) for shape in shapes]
    cc = _current_device_cc()
    plans = []
    for p in problems:  # every explicit request is checked before anything is timed
        hd = schedule.head_dim_bucket(p.d)
        p_ops = ops_that_run(hd, cc) if auto else tuple(ops)
        for op in (op for op in HOPPER_OPS if op in p_ops):
            if cc != 90:
                raise ValueError(f"ops: {op} needs an sm_90 GPU; this one is cc {cc}")
            if hd not in op_buckets(op):
                raise ValueError(f"ops: {op} runs for head-dim buckets {op_buckets(op)}, not d={p.d}")
        plans.append((p, p_ops))
    out = {}
    cache = _cache()
    for p, p_ops in plans:
        device = device_mod.current().name
        kv_tile = None
        for op in p_ops:
            key = bucket_key(op, device, p.dtype, p.d, p.causal is not None, p.nq, p.nk)
            if op == "bwd_dq" and kv_tile is None:  # the main kernel's tile the dQ kernel runs beside
                kv_tile = cache.winner(bucket_key("bwd", device, p.dtype, p.d, p.causal is not None, p.nq, p.nk))[1]
            found, tile = cache.winner(key)
            if found and not force:
                out[str(key)] = None
                if op == "bwd":
                    kv_tile = tile
                continue
            tuner = GpuTuner(op, p, base=kv_tile if op == "bwd_dq" else None)
            label = f"{op} d{p.d} N{p.nq}{' causal' if p.causal else ''}"
            result = tuner.run(max_candidates=max_candidates,
                               progress=_text_progress(label) if progress and sys.stderr.isatty() else None)
            cache.put(key, result, shape=tuner.shape, device_limits_dict=tuner.limits.to_dict())
            stored = cache.winner(key)[1]
            with _memo_lock:
                _memo[(str(cache.path), str(key))] = stored
            if op == "bwd":
                kv_tile = stored
            out[str(key)] = result
    return out


# --------------------------------------------------------------------------- the schedules table


def schedule_rows(shape, *, op="fwd", causal=False, dtype="bfloat16", limits=None, compile=True, hkv=None,
                  nk=None, cache=None, progress=None):
    """One Evaluation per candidate of the bucket of ``shape = (B, H, N, d)`` (illegal ones too),
    plus the cached tuning entry for ``limits.name`` if there is one: (evaluations, entry).

    Registers come from offline NVRTC compiles for ``limits.arch`` (``compile=False`` skips them)."""
    _check_op(op)
    limits = limits or device_limits.H200
    b, h, n, d = shape
    hd = schedule.head_dim_bucket(d)
    dt = _parse_dtype(dtype)
    cache = cache if cache is not None else _cache()
    is_causal = bool(causal)
    entry = cache.get(bucket_key(op, limits.name, dt, d, is_causal, n, nk or n))
    base = None
    if op == "bwd_dq":
        kv_entry = cache.get(bucket_key("bwd", limits.name, dt, d, is_causal, n, nk or n))
        if kv_entry and kv_entry["winner"]:
            base = tile_from_dict("bwd", kv_entry["winner"]["tile"])

    def compile_fn(cand):
        return compile_offline_info(spec_for(cand, dt, is_causal), limits.arch, cache)

    def io_fn(cand):
        return logical_bytes(cand, (b, h, n, d), dtype=dt, causal=causal, nk=nk, hkv=hkv)

    cands = candidates(op, hd, base)
    evals = []
    legal = [c for c in cands if not violations(c, limits)]
    done = 0
    for c in cands:
        use_compile = compile_fn if compile and c in legal else None
        ev = evaluate_static(c, limits, use_compile, io_fn)
        evals.append(ev)
        if c in legal:
            done += 1
            if progress is not None:
                progress(done, len(legal), ev)
    if entry is not None:
        times = {r["name"]: r.get("time_s") for r in entry["candidates"]}
        for ev in evals:
            ev.time_s = times.get(ev.candidate.name)
    return evals, entry


def format_schedule_table(evals, entry, *, op, limits, show_illegal=False, table=None) -> str:

    winner = entry["winner"]["name"] if entry and entry.get("winner") else None
    table_name = Candidate(op, evals[0].candidate.hd, table).name if table is not None else None
    rows = []
    for ev in evals:
        if ev.status == "illegal" and not show_illegal:
            continue
        c, info, occ = ev.candidate, ev.compile, ev.occupancy
        chosen = []
        if c.name == winner:
            chosen.append("tuned")
        if c.name == table_name:
            chosen.append("table")
        rows.append((
            c.name,
            "-" if info is None or info.registers is None else str(info.registers),
            "-" if info is None else ("0" if info.clean else (str(info.spill_bytes) if info.error is None else "-")),
            f"{c.smem_bytes:,}",
            "-" if occ is None else str(occ.blocks_per_sm),
            "-" if occ is None else str(occ.warps_per_sm),
            "-" if occ is None or occ.blocks_per_sm == 0 else occ.limiter,
            "-" if ev.logical_bytes is None else f"{ev.logical_bytes:,}",
            "-" if ev.time_s is None else f"{ev.time_s * 1e3:.4g}",
            ",".join(chosen) or "",
            ev.status if ev.status != "legal" else "ok" if info is not None else "legal (not compiled)",
            ev.detail[:70] if ev.status not in ("legal", "ok") else "",
        ))
    head = ("config", "regs", "spill B", "smem B", "blocks/SM", "warps/SM", "limiter", "logical bytes", "time ms",
            "chosen", "status", "why")
    return format_table(head, rows)


# --------------------------------------------------------------------------- command line


def clear_memo():
    """Forget what this process has read, tuned or compiled (tests; after editing the cache by hand)."""
    tuning.clear_memo()
    with _compile_lock:
        _compile_memo.clear()


tuning.register_autotuner(GpuTuner)  # CUFLASH_TUNE=1: the dispatch times a bucket on first use
