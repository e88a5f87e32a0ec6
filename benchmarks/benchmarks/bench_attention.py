"""asv suites: cuflash against the materializing reference, on the same inputs, over time.

Each suite builds its inputs from a fixed seed (so the cuflash and reference suites read the same
values), compiles and warms up in ``setup``, and synchronizes the device inside the timed
function. What is recorded per commit:

* ``time_*``: asv's wall-clock time of one call including the synchronize;
* ``track_gpu_ms``: median CUDA-event time of the call alone (its launch hidden behind a GPU spin),
  L2 flushed between repeats;
* ``track_peak_bytes``: the most bytes one call's own allocations from CuPy's memory pool held
  at once (a memory hook; the output is counted, the inputs are not);
* ``track_host_us`` (decode): host time of one call, calls queued behind a GPU spin so the host
  never waits for the device (what a decoding loop without a CUDA graph pays per step).

All are "larger is worse", which is how asv and tools/asv_regressions.py read them; rates
(TFLOP/s) are left to benchmarks/peers.py. ``setup`` raises NotImplementedError, which asv
records as a skip, when there is no GPU, when cuflash lacks the operation, or when the
reference's S and P would not fit.
"""

import zlib

import numpy as np

# Imported once in asv's forkserver, before it forks a process per benchmark and parameter
# combination (neither import touches the GPU, so the children start their own CUDA contexts).
try:
    import cupy as _cupy_module
except ImportError:  # asv check and CI: every suite skips in setup
    _cupy_module = None
try:
    import torch as _torch
except ImportError:  # the peer track skips
    _torch = None

TOKENS = 16384  # B * N, as in benchmarks/peers.py
MODEL_WIDTH = 2048  # H * d
REFERENCE_BYTES_PER_PAIR = 16  # S and P in float32 plus temporaries (peers note: ~4 such matrices)
REFERENCE_BACKWARD_BYTES_PER_PAIR = 24  # P, dP, their product and dS
REFERENCE_MAX_BYTES = 40e9
L2_FLUSH_BYTES = 256 << 20
L2_CLEAN_BYTES = 96 << 20  # read after the flush: more than the H200's 60 MiB L2
EVENT_SPIN_CYCLES = 2_000_000  # about 1 ms at ~2 GHz: more than a call's host time
EVENT_REPEATS = 20

# The history: what tools/asv_history.sh runs for every recorded commit (asv --bench regexes;
# a parameterized benchmark matches as "name(p0, p1, ...)"). cuflash's prefill and decode
# times and peak bytes, the peer (torch SDPA on cuDNN: each of its processes spends about 5 s
# building cuDNN plans, so it runs on a few cells) and the materializing reference at d = 128
# on the same inputs. The kernels' CUDA-event times at d = 128, N = 16k (cuflash and cuDNN) ride
# along: wall times of calls under a few milliseconds move up to 1.8x between starts of the machine
# (docs/performance.md#history), event times within a few percent, so a kernel's own change shows
# there. The other suites (float32, paged, window, host time, graphs) run with the full `asv run`.
HISTORY = (
    r"bench_attention\.Cuflash(Forward|Backward)\.(time_|track_peak)",
    r"bench_attention\.(Cuflash|Cudnn)(Forward|Backward)\.track_gpu_ms\(16384, 128,",
    r"bench_attention\.Cudnn(Forward|Backward)\.time_\w+\((4096, 128, False|16384, 128, True),",
    r"bench_attention\.Reference(Forward|Backward)\.time_\w+\((1024|4096), 128,",
    r"bench_attention\.CuflashDecode\.(time_|track_peak)\w+\((16384|65536), '8x32x8'\)",
    r"bench_attention\.CudnnDecode\.time_\w+\(65536, '8x32x8'\)",
)


def stable_seed(*params):
    """The same seed in every process (str hashes are salted per process; asv uses several)."""
    return zlib.crc32(repr(params).encode())


def _cupy():
    """CuPy with a usable GPU, or NotImplementedError (asv's skip)."""
    if _cupy_module is None:
        raise NotImplementedError("CuPy is not installed")
    cupy = _cupy_module
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise NotImplementedError("no CUDA device")
    except NotImplementedError:
        raise
    except Exception as exc:  # ImportError, CUDARuntimeError without a driver, ...
        raise NotImplementedError(f"no usable CUDA GPU: {type(exc).__name__}: {exc}") from None
    return cupy


def _dtype(name):
    import ml_dtypes

    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}[name]


def random_normal(cp, shape, dtype_name, seed):
    """Fresh standard-normal values in the given dtype (float32 or 16-bit), generated on the device."""
    x = cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32)
    if dtype_name == "float32":
        return x
    if dtype_name == "float16":
        return x.astype(cp.float16)
    # float32 -> bfloat16 with round-to-nearest-even on the bit pattern (no NaNs here).
    bits = x.view(cp.uint32)
    rounded = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16
    return rounded.astype(cp.uint16).view(_dtype("bfloat16"))


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def event_ms(cp, fn, repeats=EVENT_REPEATS):
    """Median CUDA-event time of fn() in ms, the device's time only. Before each call, outside the
    events: an L2 flush (a write, then a read of a clean buffer, so that the call pays for no dirty
    lines) and a one-thread GPU spin of about 1 ms that the host's launch of fn() overlaps. Without
    the spin the events also hold whatever host time of fn() the GPU waits for: on one H100 start
    cuflash's causal d = 128 N = 16k forward read 1.79 ms that way against 1.54 ms by
    benchmarks/peers.py, which hides the launch, while cuDNN's read 1.70 against 1.73."""
    flush = cp.empty(L2_FLUSH_BYTES, dtype=cp.uint8)
    clean = cp.ones(L2_CLEAN_BYTES, dtype=cp.uint8)
    spin = cp.RawKernel(_SPIN, "spin")
    times = []
    for _ in range(repeats):
        flush.fill(0)
        clean.max()
        spin((1,), (1,), (np.int64(EVENT_SPIN_CYCLES),))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def host_us(cp, fn, calls=200):
    """Host microseconds per fn() call: `calls` back-to-back calls queued behind a one-thread GPU
    spin of about 1 ms per call, so the calls' kernels never run while the host is timed (few
    enough calls that their launches fit the launch queue: more would wait for queue space)."""
    fn()
    cp.cuda.Device().synchronize()
    spin = cp.RawKernel(_SPIN, "spin")
    import time

    spin((1,), (1,), (np.int64(calls * 2_000_000),))  # ~1 ms per call at ~2 GHz
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    cp.cuda.Device().synchronize()
    return (t1 - t0) / calls * 1e6


def peak_live_bytes(cp, fn):
    """(fn(), the most bytes fn's own allocations from CuPy's memory pool held at once), counted
    through a memory hook as they are made and freed (requested sizes; the pool's 512-byte
    rounding is not counted). The pool's growth from an emptied cache undercounts: a small
    allocation can land in free space of a chunk the pool still holds for live arrays."""
    from cupy.cuda import memory_hook

    class _Peak(memory_hook.MemoryHook):
        name = "cuflash_peak"

        def __init__(self):
            self.live, self.now, self.peak = {}, 0, 0

        def malloc_postprocess(self, **kw):  # device_id, size, mem_size, mem_ptr, pmem_id
            self.live[kw["pmem_id"]] = kw["size"]
            self.now += kw["size"]
            self.peak = max(self.peak, self.now)

        def free_postprocess(self, **kw):  # device_id, mem_size, mem_ptr, pmem_id
            self.now -= self.live.pop(kw["pmem_id"], 0)

    cp.cuda.Device().synchronize()
    with _Peak() as hook:
        result = fn()
        cp.cuda.Device().synchronize()
    return result, hook.peak


def reference_module():
    """The materializing reference of the tree under test (cuflash.reference before the package
    was layered)."""
    try:
        from cuflash.backends import reference
    except ImportError:
        try:
            from cuflash import reference
        except ImportError as exc:
            raise NotImplementedError(f"this tree has no materializing reference: {exc}") from None
    return reference


def _torch_cuda():
    """torch with CUDA for the peer track, or NotImplementedError (asv's skip)."""
    if _torch is None or not _torch.cuda.is_available():
        raise NotImplementedError("torch with CUDA is not available")
    return _torch


def as_torch(cp, a):
    """A torch tensor over a CuPy array's memory (16-bit values move as int16 bits: not every
    DLPack path knows bfloat16)."""
    torch = _torch_cuda()
    t = torch.from_dlpack(a.view(cp.int16))
    return t.view({"bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype.name])


def cudnn_sdpa(torch, q, k, v, causal):
    """torch SDPA restricted to its cuDNN backend (raises RuntimeError where cuDNN refuses)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def peer_or_skip(fn):
    """fn() with the peer's refusal of a shape (RuntimeError) recorded as asv's skip."""
    try:
        return fn()
    except RuntimeError as exc:
        raise NotImplementedError(f"cuDNN SDPA refused: {exc}") from None


class _Timed:
    """Shared timing and event methods; subclasses define setup() and self.op."""

    timeout = 600
    # One call per sample and one round: asv starts a process per benchmark, parameter
    # combination and round, and that start (a CUDA context, the inputs, a warm call) costs more
    # than the samples. 10 to 20 samples feed tools/asv_regressions.py's rank test (20 a side
    # find a 5% slowdown under 2% noise about 97% of the time).
    number = 1
    repeat = (10, 20, 2.0)
    rounds = 1
    warmup_time = 0.1

    def _run(self):
        self.op()
        self.cp.cuda.Device().synchronize()

    def track_gpu_ms(self, *params):
        return event_ms(self.cp, self.op)

    track_gpu_ms.unit = "ms"


class _Suite(_Timed):
    """... and the memory the call takes from CuPy's pool."""

    def track_peak_bytes(self, *params):
        return peak_live_bytes(self.cp, self.op)[1]

    track_peak_bytes.unit = "bytes"


class _PrefillInputs:
    params = ([1024, 4096, 16384], [64, 128], [False, True], ["bfloat16"])
    param_names = ["n", "d", "causal", "dtype"]

    def make_inputs(self, n, d, causal, dtype):
        self.cp = cp = _cupy()
        b, h = TOKENS // n, MODEL_WIDTH // d
        seed = stable_seed(n, d, causal, dtype)
        self.q, self.k, self.v = (random_normal(cp, (b, h, n, d), dtype, seed + i) for i in range(3))
        # True, not "top_left": the older trees of the history accept only booleans (square, so
        # the two corners agree).
        self.causal = bool(causal)
        return b, h


class _Prefill(_PrefillInputs, _Suite):
    pass


class CuflashForward(_Prefill):
    def setup(self, n, d, causal, dtype):
        self.make_inputs(n, d, causal, dtype)
        import cuflash

        self.op = lambda: cuflash.attention(self.q, self.k, self.v, causal=self.causal)
        self._run()  # compiles the kernel (NVRTC) and warms up; NotImplementedError skips
        import sys

        print(f"cuflash imported from {cuflash.__file__}", file=sys.stderr)  # which tree ran

    def time_forward(self, n, d, causal, dtype):
        self._run()


class ReferenceForward(_Prefill):
    def setup(self, n, d, causal, dtype):
        b, h = TOKENS // n, MODEL_WIDTH // d
        need = REFERENCE_BYTES_PER_PAIR * b * h * n * n
        if need > REFERENCE_MAX_BYTES:
            raise NotImplementedError(f"the reference's S and P need about {need / 1e9:.0f} GB")
        reference = reference_module()
        self.make_inputs(n, d, causal, dtype)
        self.op = lambda: reference.attention(self.q, self.k, self.v, causal=self.causal)
        self._run()

    def time_forward(self, n, d, causal, dtype):
        self._run()


class CuflashBackward(_Prefill):
    def setup(self, n, d, causal, dtype):
        self.make_inputs(n, d, causal, dtype)
        import cuflash

        self.do = random_normal(self.cp, self.q.shape, dtype, 7)
        _, vjp = cuflash.attention_vjp(self.q, self.k, self.v, causal=self.causal)
        self.op = lambda: vjp(self.do)
        self._run()  # NotImplementedError while cuflash has no GPU backward: asv skips

    def time_backward(self, n, d, causal, dtype):
        self._run()


class CudnnForward(_PrefillInputs, _Timed):
    """The peer track: torch SDPA on cuDNN, same inputs, timed the same way. A machine that is
    slower today shows in this line too, and cuflash's ratio to it can be drawn per commit."""

    def setup(self, n, d, causal, dtype):
        self.make_inputs(n, d, causal, dtype)
        torch = _torch_cuda()
        q, k, v = (as_torch(self.cp, a) for a in (self.q, self.k, self.v))
        # torch's current stream is the legacy default stream, as CuPy's: _run's synchronize covers it.
        self.op = lambda: cudnn_sdpa(torch, q, k, v, bool(causal))
        peer_or_skip(self._run)

    def time_forward(self, n, d, causal, dtype):
        self._run()


class CudnnBackward(_PrefillInputs, _Timed):
    """The peer's backward: dq, dk, dv from a retained forward graph (cuDNN's backward alone)."""

    def setup(self, n, d, causal, dtype):
        self.make_inputs(n, d, causal, dtype)
        torch = _torch_cuda()
        leaves = [as_torch(self.cp, a).detach().requires_grad_(True) for a in (self.q, self.k, self.v)]
        do = as_torch(self.cp, random_normal(self.cp, self.q.shape, dtype, 7))
        o = peer_or_skip(lambda: cudnn_sdpa(torch, *leaves, bool(causal)))
        self.op = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)
        peer_or_skip(self._run)

    def time_backward(self, n, d, causal, dtype):
        self._run()


class _PrefillFloat32(_Prefill):
    # The exact float32 path (float64 arithmetic; tensor cores on sm_90 up to d=128, FMA beyond).
    params = ([1024, 4096], [64, 128, 256], [False, True], ["float32"])


class CuflashForwardFloat32(_PrefillFloat32, CuflashForward):
    pass


class CuflashBackwardFloat32(_PrefillFloat32, CuflashBackward):
    pass


class ReferenceBackward(_Prefill):
    def setup(self, n, d, causal, dtype):
        b, h = TOKENS // n, MODEL_WIDTH // d
        need = REFERENCE_BACKWARD_BYTES_PER_PAIR * b * h * n * n
        if need > REFERENCE_MAX_BYTES:
            raise NotImplementedError(f"the reference's P, dP and dS need about {need / 1e9:.0f} GB")
        reference = reference_module()
        self.make_inputs(n, d, causal, dtype)
        self.do = random_normal(self.cp, self.q.shape, dtype, 7)
        o, lse = reference.attention(self.q, self.k, self.v, causal=self.causal, return_lse=True)
        self.op = lambda: reference.attention_backward(self.do, self.q, self.k, self.v, o, lse, causal=self.causal)
        self._run()

    def time_backward(self, n, d, causal, dtype):
        self._run()


class _DecodeInputs:
    # One query token per sequence over a K/V cache of length L; heads as "B x Hq x Hkv".
    params = ([4096, 16384, 65536], ["8x32x8", "64x32x8", "8x32x32"])
    param_names = ["cache_len", "b_hq_hkv"]
    d = 128

    def make_inputs(self, cache_len, b_hq_hkv):
        self.cp = cp = _cupy()
        b, hq, hkv = (int(x) for x in b_hq_hkv.split("x"))
        seed = stable_seed(cache_len, b_hq_hkv)
        self.q = random_normal(cp, (b, hq, 1, self.d), "bfloat16", seed)
        self.k = random_normal(cp, (b, hkv, cache_len, self.d), "bfloat16", seed + 1)
        self.v = random_normal(cp, (b, hkv, cache_len, self.d), "bfloat16", seed + 2)


class _Decode(_DecodeInputs, _Suite):
    pass


class CuflashDecode(_Decode):
    def setup(self, cache_len, b_hq_hkv):
        self.make_inputs(cache_len, b_hq_hkv)
        import cuflash

        self.op = lambda: cuflash.attention(self.q, self.k, self.v)
        self._run()

    def time_decode(self, cache_len, b_hq_hkv):
        self._run()

    def track_host_us(self, cache_len, b_hq_hkv):
        return host_us(self.cp, self.op)

    track_host_us.unit = "us"


class CudnnDecode(_DecodeInputs, _Timed):
    """The peer track for decoding: torch SDPA on cuDNN over the same cache."""

    def setup(self, cache_len, b_hq_hkv):
        self.make_inputs(cache_len, b_hq_hkv)
        torch = _torch_cuda()
        q, k, v = (as_torch(self.cp, a) for a in (self.q, self.k, self.v))
        self.op = lambda: cudnn_sdpa(torch, q, k, v, False)
        peer_or_skip(self._run)

    def time_decode(self, cache_len, b_hq_hkv):
        self._run()


class CuflashDecodeUncached(CuflashDecode):
    """The same decode step with cuflash.attention's plan cache off (cuflash.api.plan_cache): each
    call validates, plans and launches through CuPy (CuflashDecode's later calls run from the
    plan made on its second call; compare track_host_us)."""

    def setup(self, cache_len, b_hq_hkv):
        self.make_inputs(cache_len, b_hq_hkv)
        import cuflash
        from cuflash.api import plan_cache

        def op():
            with plan_cache.disabled():
                return cuflash.attention(self.q, self.k, self.v)

        self.op = op
        self._run()


class CuflashDecodePrepared(CuflashDecode):
    """The same decode step through cuflash.prepare_attention: validated and planned once, the
    kernel launched from a packed parameter block (compare track_host_us with CuflashDecode's)."""

    def setup(self, cache_len, b_hq_hkv):
        self.make_inputs(cache_len, b_hq_hkv)
        import cuflash

        run = cuflash.prepare_attention(self.q, self.k, self.v)
        self.op = lambda: run(self.q, self.k, self.v)
        self._run()


class CuflashDecodeGraph(_DecodeInputs, _Timed):
    """The same decode step captured once into a CUDA graph (CuPy stream capture, allocations from
    MemoryAsyncPool so the graph owns them) and replayed: no host work per step. (No
    track_peak_bytes: the graph's buffers are not CuPy's pool's.)"""

    def setup(self, cache_len, b_hq_hkv):
        self.make_inputs(cache_len, b_hq_hkv)
        import cuflash

        cp = self.cp
        self._allocator = cp.cuda.get_allocator()
        cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
        self.out = cp.empty_like(self.q)
        step = lambda: cuflash.attention(self.q, self.k, self.v, out=self.out, validate=False)  # noqa: E731
        step()  # compiles outside the capture
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            step()
            self.graph = stream.end_capture()
        self.op = lambda: self.graph.launch(cp.cuda.get_current_stream())
        self._run()

    def teardown(self, cache_len, b_hq_hkv):
        self.cp.cuda.Device().synchronize()
        self.cp.cuda.set_allocator(self._allocator)

    def time_decode(self, cache_len, b_hq_hkv):
        self._run()


class ReferenceDecode(_Decode):
    def setup(self, cache_len, b_hq_hkv):
        reference = reference_module()
        self.make_inputs(cache_len, b_hq_hkv)
        self.op = lambda: reference.attention(self.q, self.k, self.v)
        self._run()

    def time_decode(self, cache_len, b_hq_hkv):
        self._run()



def shuffled_pages(cp, k, v, block_size, seed):
    """A paged copy of (B, Hkv, L, d) caches (L a multiple of block_size): pages
    (B * L / block_size, block_size, Hkv, d) in a random order, and the int32 (B, L / block_size)
    table that finds them. Shared with tools/paged_bench.py."""
    b, hkv, n, d = k.shape
    per = n // block_size
    table = cp.asarray(np.random.default_rng(seed).permutation(b * per).astype(np.int32)).reshape(b, per)

    def paged(a):
        pages = cp.empty((b * per, block_size, hkv, d), dtype=a.dtype)
        pages[table.reshape(-1)] = a.reshape(b, hkv, per, block_size, d).transpose(0, 2, 3, 1, 4).reshape(
            b * per, block_size, hkv, d)
        return pages

    return paged(k), paged(v), table


class CuflashPagedDecode(_Decode):
    """The decode grid over a paged cache (pages shuffled): compare with CuflashDecode's times."""

    params = _Decode.params + ([16, 64, 256],)
    param_names = _Decode.param_names + ["block_size"]

    def setup(self, cache_len, b_hq_hkv, block_size):
        self.make_inputs(cache_len, b_hq_hkv)
        import cuflash

        self.kc, self.vc, self.table = shuffled_pages(self.cp, self.k, self.v, block_size, seed=block_size)
        del self.k, self.v
        self.op = lambda: cuflash.attention(self.q, self.kc, self.vc, block_table=self.table, validate=False)
        self._run()

    def time_decode(self, cache_len, b_hq_hkv, block_size):
        self._run()


class CuflashWindowForward(_Suite):
    """Sliding-window prefill (causal, each query sees its last `window` keys): the band kernels."""

    params = ([4096, 16384], [128, 1024], ["bfloat16"])
    param_names = ["n", "window", "dtype"]

    def setup(self, n, window, dtype):
        self.cp = cp = _cupy()
        d = 128
        b, h = TOKENS // n, MODEL_WIDTH // d
        seed = stable_seed(n, window, dtype)
        self.q, self.k, self.v = (random_normal(cp, (b, h, n, d), dtype, seed + i) for i in range(3))
        import cuflash

        self.op = lambda: cuflash.attention(self.q, self.k, self.v, causal=True, window=(window - 1, 0))
        self._run()

    def time_forward(self, n, window, dtype):
        self._run()
