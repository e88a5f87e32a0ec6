"""Score modifiers (softcap, ALiBi, sinks) in the split-KV decode kernel, on the CPU: which problems
take it, that every instantiation its plans launch is in the compile list (test_compile builds
those for sm_90a, no spills), and that the modifier kernels mirror the plain ones tile for tile
(the GPU results are test_gpu_decode_mods.py's)."""

import re
import types

import numpy as np
import pytest

from cuflash.core import problem
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.plan import decode as plan_decode
from cuflash.plan import dispatch, schedule
from cuflash.plan.target import Target

SMS = 132


def _problem(batch, hq, hkv, nq, nk, d, causal=None, window=None, dtype=BFLOAT16):
    return types.SimpleNamespace(dtype=np.dtype(dtype), d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv,
                                 batch=batch, causal=causal, window=window, modified=True)


def _checked(batch, hq, hkv, nq, nk, d, **mods):
    q = np.zeros((batch, hq, nq, d), np.float16)
    k = np.zeros((batch, hkv, nk, d), np.float16)
    return problem.check_score_mods(problem.validate_forward(q, k, k), q, **mods)


def _args(expression):
    name, args = re.fullmatch(r"(\w+)<(.*)>", expression).groups()
    return name, [a.strip() for a in args.split(",")]


def _mod_name(plain):
    """The modifier counterpart of a plain attn_decode / attn_decode_cluster expression: the same
    type, tile and row tiles (and cluster size, ring), without causal and window."""
    name, a = _args(plain)
    head, rest = a[:6] + [a[7]], a[8:]
    if name == "attn_decode_cluster":
        cluster, rest = rest[0], rest[1:]
        ring = rest[1] if len(rest) > 1 else "0"
        return f"attn_decode_cluster_mod<{', '.join(head)}, {cluster}, {ring}>"
    ring = rest[1] if len(rest) > 1 else "0"
    return f"attn_decode_mod<{', '.join(head)}, {ring}>"


def test_every_plain_decode_instantiation_has_its_modifier_kernel():
    specs = plan_decode.all_decode_specs()
    plain = [s for s in specs if _args(s.expression)[0] in ("attn_decode", "attn_decode_cluster")]
    mods = {s.short_name: s for s in specs if _args(s.expression)[0].endswith("_mod")}
    assert plain and mods
    mirrored = set()
    for s in plain:
        m = mods.get(_mod_name(s.expression).replace(" ", ""))
        assert m is not None, f"{s.expression} has no modifier instantiation in all_decode_specs"
        assert m.threads == s.threads  # (shared memory: test below, per launch)
        mirrored.add(m.short_name)
    assert mirrored == set(mods), f"modifier kernels without a plain one: {set(mods) - mirrored}"
    assert all("kv8" not in n and "tma" not in n for n in mods)  # (e4m3 caches and TMA take no modifiers)
    for dtype in (FLOAT16, BFLOAT16):
        assert set(plan_decode.mod_decode_specs(dtype)) <= set(specs)


@pytest.mark.parametrize("shape", [(1, 32, 8, 1, 131072, 128), (8, 32, 8, 1, 16384, 128), (256, 32, 8, 1, 4096, 128),
                                   (8, 64, 1, 1, 32768, 128), (32, 64, 1, 1, 16384, 64), (4, 32, 8, 4, 4096, 64),
                                   (2, 8, 2, 1, 65536, 256), (16, 64, 4, 1, 8192, 64), (3, 12, 4, 16, 2048, 128),
                                   (2, 8, 8, 3, 9000, 32), (4, 16, 16, 1, 30000, 192), (1, 128, 1, 1, 16384, 128)])
@pytest.mark.parametrize("causal,window", [(None, None), ("bottom_right", None), ("top_left", None),
                                           ("bottom_right", (300, 0))])
@pytest.mark.parametrize("cluster", [None, False])
def test_what_a_modified_decode_launches_is_compiled(shape, causal, window, cluster):
    p = _problem(*shape, causal=causal, window=window)
    assert dispatch.decode_applies(p, True)
    lp = plan_decode.launch_plan(p, SMS, cluster=cluster)  # (kernels.decode.forward's plan)
    spec = plan_decode.launch_spec(p.dtype, p.d, causal is not None, lp, window is not None, mods=True)
    plain = plan_decode.launch_spec(p.dtype, p.d, causal is not None, lp, window is not None)
    assert re.match(r"attn_decode(_cluster)?_mod<", spec.expression)
    assert spec.expression == _mod_name(plain.expression)
    assert (spec.threads, spec.smem_bytes) == (plain.threads, plain.smem_bytes)  # (no shared memory of their own)
    assert spec in set(plan_decode.all_decode_specs()), f"{spec.expression} is not compiled by test_compile"


@pytest.mark.parametrize("splits", [2, 4, 8, 3, 40])
def test_forced_splits_and_merges_are_compiled(splits):
    """The launches tests/test_gpu_decode_mods.py forces: a split count, merged in a cluster where it
    is a cluster size, else through memory."""
    names = {s.short_name for s in plan_decode.all_decode_specs()}
    for d, hq, nq in ((64, 8, 3), (128, 8, 3), (128, 16, 4)):
        p = _problem(4, hq, 2, nq, 4000, d, "bottom_right")
        lp = plan_decode.launch_plan(p, SMS, splits=splits)
        assert lp.cluster == (splits in plan_decode.CLUSTER_SIZES) and lp.row_tiles == -(-(hq // 2 * nq) // 16)
        assert lp.splits == splits or not lp.cluster and lp.splits * lp.chunk >= 4000
        spec = plan_decode.launch_spec(p.dtype, d, True, lp, False, mods=True)
        assert spec.short_name in names


def test_one_modifier_kernel_serves_every_mask():
    p = _problem(4, 32, 8, 2, 8192, 128)
    lp = plan_decode.launch_plan(p, SMS)
    names = {plan_decode.launch_spec(p.dtype, 128, causal, lp, window, mods=True).expression
             for causal in (False, True) for window in (False, True)}
    assert len(names) == 1
    plain = {plan_decode.launch_spec(p.dtype, 128, causal, lp, window).expression
             for causal in (False, True) for window in (False, True)}
    assert len(plain) == 4 and not names & plain


def test_which_problems_take_the_decode_kernel_with_modifiers():
    sinks, slopes = np.zeros(8, np.float32), np.zeros((2, 8), np.float32)
    for mods in (dict(softcap=30.0), dict(alibi_slopes=slopes), dict(sinks=sinks),
                 dict(softcap=50.0, alibi_slopes=slopes, sinks=sinks)):
        p = _checked(2, 8, 2, 1, 4096, 128, **mods)
        assert p.modified and dispatch.decode_applies(p, True)
        assert not dispatch.decode_applies(p, False)  # (rows without 16-byte copies: the prefill kernels)
        assert not dispatch.decode_applies(_checked(2, 8, 2, 64, 4096, 128, **mods), True)  # (prefill shapes)
        assert not dispatch.decode_applies(_checked(2, 8, 2, 1, 100, 128, **mods), True)  # (a short cache)
        # an e4m3 cache and the TMA kernel take none
        assert not dispatch.decode_applies_e4m3(p, True)
        assert dispatch.decode_applies_e4m3(_checked(2, 8, 2, 1, 4096, 128), True)
        h100 = Target(90, 132, "NVIDIA H100")
        t = schedule.DECODE_TMA_TILES[128]
        assert not dispatch.decode_tma_applies(p, t, h100, True)
        assert dispatch.decode_tma_applies(_checked(2, 8, 2, 1, 4096, 128), t, h100, True)


def test_no_modifier_kernel_for_an_e4m3_tile():
    t = schedule.DECODE_TILES_KV8[128]
    with pytest.raises(ValueError, match="mods"):
        plan_decode.decode_specs(BFLOAT16, 128, 1, False, True, t, mods=True)
