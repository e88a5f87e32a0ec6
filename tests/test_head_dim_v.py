"""v's head dim unlike q's and k's (dv != d, MLA's 192 / 128): cuflash.attention and
attention_backward on the NumPy backend against the float64 reference by the accuracy rule,
through every entry that takes it (GQA, masks, windows, score modifiers, packed sequences,
kv_lens, 2-D inputs, the adapters), the FLOP count, and the errors for what does not take it."""

import numpy as np
import pytest
from _head_dim_v_cases import check_forward_backward, matrix, shapes

import cuflash
from cuflash.backends import reference
from cuflash.core.arrays import BFLOAT16
from cuflash.plan.schedule import HOPPER_FORWARD_DV_TILES
from cuflash.testing import (assert_backward_accurate, assert_forward_accurate, random_array, reference64)


@matrix
def test_forward_and_backward(rng, dtype, causal, layout, d, dv):
    check_forward_backward(rng, np, dtype, layout, causal, d, dv)


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_window_and_score_modifiers(rng, d, dv):
    check_forward_backward(rng, np, BFLOAT16, "bhsd", True, d, dv, window=(20, -1))
    sinks = rng.standard_normal(4).astype(np.float32)
    slopes = np.abs(rng.standard_normal(4)).astype(np.float32)
    sq, sk, sv = shapes("bhsd", 2, 4, 2, 50, 60, d, dv)
    q, k, v = (random_array(rng, s, BFLOAT16) for s in (sq, sk, sv))
    mods = dict(softcap=4.0, alibi_slopes=slopes, sinks=sinks)
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **mods)
    assert_forward_accurate(o, lse, q, k, v, causal=True, **mods)
    do = random_array(rng, o.shape, BFLOAT16)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, **mods)
    assert grads[2].shape == sv and grads[3].shape == (4,)
    assert_backward_accurate(grads, do, q, k, v, causal=True, **mods)


def test_packed_sequences_and_kv_lens(rng):
    cu = np.array([0, 20, 50, 51], np.int32)
    q, k = (random_array(rng, (51, 4, 64), BFLOAT16) for _ in range(2))
    v = random_array(rng, (51, 2, 32), BFLOAT16)[:, :2]
    k = k[:, :2]
    o, lse = cuflash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    assert o.shape == (51, 4, 32)
    do = random_array(rng, o.shape, BFLOAT16)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    for a, b in zip(cu[:-1], cu[1:]):
        s = slice(a, b)
        assert_forward_accurate(o[s], lse[:, s], q[s], k[s], v[s], causal=True, layout="bshd")
        assert_backward_accurate([g[s] for g in grads], do[s], q[s], k[s], v[s], causal=True, layout="bshd")
    # one query token against caches filled to different lengths
    q1 = random_array(rng, (2, 4, 1, 64), BFLOAT16)
    kc = random_array(rng, (2, 2, 80, 64), BFLOAT16)
    vc = random_array(rng, (2, 2, 80, 32), BFLOAT16)
    lens = np.array([80, 9], np.int32)
    o1, l1 = cuflash.attention(q1, kc, vc, causal=True, kv_lens=lens, return_lse=True)
    for b in range(2):
        n = lens[b]
        assert_forward_accurate(o1[b:b + 1], l1[b:b + 1], q1[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n],
                                causal=True)


def test_single_head_and_reference(rng):
    q, k = random_array(rng, (30, 48), np.float16), random_array(rng, (40, 48), np.float16)
    v = random_array(rng, (40, 16), np.float16)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    assert o.shape == (30, 16)
    assert_forward_accurate(o, lse, q, k, v)
    ref = reference.attention(q, k, v, precision="float64")
    assert ref.shape == (30, 16)
    assert np.abs(ref - reference64(q, k, v)[0]).max() < 1e-12


def test_flops_count_each_product_by_its_width():
    # forward: S over d, O over dv; backward: S, dQ, dK over d, dP, dV over dv
    pairs = 4 * 100 * 100
    for pass_, want in (("fwd", 2 * (192 + 128)), ("bwd", 2 * (3 * 192 + 2 * 128)),
                        ("fwd+bwd", 2 * (4 * 192 + 3 * 128))):
        c = cuflash.flops((1, 4, 100, 192), (1, 4, 100, 192), pass_=pass_, dv=128)
        assert c.flops == pairs * want
        assert cuflash.flops((1, 4, 100, 64), (1, 4, 100, 64), pass_=pass_, dv=64).flops == \
            cuflash.flops((1, 4, 100, 64), (1, 4, 100, 64), pass_=pass_).flops


@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128)])
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_memory_report_sizes_each_tensor_by_its_head_dim(d, dv, pass_, monkeypatch):
    monkeypatch.setenv("CUFLASH_KERNELS", "auto")  # (the modelled H200 with its Hopper kernels)
    B, Hq, Hkv, N = 2, 8, 2, 1000
    q_bytes, kv_bytes = B * Hq * N * 2, B * Hkv * N * 2  # per head-dim column, bf16
    want = {"Q": q_bytes * d, "K": kv_bytes * d, "V": kv_bytes * dv}
    if pass_ != "bwd":
        want["O"] = q_bytes * dv
    if pass_ != "fwd":
        want.update({"dO": q_bytes * dv, "dQ": q_bytes * d, "dK": kv_bytes * d, "dV": kv_bytes * dv, "O": q_bytes * dv})
    for method in ("tiled", "reference"):
        r = cuflash.memory_report((B, Hq, N, d), (B, Hkv, N, d), (B, Hkv, N, dv), pass_=pass_, method=method)
        got = {e.name: e.bytes for e in r.entries}
        for name, nbytes in want.items():
            assert got[name] == nbytes, (method, name)
        copies = {e.name: e for e in r.entries if "zero-padded" in e.name}
        if method == "reference":
            assert not copies
            continue
        # the GPU pads the narrower tensors to max(d, dv) in each pass that reads or writes them,
        # but the forward on the dv kernel (plan.dispatch.head_dim_v_plan: (192, 128) here)
        fwd_native = (d, dv) in HOPPER_FORWARD_DV_TILES
        w = max(d, dv)
        narrow = [n for n in want if (d if n in ("Q", "K", "dQ", "dK") else dv) < w]
        assert narrow
        for n in narrow:
            pads = [e for name, e in copies.items() if name.startswith(n + " (")]
            assert all(e.bytes == want[n] // min(d, dv) * w for e in pads), n
            phases = {"fwd": {"fwd"}, "bwd": {"bwd"}, "fwd+bwd": {"fwd", "bwd"}}[pass_]
            if n not in ("Q", "K", "V", "O"):
                phases = {"bwd"}
            if fwd_native:
                phases = phases - {"fwd"}
            assert {e.phase for e in pads} == phases, n
        assert r.shape["dv"] == dv and r.shape["d"] == d


def test_errors_name_the_argument(rng):
    q, k = random_array(rng, (1, 2, 8, 64), BFLOAT16), random_array(rng, (1, 2, 8, 64), BFLOAT16)
    v = random_array(rng, (1, 2, 8, 32), BFLOAT16)
    with pytest.raises(ValueError, match="v: head dim 300"):
        cuflash.attention(q, k, np.zeros((1, 2, 8, 300), BFLOAT16))
    with pytest.raises(ValueError, match="out: expected shape"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, BFLOAT16))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="do: expected q's shape with v's head dim"):
        cuflash.attention_backward(q, q, k, v, o, lse)
    with pytest.raises(ValueError, match="out\\[2\\]: expected shape"):
        cuflash.attention_backward(o, q, k, v, o, lse, out=(np.empty_like(q), np.empty_like(k), np.empty_like(k)))
    with pytest.raises(ValueError, match="v: shape .* must equal k's"):  # paged caches: one head dim
        cuflash.attention(random_array(rng, (1, 2, 1, 64), BFLOAT16), random_array(rng, (2, 16, 2, 64), BFLOAT16),
                          random_array(rng, (2, 16, 2, 32), BFLOAT16), block_table=np.arange(2, dtype=np.int32)[None])
    with pytest.raises(ValueError, match="k: head dim"):
        cuflash.attention(q, v, v)


def test_torch_and_jax_adapters(rng):
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    sq, sk, sv = shapes("bhsd", 2, 4, 2, 30, 40, 64, 32)
    q, k, v = (random_array(rng, s, np.float32).astype(BFLOAT16) for s in (sq, sk, sv))
    ts = [torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).requires_grad_() for a in (q, k, v)]
    o = ct.attention(*ts, causal=True)
    assert tuple(o.shape) == sq[:-1] + (32,)
    do = torch.randn_like(o)
    o.backward(do)
    want_o, want_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    want = cuflash.attention_backward(do.float().numpy().astype(BFLOAT16), q, k, v, want_o, want_lse, causal=True)
    for t, w in zip(ts, want):
        assert np.array_equal(t.grad.float().numpy(), w.astype(np.float32))
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.experimental.buffer_callback")
    import cuflash.jax as cj

    oj = jax.jit(lambda a, b, c: cj.attention(a, b, c, causal=True))(q, k, v)
    assert oj.shape == sq[:-1] + (32,) and np.array_equal(np.asarray(oj).astype(np.float32), want_o.astype(np.float32))
