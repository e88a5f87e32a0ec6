"""MLA decoding's head dims (576 for q and k, 512 for v) on the NumPy backend and in validation:
the decode cases against the float64 reference (tests/_mla_cases.py), v as a strided view of k,
every rejected use naming its argument, and the plan and accounting of the pair."""

import numpy as np
import pytest
from _mla_cases import CASES, D, DV, check_mla

import cuflash
from cuflash.accounting import flops, io_model
from cuflash.backends import reference
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.plan import decode_mla, registry
from cuflash.testing import random_array

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_numpy_backend_matches_reference(rng, dtype, case):
    check_mla(rng, np, dtype, **CASES[case])


@pytest.mark.parametrize("case", ["mqa", "gqa"])
def test_v_separate(rng, case):
    check_mla(rng, np, BFLOAT16, v_alias=False, **CASES[case])


def test_reference_accepts_the_pair(rng):
    q = random_array(rng, (1, 4, 2, D), BFLOAT16)
    k = random_array(rng, (1, 1, 40, D), BFLOAT16)
    o = reference.attention(q, k, k[..., :DV], causal=True)
    assert o.shape == (1, 4, 2, DV)


def _inputs(nq=1, d=D, dv=DV, dtype=BFLOAT16, nk=300):
    rng = np.random.default_rng(0)
    q = random_array(rng, (1, 4, nq, d), dtype)
    k = random_array(rng, (1, 1, nk, d), dtype)
    return q, k, (k[..., :dv] if dv <= d else random_array(rng, (1, 1, nk, dv), dtype))


@pytest.mark.parametrize("kwargs,name,message", [
    (dict(nq=17), "q", "decode-only"),  # prefill shapes
    (dict(dv=576), "v", "must be 512"),
    (dict(dv=256), "v", "must be 512"),
    (dict(d=320, dv=256), "q", "larger than the largest supported"),
    (dict(d=512, dv=512), "q", "larger than the largest supported"),
])
def test_rejected_head_dims_name_the_argument(kwargs, name, message):
    q, k, v = _inputs(**kwargs)
    with pytest.raises(ValueError, match=rf"^{name}: .*{message}"):
        cuflash.attention(q, k, v)


def test_float32_rejected_naming_q():
    q, k, v = _inputs(dtype=np.float32)
    with pytest.raises(TypeError, match=r"^q: .*decode-only.*float32"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("option,name", [
    (dict(window=(64, 0)), "window"),
    (dict(softcap=30.0), "softcap"),
    (dict(sinks=np.zeros(4, dtype=np.float32)), "sinks"),
    (dict(alibi_slopes=np.ones(4, dtype=np.float32)), "alibi_slopes"),
])
def test_unsupported_options_name_themselves(option, name):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=rf"^{name}: .*decode-only"):
        cuflash.attention(q, k, v, **option)


def test_backward_and_packed_rejected():
    q, k, v = _inputs()
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"^q: no backward"):
        cuflash.attention_backward(o, q, k, v, o, lse)
    cu = np.array([0, 1], dtype=np.int32)
    cuk = np.array([0, 300], dtype=np.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: "):
        cuflash.attention(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                          cu_seqlens_q=cu, cu_seqlens_k=cuk)


def test_paged_v_of_another_width_rejected_outside_the_pair():
    rng = np.random.default_rng(1)
    q = random_array(rng, (1, 4, 1, 128), BFLOAT16)
    kc = random_array(rng, (4, 16, 1, 128), BFLOAT16)
    table = np.arange(4, dtype=np.int32)[None]
    with pytest.raises(ValueError, match=r"^v: "):
        cuflash.attention(q, kc, kc[..., :64], block_table=table)


def test_plan_row_blocks_and_splits():
    from types import SimpleNamespace

    p = SimpleNamespace(batch=1, hq=128, hkv=1, nq=1, nk=32768, d=D, dv=DV, group=128)
    plan = decode_mla.launch_plan(p, 132)
    assert plan.row_blocks == 4 and plan.row_tiles == 2  # 32 rows per block
    assert plan.splits * plan.chunk >= p.nk and plan.chunk % 32 == 0 and plan.chunk >= decode_mla.MIN_SPLIT_KEYS
    assert 4 * plan.splits <= 2 * 132 + 4
    p16 = SimpleNamespace(batch=1, hq=16, hkv=1, nq=1, nk=4096, d=D, dv=DV, group=16)
    assert decode_mla.launch_plan(p16, 132).row_tiles == 1
    assert decode_mla.launch_plan(p16, 132, splits=1).splits == 1
    p_nq = SimpleNamespace(batch=1, hq=16, hkv=1, nq=4, nk=4096, d=D, dv=DV, group=16)
    assert decode_mla.row_blocks(p_nq) == 2  # 64 rows -> two blocks of 32


def test_smem_of_every_instantiation_fits_sm90():
    for spec in decode_mla.all_mla_specs():
        assert spec.smem_bytes <= 227 * 1024, spec
    assert "decode_mla" in registry.FAMILIES


def test_flops_count_qk_over_576_and_pv_over_512():
    f = flops((2, 16, 1, D), (2, 1, 4096, D), dv=DV)
    assert f.pairs == 2 * 16 * 4096 and f.flops == 2 * f.pairs * (D + DV)


def test_io_model_reads_the_cache_once_when_v_aliases_k():
    shared = io_model((4, 16, 1, D), nk=8192, hkv=1, dv=DV)
    separate = io_model((4, 16, 1, D), nk=8192, hkv=1, dv=DV, v_aliases_k=False)
    read = {e.name: e.reads for e in shared.entries}
    assert read["K"] == 4 * 8192 * D and read["V"] == 0
    assert {e.name: e.reads for e in separate.entries}["V"] == 4 * 8192 * DV
    with pytest.raises(ValueError, match=r"^shape: "):
        io_model((4, 16, 32, D), nk=8192, hkv=1, dv=DV)


def test_splits_keep_the_partials_within_a_quarter_of_the_cache():
    """Each split writes rows x 512 float32 partials that the combine reads again: at Hq = 128 the
    split count that fills the SMs would nearly double the bytes moved; the cap holds them to
    MAX_PARTIAL_SHARE of the cache's bytes, and a cache too short to split runs whole."""
    from types import SimpleNamespace

    for hq, nk in ((128, 32768), (128, 4096), (16, 32768), (16, 1024)):
        p = SimpleNamespace(batch=1, hq=hq, hkv=1, nq=1, nk=nk, d=D, dv=DV, group=hq)
        s = decode_mla.num_splits(p, 132)
        partials = 2 * hq * DV * 4 * s
        assert s == 1 or partials <= decode_mla.MAX_PARTIAL_SHARE * nk * D * 2, (hq, nk, s)
        assert s * decode_mla.row_blocks(p) <= 132 and (s == 1 or nk / s >= decode_mla.MIN_SPLIT_KEYS)
    wide = SimpleNamespace(batch=1, hq=128, hkv=1, nq=1, nk=32768, d=D, dv=DV, group=128)
    assert decode_mla.num_splits(wide, 132) == 18  # 64 would fill the SMs


def test_memory_report_lists_the_mla_buffers():
    rep = cuflash.memory_report((1, 128, 1, D), (1, 1, 32768, D), (1, 1, 32768, DV), dtype="bfloat16")
    by = {e.name: e.bytes for e in rep.entries}
    splits = decode_mla.num_splits(type("P", (), dict(batch=1, hq=128, hkv=1, nq=1, nk=32768, group=128))(), 132)
    assert by["K"] == 32768 * D * 2 and by["V"] == 0 and by["Q"] == 128 * D * 2 and by["O"] == 128 * DV * 2
    assert by["O partials"] == 128 * splits * DV * 4 and by["LSE partials"] == 128 * splits * 4
    separate = cuflash.memory_report((2, 16, 1, D), (2, 1, 4096, D), (2, 1, 4096, DV), dtype="float16",
                                     v_aliases_k=False, splits=1)
    by = {e.name: e.bytes for e in separate.entries}
    assert by["V"] == 2 * 4096 * DV * 2 and "O partials" not in by
    for kw, name in ((dict(pass_="bwd"), "pass_"), (dict(method="reference"), "method"),
                     (dict(sinks=(128,)), "sinks")):
        with pytest.raises(ValueError, match=rf"^{name}: MLA decode"):
            cuflash.memory_report((1, 128, 1, D), (1, 1, 4096, D), (1, 1, 4096, DV), **kw)
