"""cuflash.torch: the custom operators, every option through the adapter, the SDPA entry point, torch.compile.

CPU tensors run the NumPy backend, so everything here but the ``gpu``-marked tests runs without a
GPU; the GPU tests repeat the essentials on CUDA tensors (and CUDA graphs through
``mode="reduce-overhead"``)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import (assert_backward_accurate, assert_forward_accurate, assert_within_rule,
                             faithful_backward_realizations, faithful_realizations, random_array, random_inputs)

torch = pytest.importorskip("torch")
import cuflash.torch as cft  # noqa: E402

DTYPES = [pytest.param(np.float32, id="f32"), pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
OPS = torch.ops.cuflash


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def T(a, device="cpu"):
    """NumPy -> torch (a copy; bfloat16 through its bits)."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a).copy()).to(device)


def N(t):
    """torch -> NumPy (bfloat16 through its bits)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def same(a, b):
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def _grads(ts):
    return [N(t.grad) for t in ts]


# ----------------------------------------------------------------------------- the operators


def _op_args(q, k, v, kv_lens=None, cu_q=None, cu_k=None, table=None, causal="none", scale=None, layout="bhsd",
             window=None, softcap=None, alibi=None, sinks=None, validate=True, max_q=None, max_k=None):
    return (q, k, v, kv_lens, cu_q, cu_k, max_q, max_k, table, causal, scale, layout, window, softcap, alibi, sinks,
            validate)


def _cases(rng):
    """(name, forward-op args): every input kind the forward takes, small."""
    q, k, v = (T(a) for a in random_inputs(rng, (2, 4, 5, 8), (2, 2, 7, 8), np.float32))
    qs, ks, vs = (T(a) for a in random_inputs(rng, (2, 5, 4, 8), (2, 7, 2, 8), np.float16))
    q2, k2, v2 = (T(a) for a in random_inputs(rng, (6, 8), (6, 8), np.float32))
    qp, kp, vp = (T(a) for a in random_inputs(rng, (7, 2, 8), (9, 2, 8), np.float32))
    cu_q, cu_k = torch.tensor([0, 3, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    cache_k, cache_v = (T(random_array(rng, (4, 16, 2, 8), np.float32)) for _ in range(2))
    qd = T(random_array(rng, (2, 4, 1, 8), np.float32))
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    return [
        ("plain-causal", _op_args(q, k, v, causal="bottom_right")),
        ("bshd-top-left-window", _op_args(qs, ks, vs, causal="top_left", layout="bshd", window=[2, 1], scale=0.3)),
        ("single-head", _op_args(q2, k2, v2, causal="bottom_right")),
        ("kv_lens", _op_args(q, k, v, kv_lens=lens, causal="bottom_right")),
        ("varlen", _op_args(qp, kp, vp, cu_q=cu_q, cu_k=cu_k, causal="bottom_right", window=[3, -1])),
        ("varlen-max-seqlens", _op_args(qp, kp, vp, cu_q=cu_q, cu_k=cu_k, causal="bottom_right", max_q=4, max_k=5,
                                        validate=False)),
        ("paged", _op_args(qd, cache_k, cache_v, kv_lens=torch.tensor([20, 31], dtype=torch.int32), table=table)),
        ("score-modifiers", _op_args(q, k, v, causal="bottom_right", softcap=2.5,
                                     alibi=T(rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32)),
                                     sinks=T(rng.standard_normal(4).astype(np.float32)))),
    ]


def test_operators_pass_opcheck(rng):
    """torch.library.opcheck: schema, fake (meta) shapes and strides against the real outputs,
    autograd registration, and AOT dispatch (with dynamic shapes) for each kind of call."""
    for name, args in _cases(rng):
        torch.library.opcheck(OPS.attention, args + (False,))
        out = torch.empty_like(args[0])
        torch.library.opcheck(OPS.attention_out, args + (out,))
        if args[3] is None and args[8] is None:  # the backward exists for calls without a KV cache
            q, k, v = args[:3]
            o, lse = OPS.attention(*args, False)
            do = torch.randn_like(o)
            torch.library.opcheck(OPS.attention_backward, (do, q, k, v, o, lse, *args[4:8], *args[9:17], False))


def test_fake_shapes_match_real(rng):
    """The meta implementations' shapes and dtypes, lse float32 included, equal the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, args in _cases(rng):
        real = OPS.attention(*args, False)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fake = OPS.attention(*fake_args, False)
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride()), name
        assert real[1].dtype == torch.float32


# ----------------------------------------------------------------------------- every option through the adapter


def test_kv_lens_and_paged_match_cuflash(rng):
    q, k, v = random_inputs(rng, (3, 4, 2, 8), (3, 2, 9, 8), np.float16)
    lens = np.array([9, 4, 0], dtype=np.int32)
    o, lse = cft.attention(T(q), T(k), T(v), causal=True, kv_lens=T(lens), return_lse=True)
    want_o, want_lse = cuflash.attention(q, k, v, causal=True, kv_lens=lens, return_lse=True)
    assert same(N(o), want_o) and same(N(lse), want_lse)

    cache = [random_array(rng, (6, 16, 2, 8), np.float16) for _ in range(2)]
    table = np.array([[5, 1], [0, -1], [3, 2]], dtype=np.int32)
    lens = np.array([30, 16, 17], dtype=np.int32)
    got = cft.attention(T(q), *(T(c) for c in cache), block_table=T(table), kv_lens=T(lens), window=(4, -1))
    want = cuflash.attention(q, *cache, block_table=table, kv_lens=lens, window=(4, -1))
    assert same(N(got), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_and_window_gradients(rng, dtype):
    q, k, v = random_inputs(rng, (9, 4, 8), (11, 2, 8), dtype)
    do = random_array(rng, q.shape, dtype)
    cu_q, cu_k = np.array([0, 4, 4, 9], dtype=np.int32), np.array([0, 5, 7, 11], dtype=np.int32)
    opts = dict(causal="bottom_right", window=(2, 1), scale=0.4)
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    o = cft.attention(*ts, cu_seqlens_q=T(cu_q), cu_seqlens_k=T(cu_k), **opts)
    o.backward(T(do))
    want_o, vjp = cuflash.attention_vjp(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **opts)
    assert same(N(o), want_o)
    for g, w in zip(_grads(ts), vjp(do)):
        assert same(g, w)

    q, k, v = random_inputs(rng, (2, 2, 7, 8), (2, 2, 10, 8), dtype)
    do = random_array(rng, q.shape, dtype)
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    cft.attention(*ts, window=(3, 2), deterministic=True).backward(T(do))
    grads = _grads(ts)
    for g, w in zip(grads, cuflash.attention_vjp(q, k, v, window=(3, 2))[1](do, deterministic=True)):
        assert same(g, w)
    assert_backward_accurate(tuple(grads), do, q, k, v, window=(3, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers_and_dsinks_through_autograd(rng, dtype):
    """softcap, ALiBi and sinks through the operators: o and lse, and dq, dk, dv and the sinks'
    gradient from autograd, equal cuflash's own calls bit for bit (slopes get no gradient)."""
    q, k, v = random_inputs(rng, (2, 4, 6, 8), (2, 2, 9, 8), dtype)
    do = random_array(rng, q.shape, dtype)
    slopes = rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    opts = dict(causal="bottom_right", softcap=3.0)
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    t_sinks = T(sinks).requires_grad_()
    o, lse = cft.attention(*ts, alibi_slopes=T(slopes), sinks=t_sinks, return_lse=True, **opts)
    o.backward(T(do))
    want_o, want_lse = cuflash.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, return_lse=True, **opts)
    assert same(N(o), want_o) and same(N(lse), want_lse)
    want = cuflash.attention_backward(do, q, k, v, want_o, want_lse, alibi_slopes=slopes, sinks=sinks, **opts)
    assert len(want) == 4
    for g, w in zip(_grads(ts) + [N(t_sinks.grad)], want):
        assert same(g, w)
    # sinks alone requiring a gradient is enough to record the backward
    t_sinks = T(sinks).requires_grad_()
    cft.attention(T(q), T(k), T(v), sinks=t_sinks, **opts).backward(T(do))
    assert t_sinks.grad is not None and t_sinks.grad.shape == (4,)
    with pytest.raises(TypeError, match="softcap"):
        cft.attention(T(q), T(k), T(v), softcap="3")
    with pytest.raises(TypeError, match="sinks"):
        cft.attention(T(q), T(k), T(v), sinks=sinks)
    with pytest.raises(ValueError, match="softcap"):
        cft.attention(T(q), T(k), T(v), softcap=-1.0)


def test_transformers_attention_takes_softcap_and_sinks(rng):
    """transformers' softcap= (Gemma-2) and s_aux= (gpt-oss sinks, in the model's dtype) reach
    cuflash: the same o as cuflash.torch.attention, and the sinks' gradient flows back."""
    q, k, v = (T(a) for a in random_inputs(rng, (1, 4, 5, 8), (1, 2, 5, 8), np.float32))
    sinks = T(rng.standard_normal(4).astype(np.float32)).to(torch.float64).requires_grad_()
    module = type("Attention", (), {"is_causal": True})()
    o, weights = cft.transformers_attention(module, q, k, v, None, scaling=0.5, softcap=4.0, s_aux=sinks)
    want = cft.attention(q, k, v, causal="bottom_right", scale=0.5, softcap=4.0, sinks=sinks.detach().float())
    assert weights is None and torch.equal(o, want.transpose(1, 2))
    o.sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.float64


def test_out_and_return_lse(rng):
    q, k, v = random_inputs(rng, (2, 3, 5, 8), (2, 3, 6, 8), np.float32)
    out = torch.full(q.shape, float("nan"))
    got, lse = cft.attention(T(q), T(k), T(v), causal="top_left", out=out, return_lse=True)
    want_o, want_lse = cuflash.attention(q, k, v, causal="top_left", return_lse=True)
    assert got is out and same(N(out), want_o) and same(N(lse), want_lse)
    assert_forward_accurate(N(out), N(lse), q, k, v, causal="top_left")
    # lse comes back without a gradient, o with one
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    o, lse = cft.attention(*ts, return_lse=True)
    assert o.requires_grad and not lse.requires_grad


def test_adapter_errors(rng):
    q, k, v = (T(a).requires_grad_() for a in random_inputs(rng, (1, 2, 3, 8), (1, 2, 4, 8), np.float32))
    lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^kv_lens: KV-cache calls have no backward"):
        cft.attention(q, k, v, kv_lens=lens)
    with torch.no_grad():  # the same call without a gradient runs
        assert same(N(cft.attention(q, k, v, kv_lens=lens)),
                    cuflash.attention(N(q), N(k), N(v), kv_lens=N(lens)))
    with pytest.raises(ValueError, match=r"^out: a call that needs gradients"):
        cft.attention(q, k, v, out=torch.empty(q.shape))
    with pytest.raises(TypeError, match=r"^kv_lens: expected a torch.Tensor"):
        cft.attention(q.detach(), k, v, kv_lens=np.array([2], dtype=np.int32))
    with pytest.raises(ValueError, match=r"^causal: expected"):
        cft.attention(q, k, v, causal="top")
    with pytest.raises(TypeError, match=r"^window: expected"):
        cft.attention(q, k, v, window=3)
    with pytest.raises(TypeError, match=r"^scale: expected a real number"):
        cft.attention(q, k, v, scale="0.1")
    with pytest.raises(ValueError, match=r"^v: heads and length"):
        cft.attention(q, k, v[..., :3, :])
    with pytest.raises(TypeError, match=r"^deterministic"):
        cft.attention(q, k, v, deterministic=1)


# ----------------------------------------------------------------------------- the SDPA entry point


def _sdpa64(q, k, v, do, causal, scale, gqa):
    args = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=causal, scale=scale,
                                                         **({"enable_gqa": True} if gqa else {}))
    o.backward(torch.from_numpy(do.astype(np.float64)))
    return o.detach().numpy(), [a.grad.numpy() for a in args]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_matches_torch_semantics(rng, dtype, causal):
    """Against torch SDPA in float64 on the same inputs (top-left causal with Nq != Nk, GQA,
    a scale), under the project's rule."""
    q, k, v = random_inputs(rng, (2, 4, 6, 16), (2, 2, 9, 16), dtype)
    do = random_array(rng, q.shape, dtype)
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    o = cft.scaled_dot_product_attention(*ts, is_causal=causal, scale=0.3, enable_gqa=True)
    assert o.dtype == ts[0].dtype
    o.backward(T(do))
    ref_o, ref_grads = _sdpa64(q, k, v, do, causal, 0.3, True)
    mode = "top_left" if causal else False
    assert_within_rule("o", N(o), ref_o, faithful_realizations(q, k, v, causal=mode, scale=0.3), dtype)
    yards = faithful_backward_realizations(do, q, k, v, causal=mode, scale=0.3)
    for name, g, r, y in zip(("dq", "dk", "dv"), _grads(ts), ref_grads, yards):
        assert_within_rule(name, g, r, y, dtype)


def test_sdpa_refuses_what_it_does_not_support(rng):
    q, k, v = (T(a) for a in random_inputs(rng, (1, 4, 3, 8), (1, 2, 3, 8), np.float32))
    with pytest.raises(ValueError, match=r"^attn_mask: cuflash has no dense attention masks"):
        cft.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^dropout_p:"):
        cft.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"^key: 2 heads differ from query's 4; pass enable_gqa=True"):
        cft.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match=r"^is_causal"):
        cft.scaled_dot_product_attention(q, k, v, is_causal=1, enable_gqa=True)


# ----------------------------------------------------------------------------- torch.compile


class Block(torch.nn.Module):
    """A small pre-norm transformer block (GQA attention + MLP) whose attention is cuflash."""

    def __init__(self, dim=32, heads=4, kv_heads=2, attn=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.attn = attn or (lambda q, k, v: cft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        o = self.attn(q, k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def _recording_backend(graphs):
    """aot_eager that keeps the forward and backward graphs it compiles."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _targets(graphs):
    """The operators the graphs call (a mutating operator appears inside auto_functionalized)."""
    found = set()
    for g in graphs:
        for n in g.graph.nodes:
            if n.op == "call_function":
                found.add(str(n.target))
                found.update(str(a) for a in n.args if isinstance(a, torch._ops.OpOverload))
    return found


def _run_block(block, x):
    out = block(x)
    out.square().mean().backward()
    return out.detach().clone(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_block_matches_eager(dynamic):
    """torch.compile(fullgraph=True) traces the block with cuflash's operators in its graphs (no
    graph break: fullgraph raises on one) and gives eager's outputs and gradients bit for bit."""
    torch.manual_seed(0)
    block = Block()
    x0 = torch.randn(2, 7, 32)
    x = x0.clone().requires_grad_()
    eager = _run_block(block, x)
    block.zero_grad()
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=_recording_backend(graphs), fullgraph=True, dynamic=dynamic)
    x = x0.clone().requires_grad_()
    got = _run_block(compiled, x)
    targets = _targets(graphs)
    assert "cuflash.attention.default" in targets and "cuflash.attention_backward.default" in targets, targets
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    for g, e in zip(got[2], eager[2]):
        assert torch.equal(g, e)


def test_compile_fullgraph_kv_cache_and_out():
    """A decode step (kv_lens, a paged cache, out=) traces without a graph break too."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 1, 16)
    cache_k, cache_v = torch.randn(4, 16, 2, 16), torch.randn(4, 16, 2, 16)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)

    def step(q, lens):
        dense = cft.attention(q, cache_k[:2].flatten(0, 1).transpose(0, 1)[None].expand(2, -1, -1, -1),
                              cache_v[:2].flatten(0, 1).transpose(0, 1)[None].expand(2, -1, -1, -1), kv_lens=lens)
        paged = cft.attention(q, cache_k, cache_v, block_table=table, kv_lens=lens, validate=False)
        out = torch.empty_like(q)
        cft.attention(q, cache_k, cache_v, block_table=table, kv_lens=lens, out=out)
        return dense, paged, out

    lens = torch.tensor([19, 32], dtype=torch.int32)
    eager = step(q, lens)
    graphs = []
    torch._dynamo.reset()
    got = torch.compile(step, backend=_recording_backend(graphs), fullgraph=True)(q, lens)
    assert {"cuflash.attention.default", "cuflash.attention_out.default"} <= _targets(graphs)
    for g, e in zip(got, eager):
        assert torch.equal(g, e)
    assert torch.equal(eager[1], eager[2])


# ----------------------------------------------------------------------------- GPU


def _cuda_inputs(rng, shape_q, shape_kv, dtype=np.float16):
    return [T(a, "cuda") for a in random_inputs(rng, shape_q, shape_kv, dtype)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")])
def test_gpu_sdpa_and_gradients_within_rule(rng, dtype):
    q, k, v = random_inputs(rng, (2, 4, 70, 64), (2, 2, 90, 64), dtype)
    do = random_array(rng, q.shape, dtype)
    ts = [T(a, "cuda").requires_grad_() for a in (q, k, v)]
    o = cft.scaled_dot_product_attention(*ts, is_causal=True, enable_gqa=True)
    o.backward(T(do, "cuda"))
    torch.cuda.synchronize()
    ref_o, ref_grads = _sdpa64(q, k, v, do, True, None, True)
    assert_within_rule("o", N(o), ref_o, faithful_realizations(q, k, v, causal="top_left"), dtype)
    yards = faithful_backward_realizations(do, q, k, v, causal="top_left")
    for name, g, r, y in zip(("dq", "dk", "dv"), _grads(ts), ref_grads, yards):
        assert_within_rule(name, g, r, y, dtype)


def test_varlen_max_seqlens_gradients(rng):
    # max_seqlen_q / max_seqlen_k (ints, validate=False) travel through both operators: the same
    # o and gradients as cuflash's own call; an int-like float is refused by name.
    q, k, v = random_inputs(rng, (9, 4, 8), (11, 2, 8), np.float16)
    do = random_array(rng, q.shape, np.float16)
    cu_q, cu_k = np.array([0, 4, 4, 9], dtype=np.int32), np.array([0, 5, 7, 11], dtype=np.int32)
    lengths = dict(max_seqlen_q=5, max_seqlen_k=np.int32(6), validate=False)
    ts = [T(a).requires_grad_() for a in (q, k, v)]
    o = cft.attention(*ts, cu_seqlens_q=T(cu_q), cu_seqlens_k=T(cu_k), causal=True, **lengths)
    o.backward(T(do))
    want_o, vjp = cuflash.attention_vjp(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert same(N(o), want_o)
    for g, w in zip(_grads(ts), vjp(do)):
        assert same(g, w)
    with pytest.raises(TypeError, match=r"^max_seqlen_q: expected an int, got float"):
        cft.attention(*ts, cu_seqlens_q=T(cu_q), cu_seqlens_k=T(cu_k), max_seqlen_q=5.0)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: only with cu_seqlens_q / cu_seqlens_k"):
        cft.attention(T(q[None]), T(k[None]), T(v[None]), max_seqlen_k=3)


@pytest.mark.gpu
def test_gpu_varlen_max_seqlens_replay_in_a_torch_cuda_graph(rng):
    """torch.cuda.graph captures a packed call with max_seqlen_* and validate=False (no host read);
    replayed after new offsets are written in place, it equals a direct validated call."""
    q, k, v = _cuda_inputs(rng, (300, 4, 128), (420, 2, 128))
    cu_q = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 150, 170, 420], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    lengths = dict(max_seqlen_q=200, max_seqlen_k=250, validate=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, plans)
        cft.attention(q, k, v, **kw, **lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = cft.attention(q, k, v, **kw, **lengths)
    for new_q, new_k in (([0, 200, 250, 300], [0, 250, 400, 420]), ([0, 0, 100, 300], [0, 5, 170, 420])):
        cu_q.copy_(torch.tensor(new_q, dtype=torch.int32))
        cu_k.copy_(torch.tensor(new_k, dtype=torch.int32))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, cft.attention(q, k, v, **kw))


@pytest.mark.gpu
def test_gpu_options_match_cupy_path(rng):
    """varlen + window with gradients, kv_lens and paged decode: the torch adapter gives what
    cuflash gives on the same CUDA tensors."""
    q, k, v = _cuda_inputs(rng, (40, 4, 64), (50, 2, 64))
    do = torch.randn_like(q)
    cu_q = torch.tensor([0, 17, 17, 40], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 20, 31, 50], dtype=torch.int32, device="cuda")
    opts = dict(causal=True, window=(8, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    o = cft.attention(*ts, deterministic=True, **opts)  # reproducible dq, so both paths agree bit for bit
    o.backward(do)
    want_o, vjp = cuflash.attention_vjp(q, k, v, **opts)
    assert torch.equal(o, want_o)
    for t, w in zip(ts, vjp(do, deterministic=True)):
        assert torch.equal(t.grad, w)

    qd = torch.randn(3, 8, 1, 128, dtype=torch.float16, device="cuda")
    cache = [torch.randn(20, 64, 2, 128, dtype=torch.float16, device="cuda") for _ in range(2)]
    table = torch.randperm(20, device="cuda")[:18].view(3, 6).to(torch.int32)
    lens = torch.tensor([300, 1, 384], dtype=torch.int32, device="cuda")
    got = cft.attention(qd, *cache, block_table=table, kv_lens=lens, validate=False)
    assert torch.equal(got, cuflash.attention(qd, *cache, block_table=table, kv_lens=lens))


@pytest.mark.gpu
def test_gpu_score_modifiers_match_cupy_path(rng):
    """softcap, ALiBi and sinks on CUDA tensors: o, the gradients and dsinks equal cuflash's own
    calls on the same tensors (deterministic dq, so bit for bit)."""
    q, k, v = _cuda_inputs(rng, (2, 4, 70, 64), (2, 2, 90, 64))
    do = torch.randn_like(q)
    slopes = torch.rand(2, 4, device="cuda") * 0.4 + 0.01
    sinks = torch.randn(4, device="cuda")
    opts = dict(causal=True, softcap=4.0, alibi_slopes=slopes)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    t_sinks = sinks.clone().requires_grad_()
    o = cft.attention(*ts, sinks=t_sinks, deterministic=True, **opts)
    o.backward(do)
    want_o, want_lse = cuflash.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
    assert torch.equal(o, want_o)
    want = cuflash.attention_backward(do, q, k, v, want_o, want_lse, sinks=sinks, deterministic=True, **opts)
    for got, w in zip([t.grad for t in ts] + [t_sinks.grad], want):
        assert torch.equal(got, w)


@pytest.mark.gpu
def test_gpu_compile_fullgraph_block_matches_eager():
    torch.manual_seed(0)
    block = Block(dim=256, heads=4, kv_heads=2).cuda().to(torch.bfloat16)
    x0 = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    eager = _run_block(block, x0.clone().requires_grad_())
    block.zero_grad()
    graphs = []
    torch._dynamo.reset()
    got = _run_block(torch.compile(block, backend=_recording_backend(graphs), fullgraph=True),
                     x0.clone().requires_grad_())
    assert {"cuflash.attention.default", "cuflash.attention_backward.default"} <= _targets(graphs)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    for g, e in zip(got[2], eager[2]):
        assert torch.equal(g, e)


@pytest.mark.gpu
def test_gpu_inductor_calls_the_operators_unchanged(rng):
    """torch.compile's default backend (inductor) around cuflash: the operators run as extern
    calls on the same values, so outputs and gradients are eager's bit for bit (the scalings by 2
    are exact)."""
    q, k, v = _cuda_inputs(rng, (2, 8, 130, 64), (2, 2, 130, 64), BFLOAT16)
    g = torch.randn_like(q)

    def f(a, b, c):
        return cft.scaled_dot_product_attention(a * 2, b, c, is_causal=True, enable_gqa=True) * 2

    results = []
    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True)):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ts)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in ts])
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_reduce_overhead_decode_matches_eager():
    """A decode step (kv_lens, validate=False: nothing read on the host) compiled with
    mode="reduce-overhead": CUDA graphs are not skipped, and the replays give eager's results
    while the cache and kv_lens change between steps."""
    from torch._dynamo.utils import counters

    torch.manual_seed(2)
    b, hq, hkv, d, cap = 2, 8, 2, 128, 512
    k_cache = torch.randn(b, hkv, cap, d, dtype=torch.float16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((b,), 300, dtype=torch.int32, device="cuda")

    def step(q, kc, vc, n):
        return cft.attention(q, kc, vc, kv_lens=n, validate=False)

    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for t in range(6):
        q = torch.randn(b, hq, 1, d, dtype=torch.float16, device="cuda")
        k_cache[:, :, 300 + t] = torch.randn(b, hkv, d, dtype=torch.float16, device="cuda")
        v_cache[:, :, 300 + t] = torch.randn(b, hkv, d, dtype=torch.float16, device="cuda")
        lens.fill_(301 + t)
        got = compiled(q, k_cache, v_cache, lens).clone()
        torch.cuda.synchronize()
        want = cuflash.attention(q, k_cache, v_cache, kv_lens=lens)
        assert torch.equal(got, want), t
    assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])
