"""Shared by tests/test_mla_decode.py (NumPy) and tests/test_gpu_mla_decode.py (CuPy): MLA decoding,
q and k 576 wide, v the first 512 columns of k (a strided view) or its own array, against the
float64 reference by the accuracy rule - each sequence over its own first kv_lens[b] keys, a paged
cache against the contiguous keys its pages hold. Fresh random inputs, poisoned outputs."""

from __future__ import annotations

import numpy as np

import cuflash
from cuflash.testing import assert_forward_accurate, random_array, to_numpy

D, DV = 576, 512


def poisoned(xp, shape, dtype):
    a = xp.empty(shape, dtype=dtype)
    a.view(np.uint16).fill(0x7FFF)  # NaN in float16 and bfloat16
    return a


def to_xp(xp, a):
    if xp is np:
        return a
    return xp.asarray(np.ascontiguousarray(a).view(np.uint16)).view(a.dtype)


def check_mla(rng, xp, dtype, *, batch=2, hq=16, hkv=1, nq=1, nk=300, causal=False, lens=None, v_alias=True,
              paged=None, scale=None, **call):
    """One attention call on ``xp`` arrays; o and lse of each sequence against the reference over its
    keys. ``lens``: kv_lens values (None: all nk); ``paged``: block size (the cache's pages shuffled);
    ``call``: further attention arguments (GPU tests: none - splits are forced by the caller)."""
    q = random_array(rng, (batch, hq, nq, D), dtype)
    cache = random_array(rng, (batch, hkv, nk, D), dtype)
    vsep = None if v_alias else random_array(rng, (batch, hkv, nk, DV), dtype)
    kw = {}
    if lens is not None:
        kw["kv_lens"] = to_xp(xp, np.asarray(lens, dtype=np.int32))
    if paged is None:
        kx = to_xp(xp, cache)
        vx = kx[..., :DV] if v_alias else to_xp(xp, vsep)
    else:
        bs = paged
        per = -(-nk // bs)
        order = rng.permutation(batch * per)  # page j of sequence b lives at block order[b * per + j]
        pages = np.zeros((batch * per, bs, hkv, D), dtype=dtype)
        vpages = np.zeros((batch * per, bs, hkv, DV), dtype=dtype)
        for b in range(batch):
            for j in range(per):
                rows = cache[b, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
                pages[order[b * per + j], :rows.shape[0]] = rows
                if vsep is not None:
                    vpages[order[b * per + j], :rows.shape[0]] = vsep[b, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
        kx = to_xp(xp, pages)
        vx = kx[..., :DV] if v_alias else to_xp(xp, vpages)
        kw["block_table"] = to_xp(xp, order.reshape(batch, per).astype(np.int32))
        if lens is None:  # the table's keys: per * bs; the reference's cache stops at nk
            kw["kv_lens"] = to_xp(xp, np.full(batch, nk, dtype=np.int32))
            lens = [nk] * batch
    if v_alias and xp is not np:
        assert vx.data.ptr == kx.data.ptr and vx.strides == kx.strides  # a view, no copy
    out = poisoned(xp, (batch, hq, nq, DV), dtype)
    o, lse = cuflash.attention(q if xp is np else to_xp(xp, q), kx, vx, causal=causal, scale=scale, return_lse=True,
                               out=out, **kw, **call)
    assert o is out
    o, lse = to_numpy(o), to_numpy(lse)
    v_ref = cache[..., :DV] if v_alias else vsep
    for b in range(batch):
        n = nk if lens is None else int(lens[b])
        assert_forward_accurate(o[b:b + 1], lse[b:b + 1], q[b:b + 1], cache[b:b + 1, :, :n],
                                np.ascontiguousarray(v_ref[b:b + 1, :, :n]), causal=causal, scale=scale)
    return o, lse


# (name, options) of the cases both backends run
CASES = {
    "mqa": dict(hq=16, hkv=1, nq=1, nk=300),
    "mqa_lens": dict(hq=16, hkv=1, nq=1, nk=700, lens=[700, 45]),
    "mqa_empty_seq": dict(hq=16, hkv=1, nq=1, nk=300, lens=[0, 300]),
    "gqa": dict(hq=8, hkv=2, nq=1, nk=260),
    "causal_nq4": dict(hq=8, hkv=1, nq=4, nk=333, causal=True, lens=[333, 100]),
    "rows_48": dict(hq=48, hkv=1, nq=1, nk=270),  # 48 packed rows: two row blocks of 24 (two row tiles each)
    "paged": dict(hq=16, hkv=1, nq=2, nk=400, paged=16, causal=True),
    "paged_lens": dict(hq=16, hkv=1, nq=1, nk=500, paged=64, lens=[500, 130]),
    "scale": dict(hq=16, hkv=1, nq=1, nk=300, scale=0.1352),
}
