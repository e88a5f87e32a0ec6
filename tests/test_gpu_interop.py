"""Foreign arrays on the GPU: zero copies, the caller's stream and device, the torch and JAX adapters.

What each test pins down:
* zero-copy: the pointers the CUDA backend receives are the caller's (q) and the result's (o);
* streams: the backend runs on torch's current stream / CuPy's current stream (recorded inside
  the launch), and inputs written on a side stream right before the call are what it reads;
* devices: inputs on device 1 run and allocate on device 1 (modules compiled for device 1);
* accuracy: the project's rule against float64 references from the same low-precision inputs
  (cuflash's reference, and torch SDPA in float64 for the torch adapter).
Kept small: well under a minute on an H200 once the kernels are in CuPy's cache.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must leave memory to CuPy's pool

import numpy as np
import pytest

import cuflash
from cuflash.kernels import build
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, assert_within_rule, faithful_backward_realizations, faithful_realizations, random_array, random_inputs
from cuflash.backends import cuda

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
SHAPE = (2, 4, 160, 64)


@pytest.fixture
def launches(monkeypatch):
    """Record, for each forward launch, the pointers, CuPy's current stream and the current device."""
    seen = []
    real_forward = cuda.forward

    def spy(p, q4, k4, v4, o4, lse3, **kw):
        seen.append({
            "q": q4.data.ptr, "o": o4.data.ptr, "stream": cupy.cuda.get_current_stream().ptr,
            "device": cupy.cuda.Device().id, "q_device": q4.device.id,
        })
        return real_forward(p, q4, k4, v4, o4, lse3, **kw)

    monkeypatch.setattr(cuda, "forward", spy)
    return seen


def need_torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def need_two_gpus():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")


def to_torch(torch, a, device="cuda"):
    t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a.copy())
    return t.to(device)


def from_torch(torch, t):
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


# ----------------------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cuda_zero_copy_in_and_out(rng, dtype, launches):
    torch = need_torch_cuda()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, dtype)
    tq, tk, tv = (to_torch(torch, a) for a in (q, k, v))
    o, lse = cuflash.attention(tq, tk, tv, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert isinstance(o, torch.Tensor) and o.device == tq.device and o.dtype == tq.dtype
    assert lse.dtype == torch.float32 and lse.device == tq.device
    (launch,) = launches
    assert launch["q"] == tq.data_ptr(), "q was copied on the way in"
    assert launch["o"] == o.data_ptr(), "o was copied on the way out"
    assert_forward_accurate(from_torch(torch, o), from_torch(torch, lse), q, k, v, causal=True)


@pytest.mark.parametrize("make", [
    pytest.param(lambda t: t, id="contiguous"),
    pytest.param(lambda t: t.transpose(1, 2), id="transposed"),
    pytest.param(lambda t: t[1:, :, 3::2], id="offset-and-step"),
    pytest.param(lambda t: t[:, :1].expand(-1, 3, -1, -1), id="broadcast"),
    pytest.param(lambda t: t.requires_grad_(True) * 1 if t.is_floating_point() else t, id="requires-grad"),
])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32"])
def test_torch_import_is_the_dlpack_view(rng, make, dtype):
    # interop._import_torch builds CuPy views from the tensor's pointer and strides (a tenth of
    # cupy.from_dlpack's host time): the same memory, shape, strides, dtype and values as DLPack's.
    torch = need_torch_cuda()
    from cuflash.api import interop

    base = torch.randn(3, 4, 9, 8, device="cuda").mul(100).to(getattr(torch, dtype))
    t = make(base)
    got = interop._import_torch(t)
    want = cupy.from_dlpack(t.detach().view(torch.int16)).view(BFLOAT16) if dtype == "bfloat16" else cupy.from_dlpack(t.detach())
    assert (got.data.ptr, got.shape, got.strides, got.dtype) == (want.data.ptr, want.shape, want.strides, want.dtype)
    assert bool((got == want).all())
    saved = got.copy()
    del base, t, want  # the view keeps the tensor's memory alive, as DLPack's does
    torch.cuda.empty_cache()
    torch.full((3, 4, 9, 8), 7, device="cuda", dtype=getattr(torch, dtype))  # would land in freed memory
    assert bool((got == saved).all())


def test_torch_call_warns_nothing(rng):
    # CuPy 14 deprecates ExternalStream with a DeprecationWarning per use: a torch call made
    # under -W error (or pytest's filterwarnings = error) must still run.
    import warnings

    torch = need_torch_cuda()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    tq, tk, tv = (to_torch(torch, a) for a in (q, k, v))
    side = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.cuda.stream(side):  # a stream other than the legacy default one
            o = cuflash.attention(tq, tk, tv)
        side.synchronize()
    assert_forward_accurate(from_torch(torch, o), None, q, k, v)


def test_torch_side_stream_written_right_before_the_call(rng, launches):
    """Inputs land on a non-default stream behind ~tens of ms of queued GPU work; the call must run
    on that stream (so it reads them, not the NaN placeholders) and hand o back on it."""
    torch = need_torch_cuda()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    host = [to_torch(torch, a, "cpu").pin_memory() for a in (q, k, v)]
    stream_before = cupy.cuda.get_current_stream().ptr
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        tq, tk, tv = (torch.full(h.shape, float("nan"), dtype=h.dtype, device="cuda") for h in host)
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy, so unordered work would see NaN
        for t, h in zip((tq, tk, tv), host):
            t.copy_(h, non_blocking=True)
        o = cuflash.attention(tq, tk, tv)
        o_after = o * 1  # a consumer on the same stream
    side.synchronize()
    assert launches[0]["stream"] == side.cuda_stream, "the kernels did not run on torch's current stream"
    assert cupy.cuda.get_current_stream().ptr == stream_before, "CuPy's current stream was not restored"
    assert_forward_accurate(from_torch(torch, o_after), None, q, k, v)


def test_cupy_current_stream_is_used(rng, launches):
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
        o = cuflash.attention(qg, kg, vg)
    stream.synchronize()
    assert launches[0]["stream"] == stream.ptr
    assert_forward_accurate(o, None, q, k, v)


def test_mixed_torch_and_cupy_is_a_type_error(rng):
    torch = need_torch_cuda()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    with pytest.raises(TypeError, match=r"^k: is a CuPy array but q is a torch tensor"):
        cuflash.attention(to_torch(torch, q), cupy.asarray(k), to_torch(torch, v))


def sdpa_float64(torch, q, k, v, do, causal):
    """o, dq, dk, dv of torch SDPA in float64 on the GPU from the same low-precision inputs."""
    args = [to_torch(torch, a).double().requires_grad_() for a in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    o.backward(to_torch(torch, do).double())
    return [from_torch(torch, t) for t in (o, *(a.grad for a in args))]


@pytest.mark.parametrize("hq, hkv, causal", [(4, 4, True), (8, 2, False)], ids=["mha-causal", "gqa-full"])
def test_torch_adapter_gradients_bf16(rng, hq, hkv, causal, launches):
    torch = need_torch_cuda()
    import cuflash.torch as cft

    q, k, v = random_inputs(rng, (2, hq, 200, 64), (2, hkv, 200, 64), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mode = "top_left" if causal else False  # SDPA's is_causal is top-left aligned
    tq, tk, tv = (to_torch(torch, a).requires_grad_() for a in (q, k, v))
    o = cft.attention(tq, tk, tv, causal=mode)
    assert launches[-1]["o"] == o.data_ptr(), "o is not the memory the kernel wrote"
    o.backward(to_torch(torch, do))
    torch.cuda.synchronize()
    got_o = from_torch(torch, o)
    grads = tuple(from_torch(torch, t.grad) for t in (tq, tk, tv))

    assert_forward_accurate(got_o, None, q, k, v, causal=mode)
    assert_backward_accurate(grads, do, q, k, v, causal=mode)
    # torch SDPA in float64 as a second, independent reference (pins scale, causal alignment, GQA)
    ref_o, *ref_grads = sdpa_float64(torch, q, k, v, do, causal)
    assert_within_rule("o vs SDPA float64", got_o, ref_o, faithful_realizations(q, k, v, causal=mode),
                              BFLOAT16)
    naives = faithful_backward_realizations(do, q, k, v, causal=mode)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naives):
        assert_within_rule(f"{name} vs SDPA float64", g, r, n, BFLOAT16)


def test_torch_adapter_only_v_requires_grad(rng):
    torch = need_torch_cuda()
    import cuflash.torch as cft

    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    do = random_array(rng, q.shape, FLOAT16)
    tq, tk = to_torch(torch, q), to_torch(torch, k)
    tv = to_torch(torch, v).requires_grad_()
    cft.attention(tq, tk, tv).backward(to_torch(torch, do))
    assert tq.grad is None and tk.grad is None
    dv = from_torch(torch, tv.grad)
    want = cuflash.attention_vjp(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v))[1](cupy.asarray(do))[2]
    cupy.cuda.Device().synchronize()
    # same kernels, same inputs: identical dv (dv has no atomics)
    assert np.array_equal(dv.view(np.uint16), cupy.asnumpy(want).view(np.uint16))
    with torch.no_grad():
        assert cft.attention(tq, tk, tv).grad_fn is None


# ----------------------------------------------------------------------------- devices


def test_inputs_on_device_1_run_on_device_1(rng, launches):
    need_two_gpus()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    with cupy.cuda.Device(1):
        qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    assert cupy.cuda.Device().id == 0
    o = cuflash.attention(qg, kg, vg)
    assert o.device.id == 1 and launches[-1]["device"] == 1
    assert any(key[0] == 1 for key in build._modules), "no module compiled for device 1"
    with cupy.cuda.Device(1):
        cupy.cuda.Device().synchronize()
    assert_forward_accurate(o, None, q, k, v)
    with cupy.cuda.Device(0):
        k0 = cupy.asarray(k)
    with pytest.raises(ValueError, match=r"^k: is on cuda:0 but q is on cuda:1"):
        cuflash.attention(qg, k0, vg)


def test_torch_on_device_1(rng, launches):
    need_two_gpus()
    torch = need_torch_cuda()
    import cuflash.torch as cft

    q, k, v = random_inputs(rng, SHAPE, SHAPE, BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    tq, tk, tv = (to_torch(torch, a, "cuda:1").requires_grad_() for a in (q, k, v))
    assert torch.cuda.current_device() == 0
    o = cft.attention(tq, tk, tv, causal=True)
    assert o.device == tq.device and launches[-1]["device"] == 1
    assert launches[-1]["stream"] == torch.cuda.current_stream(1).cuda_stream
    o.backward(to_torch(torch, do, "cuda:1"))
    torch.cuda.synchronize(1)
    assert all(t.grad.device == tq.device for t in (tq, tk, tv))
    assert_backward_accurate(tuple(from_torch(torch, t.grad) for t in (tq, tk, tv)), do, q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"^k: is on cuda:0 but q is on cuda:1"):
        cuflash.attention(tq.detach(), to_torch(torch, k, "cuda:0"), tv.detach())


# ----------------------------------------------------------------------------- other producers


class CudaArrayInterfaceOnly:
    """Like a Numba device array: exposes only __cuda_array_interface__ (keeps its owner alive)."""

    def __init__(self, owner):
        self.owner = owner
        self.__cuda_array_interface__ = owner.__cuda_array_interface__


class DLPackOnly:
    def __init__(self, owner):
        self.owner = owner

    def __dlpack__(self, **kwargs):
        return self.owner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.owner.__dlpack_device__()


@pytest.mark.parametrize("wrap", [CudaArrayInterfaceOnly, DLPackOnly], ids=["cai", "dlpack"])
def test_protocol_producers_give_cupy_without_copies(rng, wrap, launches):
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    o = cuflash.attention(wrap(qg), wrap(kg), wrap(vg), causal=True)
    assert isinstance(o, cupy.ndarray)
    assert launches[-1]["q"] == qg.data.ptr
    assert_forward_accurate(o, None, q, k, v, causal=True)


# ----------------------------------------------------------------------------- JAX


def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX has no GPU backend")
    return jax, gpus[0]


def test_jax_gpu_eager_zero_copy(rng, launches):
    jax, gpu = jax_gpu()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, FLOAT16)
    jq, jk, jv = (jax.device_put(a, gpu) for a in (q, k, v))
    o, lse = cuflash.attention(jq, jk, jv, causal=True, return_lse=True)
    o.block_until_ready()
    assert isinstance(o, jax.Array) and o.devices() == {gpu} and o.dtype == np.float16
    assert launches[-1]["q"] == jq.unsafe_buffer_pointer(), "q was copied on the way in"
    assert launches[-1]["o"] == o.unsafe_buffer_pointer(), "o was copied on the way out"
    assert_forward_accurate(np.asarray(o), np.asarray(lse), q, k, v, causal=True)


def test_jax_gpu_eager_bfloat16(rng):
    jax, gpu = jax_gpu()
    q, k, v = random_inputs(rng, SHAPE, SHAPE, BFLOAT16)
    o = cuflash.attention(*(jax.device_put(a, gpu) for a in (q, k, v)))
    assert o.dtype == BFLOAT16 and o.devices() == {gpu}
    assert_forward_accurate(np.asarray(o), None, q, k, v)


def test_jax_adapter_jit_and_grad_on_gpu(rng, launches):
    jax, gpu = jax_gpu()
    import cuflash.jax as cfj

    q, k, v = random_inputs(rng, (2, 8, 160, 64), (2, 2, 160, 64), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    jq, jk, jv, jdo = (jax.device_put(a, gpu) for a in (q, k, v, do))

    def f(a, b, c):
        return cfj.attention(a, b, c, causal="bottom_right")

    o = jax.jit(f)(jq, jk, jv)
    grads = jax.jit(lambda a, b, c, g: jax.vjp(f, a, b, c)[1](g))(jq, jk, jv, jdo)
    jax.block_until_ready(grads)
    assert o.devices() == {gpu} and all(g.devices() == {gpu} for g in grads)
    assert launches and launches[-1]["device"] == gpu.local_hardware_id
    assert launches[-1]["stream"] != 0, "expected XLA's compute stream, not the legacy default stream"
    assert_forward_accurate(np.asarray(o), None, q, k, v, causal="bottom_right")
    assert_backward_accurate(tuple(np.asarray(g) for g in grads), do, q, k, v, causal="bottom_right")
