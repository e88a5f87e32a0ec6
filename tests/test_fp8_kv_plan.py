"""The e4m3 K/V cache's decode plans on the CPU: its tiles' shared memory, the instantiations the
CPU compile test covers, and which problems the kernel takes (the GPU results are
test_gpu_fp8_kv_cache.py's)."""

import types

import numpy as np
import pytest

from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.plan import decode as plan_decode
from cuflash.plan import dispatch, schedule

SMS = 132


def _problem(batch, hq, hkv, nq, nk, d, causal=None, dtype=BFLOAT16, window=None):
    return types.SimpleNamespace(dtype=np.dtype(dtype), d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv,
                                 batch=batch, causal=causal, window=window)


@pytest.mark.parametrize("hd", sorted(schedule.DECODE_TILES_KV8))
def test_kv8_tiles_keep_the_16_bit_tiles_shared_memory(hd):
    """Half the bytes per key in twice the keys (twice the stages, or key tiles twice as long): the
    same bytes in flight, the same shared memory (so the same blocks per SM and merge buffer) as the
    16-bit table's tile, and the same packed rows."""
    t8, t16 = schedule.DECODE_TILES_KV8[hd], schedule.DECODE_TILES[hd]
    assert t8.kv_bytes == 1 and t16.kv_bytes == 2 and t8.ring <= 2
    assert t8.max_row_tiles == t16.max_row_tiles
    for rt in range(1, t16.max_row_tiles + 1):
        assert t8.smem_bytes(hd, rt) == t16.smem_bytes(hd, rt)
        assert t8.buffer_bytes(hd, rt) == 16 * rt * hd * 2 + t8.warps * 2 * t8.stages * t8.block_n * hd


def test_all_decode_specs_list_every_kv8_instantiation():
    names = {s.short_name for s in plan_decode.all_decode_specs()}
    for dtype in (FLOAT16, BFLOAT16):
        for hd, t in schedule.DECODE_TILES_KV8.items():
            for rt in range(1, t.max_row_tiles + 1):
                for causal in (False, True):
                    for window in (False, True):
                        main = plan_decode.decode_specs(dtype, hd, rt, causal, True, t, window)[0]
                        assert main.expression.startswith("attn_decode_kv8<") and main.short_name in names
                        for size in plan_decode.CLUSTER_SIZES:
                            spec = plan_decode.cluster_spec(dtype, hd, rt, causal, True, size, t, window)
                            assert spec.expression.startswith("attn_decode_cluster_kv8<")
                            assert spec.short_name in names
                            assert (spec.threads, spec.smem_bytes) == (main.threads, main.smem_bytes)


@pytest.mark.parametrize("shape", [(1, 32, 8, 1, 131072, 128), (8, 32, 8, 1, 16384, 128), (64, 32, 8, 1, 16384, 128),
                                   (8, 64, 1, 1, 32768, 128), (4, 32, 8, 4, 4096, 64), (2, 8, 2, 1, 65536, 256),
                                   (16, 64, 4, 1, 8192, 64), (3, 12, 4, 16, 2048, 128)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("cluster", [None, False])
def test_what_an_e4m3_cache_launches_is_compiled(shape, causal, cluster):
    p = _problem(*shape, causal=causal)
    assert dispatch.decode_applies_e4m3(p, True)
    t, waves = plan_decode.e4m3_launch(p, SMS)
    assert t is schedule.DECODE_TILES_KV8[schedule.head_dim_bucket(p.d)]
    lp = plan_decode.launch_plan(p, SMS, tile=t, waves=waves, cluster=cluster)  # (kernels.decode.forward's plan)
    spec = plan_decode.launch_spec(p.dtype, p.d, causal is not None, lp)
    assert "_kv8<" in spec.expression
    assert spec.short_name in {s.short_name for s in plan_decode.all_decode_specs()}


def test_an_e4m3_cache_splits_for_two_waves_few_pairs_included():
    few = _problem(1, 32, 8, 1, 131072, 128)  # 8 pairs: two waves' 33 splits (one wave's 16 lost on an H200)
    t, waves = plan_decode.e4m3_launch(few, SMS)
    assert t is schedule.DECODE_TILES_KV8[128] and waves is None
    assert plan_decode.launch_plan(few, SMS, tile=t, waves=waves).splits == -(-2 * SMS // 8)
    many = _problem(8, 32, 8, 1, 16384, 128)  # 64 pairs: two waves (4 splits)
    t, waves = plan_decode.e4m3_launch(many, SMS)
    assert waves is None
    assert plan_decode.launch_plan(many, SMS, tile=t, waves=waves).splits == 4
    # A caller's tile or waves are kept as given.
    mine = schedule.DECODE_TILES_KV8[64]
    assert plan_decode.e4m3_launch(few, SMS, tile=mine) == (mine, None)
    assert plan_decode.e4m3_launch(few, SMS, waves=1) == (schedule.DECODE_TILES_KV8[128], 1)
    assert plan_decode.launch_plan(few, SMS, tile=t, waves=1).splits == SMS // 8


def test_which_problems_the_e4m3_kernel_takes():
    assert not dispatch.decode_applies_e4m3(_problem(1, 8, 8, 1, 4096, 192), True)  # (no d = 192 tile)
    assert not dispatch.decode_applies_e4m3(_problem(1, 8, 8, 1, 4096, 128), False)  # (rows not 16-byte copies)
    assert not dispatch.decode_applies_e4m3(_problem(1, 8, 8, 64, 4096, 128), True)  # (prefill shapes)
    assert not dispatch.decode_applies_e4m3(_problem(1, 8, 8, 1, 100, 128), True)  # (a short cache)
    assert dispatch.decode_applies_e4m3(_problem(1, 8, 8, 1, 4096, 96), True)  # (the d = 128 kernel, zero-filled)


def test_io_model_reads_an_e4m3_cache_at_one_byte_per_element():
    from cuflash import accounting

    b, hq, hkv, nk, d = 8, 32, 8, 16384, 128
    m8 = accounting.io_model((b, hq, 1, d), nk=nk, hkv=hkv, kv_dtype="float8_e4m3fn")
    m16 = accounting.io_model((b, hq, 1, d), nk=nk, hkv=hkv)
    kv8 = {e.name: e for e in m8.entries if e.name in ("K", "V")}
    kv16 = {e.name: e for e in m16.entries if e.name in ("K", "V")}
    for name in ("K", "V"):
        assert (kv8[name].itemsize, kv8[name].reads) == (1, b * hkv * nk * d)  # each cache read once
        assert kv16[name].itemsize == 2 and kv8[name].bytes * 2 == kv16[name].bytes
    q8 = next(e for e in m8.entries if e.name == "Q")
    assert q8.itemsize == 2  # (q and o stay 16-bit)


def test_io_model_kv_dtype_errors():
    from cuflash import accounting

    with pytest.raises(TypeError, match="kv_dtype"):
        accounting.io_model((1, 8, 1, 128), nk=4096, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        accounting.io_model((1, 8, 1, 128), nk=4096, dtype="float32", kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="kv_dtype"):
        accounting.io_model((1, 8, 1, 128), nk=4096, pass_="bwd", kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="kv_dtype"):  # (prefill shapes: no e4m3 kernel)
        accounting.io_model((1, 8, 512, 128), kv_dtype="float8_e4m3fn")
