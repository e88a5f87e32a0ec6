"""Foreign arrays on the CPU: routing decisions, errors, torch CPU tensors, JAX CPU arrays, optional imports.

Routing is checked with stand-in objects that expose only the protocols (``__dlpack__``,
``__cuda_array_interface__``, ``__array__``); the GPU stand-ins raise if anything tries to read
them, so errors are shown to happen before any memory is touched. torch and JAX tests skip when
the library is missing; their CPU arrays run the NumPy backend, so results must equal the NumPy
path bit for bit, and gradients are also held to the project's accuracy rule against float64
references (cuflash's and, for torch, SDPA's).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.backends import numpy as cpu
from cuflash.api import interop
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import assert_backward_accurate, assert_within_rule, faithful_backward_realizations, faithful_realizations, random_array, random_inputs

REPO = Path(__file__).resolve().parents[1]
DTYPES = [pytest.param(np.float32, id="f32"), pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


def bits(a):
    """Raw bits, so bfloat16/float16 compare exactly and NaN equals NaN."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.itemsize])


# ----------------------------------------------------------------------------- stand-in producers


class GpuDLPack:
    """Claims to live on a CUDA device; reading it is a test failure."""

    def __init__(self, device_type=2, device_id=0):
        self.device = (device_type, device_id)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        raise AssertionError("the routing step must not read the array")


class GpuCAI:
    """A __cuda_array_interface__-only producer (like a Numba device array)."""

    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (2, 8), "typestr": "<f2", "version": 3}


class HostDLPack:
    """A CPU DLPack producer over a NumPy array (with __array__ as the fallback bfloat16 needs)."""

    def __init__(self, a):
        self.a = a

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __array__(self, dtype=None, copy=None):
        return self.a


class HostArrayLike:
    """Exposes only __array__."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


def small_inputs(rng, dtype=np.float32, shape_q=(2, 4, 6, 8), shape_kv=(2, 2, 5, 8)):
    return random_inputs(rng, shape_q, shape_kv, dtype)


# ----------------------------------------------------------------------------- placement


@pytest.mark.parametrize(
    "device, want",
    [((2, 3), ("gpu-protocol", 3)), ((13, 1), ("gpu-protocol", 1)), ((1, 0), ("host-protocol", None)),
     ((3, 0), ("host-protocol", None))],
    ids=["cuda", "cuda-managed", "cpu", "cuda-host"],
)
def test_dlpack_device_decides_placement(device, want):
    pl = interop.placement("q", GpuDLPack(*device))
    assert (pl.kind, pl.device) == want


def test_unsupported_dlpack_device_is_a_type_error():
    with pytest.raises(TypeError, match=r"^q: .*DLPack device type 14"):
        interop.placement("q", GpuDLPack(14, 0))


def test_cuda_array_interface_device_comes_from_the_pointer(monkeypatch):
    seen = []
    monkeypatch.setattr(interop, "_pointer_device", lambda ptr: seen.append(ptr) or 5)
    pl = interop.placement("k", GpuCAI(0xABC000))
    assert (pl.kind, pl.device) == ("gpu-protocol", 5)
    assert seen == [0xABC000]


def test_numpy_and_non_arrays():
    assert interop.placement("q", np.zeros((2, 2))) == interop.Placement("numpy", None)
    assert interop.placement("q", HostArrayLike(np.zeros(2))).kind == "host-protocol"
    assert interop.placement("q", [[1.0]]) is None


def test_mixed_kinds_raise_type_error_naming_the_odd_argument(rng):
    q, k, v = small_inputs(rng)
    with pytest.raises(TypeError, match=r"^k: is a GPU array of another library .* but q is a NumPy array"):
        cuflash.attention(q, GpuDLPack(), v)
    with pytest.raises(TypeError, match=r"^v: is a host array of another library .* but q is a NumPy array"):
        cuflash.attention(q, k, HostArrayLike(v))


def test_non_array_next_to_foreign_arrays_is_named(rng):
    with pytest.raises(TypeError, match=r"^v: expected an array .*got builtins.list"):
        cuflash.attention(GpuDLPack(), GpuDLPack(), [[1.0]])


def test_mixed_devices_raise_value_error_before_reading(rng):
    with pytest.raises(ValueError, match=r"^v: is on cuda:1 but q is on cuda:0"):
        cuflash.attention(GpuDLPack(2, 0), GpuDLPack(2, 0), GpuDLPack(2, 1))
    with pytest.raises(ValueError, match=r"^lse: is on cuda:1 but do is on cuda:0"):
        cuflash.attention_backward(*[GpuDLPack()] * 5, GpuDLPack(2, 1))
    with pytest.raises(TypeError, match=r"^lse: is a host array of another library .* but do is a GPU array"):
        cuflash.attention_backward(*[GpuDLPack()] * 5, GpuDLPack(1, 0))


def test_backward_out_tuple_is_routed_and_checked(rng):
    with pytest.raises(TypeError, match=r"^out\[1\]: is a NumPy array but do is a GPU array"):
        cuflash.attention_backward(*[GpuDLPack()] * 6, out=(GpuDLPack(), np.zeros(2), GpuDLPack()))


# ----------------------------------------------------------------------------- host protocols (NumPy backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wrap", [HostDLPack, HostArrayLike], ids=["dlpack", "array"])
def test_host_protocol_inputs_give_numpy_results(rng, dtype, wrap):
    q, k, v = small_inputs(rng, dtype)
    want_o, want_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    o, lse = cuflash.attention(wrap(q), wrap(k), wrap(v), causal=True, return_lse=True)
    assert type(o) is np.ndarray and type(lse) is np.ndarray and o.dtype == np.dtype(dtype)
    assert np.array_equal(bits(o), bits(want_o)) and np.array_equal(bits(lse), bits(want_lse))


def test_host_protocol_out_is_written_in_place(rng):
    q, k, v = small_inputs(rng)
    target = np.full(q.shape, np.nan, dtype=q.dtype)
    out = HostDLPack(target)
    result = cuflash.attention(HostDLPack(q), HostDLPack(k), HostDLPack(v), out=out)
    assert result is out
    assert np.array_equal(target, cuflash.attention(q, k, v))


def test_array_only_out_is_refused(rng):
    q, k, v = small_inputs(rng)
    with pytest.raises(TypeError, match=r"^out: .* exposes only __array__"):
        cuflash.attention(HostArrayLike(q), HostArrayLike(k), HostArrayLike(v), out=HostArrayLike(np.empty_like(q)))


# ----------------------------------------------------------------------------- attention_backward(out=)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_backward_out_receives_the_gradients(rng, layout):
    shape_q, shape_kv = ((2, 4, 6, 8), (2, 2, 5, 8)) if layout == "bhsd" else ((2, 6, 4, 8), (2, 5, 2, 8))
    q, k, v = small_inputs(rng, np.float16, shape_q, shape_kv)
    do = random_array(rng, q.shape, np.float16)
    o, lse = cuflash.attention(q, k, v, layout=layout, return_lse=True)
    want = cuflash.attention_backward(do, q, k, v, o, lse, layout=layout)
    # dq contiguous; dk with a strided head dim (scratch + copy path); dv a transposed view
    dq = np.full(q.shape, np.nan, np.float16)
    dk = np.full(k.shape + (2,), np.nan, np.float16)[..., 0]
    dv = np.full(v.shape[::-1], np.nan, np.float16).T
    got = cuflash.attention_backward(do, q, k, v, o, lse, layout=layout, out=(dq, dk, dv))
    assert got[0] is dq and got[1] is dk and got[2] is dv
    for g, w in zip(got, want):
        assert np.array_equal(bits(g), bits(w))


def test_backward_out_errors(rng):
    q, k, v = small_inputs(rng, np.float16)
    do = random_array(rng, q.shape, np.float16)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    args = (do, q, k, v, o, lse)
    with pytest.raises(TypeError, match=r"^out: expected a tuple \(dq, dk, dv\)"):
        cuflash.attention_backward(*args, out=(np.empty_like(q), np.empty_like(k)))
    with pytest.raises(ValueError, match=r"^out\[1\]: expected shape"):
        cuflash.attention_backward(*args, out=(np.empty_like(q), np.empty_like(q), np.empty_like(v)))
    with pytest.raises(TypeError, match=r"^out\[2\]: expected dtype"):
        cuflash.attention_backward(*args, out=(np.empty_like(q), np.empty_like(k), np.empty(v.shape, np.float32)))
    with pytest.raises(ValueError, match=r"^out\[0\]: must not overlap input q"):
        cuflash.attention_backward(*args, out=(q, np.empty_like(k), np.empty_like(v)))
    shared = np.empty_like(k)
    with pytest.raises(ValueError, match=r"^out\[2\]: must not overlap out\[1\]"):
        cuflash.attention_backward(*args, out=(np.empty_like(q), shared, shared))


# ----------------------------------------------------------------------------- optional imports


def test_cuflash_imports_and_runs_with_torch_and_jax_blocked():
    """`import cuflash` and a NumPy call must not import torch/JAX; the adapters say what they need."""
    code = textwrap.dedent(
        """
        import builtins, sys
        real_import = builtins.__import__
        BLOCKED = ("torch", "jax", "jaxlib")

        def guarded(name, *args, **kwargs):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for the test: {name}")
            return real_import(name, *args, **kwargs)

        builtins.__import__ = guarded
        import numpy as np
        import cuflash
        q = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
        o, vjp = cuflash.attention_vjp(q, q, q)
        vjp(o)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        for adapter in ("cuflash.torch", "cuflash.jax"):
            try:
                __import__(adapter)
            except ImportError as exc:
                assert "cuflash itself does not" in str(exc), exc
            else:
                raise AssertionError(adapter + " imported although its library is blocked")
        print("imports-ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "imports-ok" in res.stdout


def test_cuflash_does_not_import_torch_or_jax_eagerly():
    """Where torch/JAX are installed, `import cuflash` and a NumPy call still leave them unimported."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import cuflash
        q = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
        cuflash.attention(q, q, q)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib")))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


# ----------------------------------------------------------------------------- torch CPU tensors


def _torch():
    return pytest.importorskip("torch")


def to_torch(torch, a):
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def from_torch(torch, t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cpu_in_torch_out(rng, dtype, monkeypatch):
    torch = _torch()
    q, k, v = small_inputs(rng, dtype)
    want_o, want_lse = cuflash.attention(q, k, v, causal="top_left", return_lse=True)
    tq, tk, tv = (to_torch(torch, a) for a in (q, k, v))
    seen = {}
    real_forward = cpu.forward

    def spy(p, q4, k4, v4, o4, lse3, **kw):
        seen["q_shares"] = np.shares_memory(q4, from_torch(torch, tq))
        return real_forward(p, q4, k4, v4, o4, lse3, **kw)

    monkeypatch.setattr(cpu, "forward", spy)
    o, lse = cuflash.attention(tq, tk, tv, causal="top_left", return_lse=True)
    assert seen["q_shares"], "q was copied on the way in"
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert o.dtype == tq.dtype and lse.dtype == torch.float32 and o.device.type == "cpu"
    assert np.array_equal(bits(from_torch(torch, o)), bits(want_o))
    assert np.array_equal(bits(from_torch(torch, lse)), bits(want_lse))


def test_torch_cpu_out_and_backward_out(rng):
    torch = _torch()
    q, k, v = small_inputs(rng, np.float16)
    do = random_array(rng, q.shape, np.float16)
    tq, tk, tv, tdo = (to_torch(torch, a) for a in (q, k, v, do))
    out = torch.full(tq.shape, float("nan"), dtype=tq.dtype)
    o = cuflash.attention(tq, tk, tv, out=out)
    assert o is out and np.array_equal(bits(out.numpy()), bits(cuflash.attention(q, k, v)))
    o, lse = cuflash.attention(tq, tk, tv, return_lse=True)
    grads = tuple(torch.full_like(t, float("nan")) for t in (tq, tk, tv))
    got = cuflash.attention_backward(tdo, tq, tk, tv, o, lse, out=grads)
    assert all(g is w for g, w in zip(got, grads))
    want = cuflash.attention_vjp(q, k, v)[1](do)
    for g, w in zip(got, want):
        assert np.array_equal(bits(g.numpy()), bits(w))


def test_torch_cpu_vjp_and_requires_grad_inputs(rng):
    torch = _torch()
    q, k, v = small_inputs(rng)
    do = random_array(rng, q.shape, np.float32)
    tq, tk, tv = (to_torch(torch, a).requires_grad_() for a in (q, k, v))
    o, vjp = cuflash.attention_vjp(tq, tk, tv, causal=True)
    assert isinstance(o, torch.Tensor) and not o.requires_grad  # the NumPy-style API is not autograd
    got = vjp(to_torch(torch, do))
    want = cuflash.attention_vjp(q, k, v, causal=True)[1](do)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and np.array_equal(bits(g.numpy()), bits(w))


def test_torch_mixed_with_numpy_or_other_devices(rng):
    torch = _torch()
    q, k, v = small_inputs(rng)
    with pytest.raises(TypeError, match=r"^k: is a NumPy array but q is a torch tensor"):
        cuflash.attention(to_torch(torch, q), k, to_torch(torch, v))
    with pytest.raises(TypeError, match=r"^q: torch tensors on device 'meta' are not supported"):
        cuflash.attention(torch.empty(q.shape, device="meta"), to_torch(torch, k), to_torch(torch, v))


# ----------------------------------------------------------------------------- cuflash.torch (autograd)


def sdpa_reference64(torch, q, k, v, do, causal):
    """o, dq, dk, dv from torch SDPA in float64 on the same (low-precision) inputs: an independent
    float64 reference that also pins the conventions (scale, top-left causal, GQA head sharing)."""
    args = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (q, k, v)]
    gqa = q.shape[-3] != k.shape[-3]
    o = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=causal, enable_gqa=gqa)
    o.backward(torch.from_numpy(do.astype(np.float64)))
    return o.detach().numpy(), *(a.grad.numpy() for a in args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_adapter_gradients(rng, dtype, causal):
    torch = _torch()
    import cuflash.torch as cft

    shape_q, shape_kv = (2, 4, 9, 16), (2, 2, 9, 16)
    q, k, v = small_inputs(rng, dtype, shape_q, shape_kv)
    do = random_array(rng, q.shape, dtype)
    mode = "top_left" if causal else False  # SDPA's is_causal is top-left aligned
    tq, tk, tv = (to_torch(torch, a).requires_grad_() for a in (q, k, v))
    o = cft.attention(tq, tk, tv, causal=mode)
    assert o.grad_fn is not None and o.dtype == tq.dtype
    o.backward(to_torch(torch, do))
    grads = tuple(from_torch(torch, t.grad) for t in (tq, tk, tv))

    want_o = cuflash.attention(q, k, v, causal=mode)
    assert np.array_equal(bits(from_torch(torch, o)), bits(want_o))
    for g, w in zip(grads, cuflash.attention_vjp(q, k, v, causal=mode)[1](do)):
        assert np.array_equal(bits(g), bits(w))

    assert_backward_accurate(grads, do, q, k, v, causal=mode)
    ref_o, *ref_grads = sdpa_reference64(torch, q, k, v, do, causal)
    naive_o = faithful_realizations(q, k, v, causal=mode)
    assert_within_rule("o vs SDPA float64", from_torch(torch, o), ref_o, naive_o, dtype)
    naives = faithful_backward_realizations(do, q, k, v, causal=mode)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naives):
        assert_within_rule(f"{name} vs SDPA float64", g, r, n, dtype)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True), (True, False, True)],
                         ids=["q", "k", "v", "qv"])
def test_torch_adapter_grad_subsets(rng, needs):
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = small_inputs(rng, np.float32, (1, 2, 5, 8), (1, 2, 7, 8))
    do = random_array(rng, q.shape, np.float32)
    ts = [to_torch(torch, a).requires_grad_(n) for a, n in zip((q, k, v), needs)]
    cft.attention(*ts, layout="bhsd").backward(to_torch(torch, do))
    want = cuflash.attention_vjp(q, k, v)[1](do)
    for t, n, w in zip(ts, needs, want):
        if n:
            assert np.array_equal(bits(t.grad.numpy()), bits(w))
        else:
            assert t.grad is None


def test_torch_adapter_no_grad_and_bshd(rng):
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = small_inputs(rng, np.float16, (1, 6, 4, 8), (1, 5, 2, 8))
    ts = [to_torch(torch, a).requires_grad_() for a in (q, k, v)]
    with torch.no_grad():
        o = cft.attention(*ts, layout="bshd", causal=True)
    assert o.grad_fn is None and not o.requires_grad
    assert np.array_equal(bits(o.numpy()), bits(cuflash.attention(q, k, v, layout="bshd", causal=True)))
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor"):
        cft.attention(ts[0], k, ts[2])


def test_torch_adapter_sum_backward_with_expanded_gradient(rng):
    """o.sum().backward() hands the backward an expanded (zero-stride) do."""
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = small_inputs(rng, np.float32, (1, 2, 4, 8), (1, 2, 4, 8))
    tq = to_torch(torch, q).requires_grad_()
    cft.attention(tq, to_torch(torch, k), to_torch(torch, v)).sum().backward()
    want = cuflash.attention_vjp(q, k, v)[1](np.ones_like(q))[0]
    assert np.array_equal(bits(tq.grad.numpy()), bits(want))


# ----------------------------------------------------------------------------- JAX CPU arrays


def _jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    return jax, jnp


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_cpu_in_jax_out(rng, dtype):
    jax, jnp = _jax()
    q, k, v = small_inputs(rng, dtype)
    want_o, want_lse = cuflash.attention(q, k, v, return_lse=True)
    o, lse = cuflash.attention(*(jnp.asarray(a) for a in (q, k, v)), return_lse=True)
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array) and o.dtype == np.dtype(dtype)
    assert np.array_equal(bits(np.asarray(o)), bits(want_o)) and np.array_equal(bits(np.asarray(lse)), bits(want_lse))


def test_jax_tracers_and_out_are_refused(rng):
    jax, jnp = _jax()
    q, k, v = (jnp.asarray(a) for a in small_inputs(rng))
    with pytest.raises(TypeError, match=r"^q: got a JAX tracer .*cuflash.jax.attention"):
        jax.jit(lambda a, b, c: cuflash.attention(a, b, c))(q, k, v)
    with pytest.raises(TypeError, match=r"^out: JAX arrays are immutable"):
        cuflash.attention(q, k, v, out=jnp.zeros(q.shape, q.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_jax_adapter_eager_jit_and_grad(rng, dtype, layout):
    jax, jnp = _jax()
    import cuflash.jax as cfj

    shape_q, shape_kv = ((2, 4, 7, 8), (2, 2, 9, 8)) if layout == "bhsd" else ((2, 7, 4, 8), (2, 9, 2, 8))
    q, k, v = small_inputs(rng, dtype, shape_q, shape_kv)
    do = random_array(rng, q.shape, dtype)
    jq, jk, jv, jdo = (jnp.asarray(a) for a in (q, k, v, do))
    opts = dict(causal="bottom_right", layout=layout)
    want_o = cuflash.attention(q, k, v, **opts)
    want_grads = cuflash.attention_vjp(q, k, v, **opts)[1](do)

    eager = cfj.attention(jq, jk, jv, **opts)
    jitted = jax.jit(lambda a, b, c: cfj.attention(a, b, c, **opts))(jq, jk, jv)
    for o in (eager, jitted):
        assert o.dtype == np.dtype(dtype) and np.array_equal(bits(np.asarray(o)), bits(want_o))

    loss = lambda a, b, c: jnp.sum((cfj.attention(a, b, c, **opts) * jdo).astype(jnp.float32))  # noqa: E731
    for grads in (jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)):
        # do arrives as d(sum(o * do))/do = do, in o's dtype: identical to the NumPy path's input
        for g, w in zip(grads, want_grads):
            assert np.array_equal(bits(np.asarray(g)), bits(w))
    grads = jax.vjp(lambda a, b, c: cfj.attention(a, b, c, **opts), jq, jk, jv)[1](jdo)
    assert_backward_accurate(tuple(np.asarray(g) for g in grads), do, q, k, v, **opts)


def test_jax_adapter_vmap_and_single_head(rng):
    jax, jnp = _jax()
    import cuflash.jax as cfj

    q, k, v = small_inputs(rng, np.float32, (3, 2, 6, 8), (3, 2, 6, 8))
    mapped = jax.vmap(lambda a, b, c: cfj.attention(a, b, c, causal=True))(*(jnp.asarray(x) for x in (q, k, v)))
    assert np.array_equal(bits(np.asarray(mapped)), bits(cuflash.attention(q, k, v, causal=True)))
    # 2-D (N, d) single heads mapped over a leading axis: each is its own problem, whatever the layout
    heads = q[0]  # (2, 6, 8): two single-head problems
    mapped = jax.vmap(lambda a: cfj.attention(a, a, a, layout="bshd"))(jnp.asarray(heads))
    want = np.stack([cuflash.attention(h, h, h) for h in heads])
    assert np.array_equal(bits(np.asarray(mapped)), bits(want))


def test_jax_adapter_errors_and_no_forward_mode(rng):
    jax, jnp = _jax()
    import cuflash.jax as cfj

    q, k, v = (jnp.asarray(a) for a in small_inputs(rng))
    with pytest.raises(ValueError, match=r"^v: heads and length"):
        cfj.attention(q, k, v[..., :3, :])
    with pytest.raises(TypeError, match=r"^q: dtype int32 is not supported"):
        cfj.attention(q.astype(jnp.int32), k, v)
    # documented: custom_vjp defines reverse mode only
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda a: cfj.attention(a, k, v), (q,), (q,))


def _sample(q, k, /, v=None, *, out=None, flag=False, lens=None):
    return q, k, v, out, flag, lens


@pytest.mark.parametrize("args,kwargs", [
    ((1, 2), {}), ((1, 2, 3), {}), ((1, 2), {"v": 3}), ((1, 2, 3), {"out": 4, "lens": 5}),
    ((1, 2), {"flag": True}), ((1,), {}), ((1, 2, 3, 4), {}), ((1, 2, 3), {"v": 4}),
    ((1,), {"k": 2}), ((1, 2), {"nope": 1}), ((), {}), ((1, 2), {"out": None}),
])
def test_plain_call_arguments_match_signature_bind(args, kwargs):
    # The wrapper's fast argument lookup (no Signature.bind per call) must name the same arrays as
    # bind for every call bind accepts, and defer to bind (None) for every call bind refuses.
    import inspect

    sig = inspect.signature(_sample)
    names = ["q", "k", "v", "lens", "out"]
    fast = interop._array_arguments(sig, names)(args, kwargs)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        assert fast is None
        return
    assert fast is not None
    assert fast == {n: bound.arguments.get(n) for n in names}
    # the wrapper puts converted arrays back where they were given, as bind's arguments would
    new = {n: ("converted", value) for n, value in fast.items() if value is not None}
    args2, kwargs2 = interop._array_arguments(sig, names).substitute(args, kwargs, new)
    bound.arguments.update(new)
    assert _sample(*args2, **kwargs2) == _sample(*bound.args, **bound.kwargs)


def test_plain_call_arguments_decline_var_arguments():
    import inspect

    def f(q, *rest, **options):
        return q

    assert interop._array_arguments(inspect.signature(f), ["q"])((1,), {}) is None
