"""The backward K/V kernel with Q and dO fetched by TMA (attn_bwd_kv_wgmma_tma), through the public
API with the Hopper table patched to its TMA variant, against the float64 reference by the
naive-error rule (test_gpu_backward's _run: inputs unchanged, dq/dk/dv within the bound).

What TMA changes is addressing: boxes of block_m query rows per (head, batch) over rank-4 maps,
zero-filled past nq and past d. So: ragged lengths, padded head dims, GQA (query heads of a group
stepped by the kernel), batches, bshd strides, rows that see no key, both dQ modes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import backward as backward_kernels
from cuflash.plan import hopper as plan_hopper
from test_gpu_backward import _run

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def tma_backward(monkeypatch):
    from cuflash.kernels import tma

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("not a Hopper GPU: attn_bwd_kv_wgmma_tma needs sm_90")
    if not tma.available():
        pytest.skip("cuda-bindings is not installed: tensor maps cannot be encoded")
    monkeypatch.setenv("CUFLASH_KERNELS", "auto")
    launched = []
    real = plan_hopper.backward_kv_spec

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        launched.append(out[0].expression)
        return out

    monkeypatch.setattr(plan_hopper, "backward_kv_spec", recording)
    for hd, t in list(schedule.HOPPER_BACKWARD_TILES.items()):
        monkeypatch.setitem(schedule.HOPPER_BACKWARD_TILES, hd, plan_hopper.backward_tma(t) if not t.tma else t)
    monkeypatch.setattr(schedule, "HOPPER_BACKWARD_WS", {})  # the TMA kernel itself, not the warp-specialized one
    yield launched
    assert launched and all("attn_bwd_kv_wgmma_tma<" in e for e in launched), launched


DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
CAUSAL = [False, "bottom_right", "top_left"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 64, 96, 128, 160, 192, 200, 256])  # (160-256: the split-head-dim 256 kernel)
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "br", "tl"])
def test_head_dims(dtype, d, causal):
    rng = np.random.default_rng([d, len(str(causal)), dtype.itemsize, 23])
    _run(rng, 2, 2, 2, 97, 130, d, dtype, causal)


@pytest.mark.parametrize("nq,nk", [(113, 203), (203, 113), (257, 255), (255, 257), (1000, 300)])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "br", "tl"])
def test_lengths(nq, nk, causal):
    rng = np.random.default_rng([nq, nk, len(str(causal)), 5])
    _run(rng, 2, 2, 2, nq, nk, 64, BFLOAT16, causal)
    _run(rng, 1, 2, 1, nq, nk, 128, BFLOAT16, causal)
    _run(rng, 1, 2, 1, nq, nk, 256, FLOAT16, causal)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_gqa_and_deterministic(hq, hkv, deterministic, d):
    rng = np.random.default_rng([hq, hkv, int(deterministic), d])
    _run(rng, 2, hq, hkv, 150, 170, d, BFLOAT16, True, deterministic=deterministic)


@pytest.mark.parametrize("causal", CAUSAL[1:], ids=["br", "tl"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_causal_launch_order(d, causal):
    # Causal grids launch longest blocks first in groups of 4 (batch, K/V head) pairs: 2 x 5 pairs
    # make two whole groups and one of 2, with GQA and ragged lengths (each block must still find
    # its own key tile, head and batch entry).
    rng = np.random.default_rng([d, len(causal), 71])
    _run(rng, 2, 10, 5, 200, 331, d, BFLOAT16, causal)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_bshd_and_fully_masked_rows(d):
    rng = np.random.default_rng(d + 1)
    dq, dk, dv = _run(rng, 2, 4, 2, 150, 60, d, BFLOAT16, "bottom_right", layout="bshd")
    assert np.all(dq[:, :90].astype(np.float32) == 0)


@pytest.mark.parametrize("math_stats", [False, True], ids=["producer_stats", "math_stats"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "br", "tl"])
def test_warp_specialized(monkeypatch, tma_backward, dtype, d, causal, math_stats):
    # attn_bwd_kv_wgmma_ws: producer warpgroup (TMA Q/dO + lse/D on a 2-stage mbarrier ring), dQ
    # added by its dQ warp from shared memory into fragment-order 64 x 64 chunks, reordered by
    # attn_bwd_dq_convert<..., true>. Ragged lengths (padded chunk rows must not leak into dQ), GQA (several
    # heads per block, many steps through the ring), bshd, rows that see no key; deterministic
    # falls back to the TMA kernel.
    t = schedule.HOPPER_BACKWARD_TILES[d]
    # (math_stats: lse and D copied by the math warpgroups a step ahead, not by the producer)
    monkeypatch.setitem(schedule.HOPPER_BACKWARD_TILES, d,
                        dataclasses.replace(plan_hopper.backward_tma(t), ws=True, math_stats=math_stats))
    rng = np.random.default_rng([d, len(str(causal)), dtype.itemsize, 47])
    _run(rng, 2, 2, 2, 97, 130, d, dtype, causal)
    _run(rng, 1, 8, 2, 1000, 300, d, dtype, causal)
    _run(rng, 2, 4, 2, 150, 60, d, dtype, causal, layout="bshd")
    _run(rng, 1, 2, 2, 40, 100, d, dtype, causal)  # one step per head (one fill of the ring)
    # 9 (batch, K/V head) pairs: causal blocks launch longest first in groups of 4 pairs
    # (HopperBwdTraits::kLptHeads), the last group of one
    _run(rng, 3, 6, 3, 333, 290, d, dtype, causal)
    assert tma_backward and all(e.startswith("attn_bwd_kv_wgmma_ws<") and e.endswith(f"{str(math_stats).lower()}>")
                                for e in tma_backward), tma_backward
    tma_backward.clear()
    _run(rng, 1, 2, 1, 130, 97, d, dtype, causal, deterministic=True)
    assert tma_backward and all("attn_bwd_kv_wgmma_tma<" in e for e in tma_backward), tma_backward


@pytest.mark.parametrize("blocks", [3, None], ids=["3blocks", "per_sm"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "br", "tl"])
def test_warp_specialized_persistent(monkeypatch, tma_backward, blocks, d, causal):
    # attn_bwd_kv_wgmma_ws_persistent: blocks walk (key tile, K/V head, batch entry) units with the
    # Q/dO ring, its mbarrier phases and the dQ tiles' barriers running on across units, and dK/dV
    # staged in K/V's own tiles. 3 blocks: every block walks many units of different lengths
    # (causal), of several heads and batch entries, some with no step (rows that see no key).

    monkeypatch.setattr(backward_kernels, "_PERSISTENT_BLOCKS", blocks)
    t = schedule.HOPPER_BACKWARD_TILES[d]
    monkeypatch.setitem(schedule.HOPPER_BACKWARD_TILES, d,
                        dataclasses.replace(plan_hopper.backward_tma(t), ws=True, persistent=True))
    rng = np.random.default_rng([d, len(str(causal)), 59])
    _run(rng, 2, 2, 2, 97, 130, d, BFLOAT16, causal)
    _run(rng, 3, 6, 3, 333, 290, d, FLOAT16, causal)
    _run(rng, 2, 4, 2, 150, 60, d, BFLOAT16, causal, layout="bshd")
    _run(rng, 1, 2, 2, 40, 700, d, BFLOAT16, causal)  # one step per unit, many units
    assert tma_backward and all(e.startswith("attn_bwd_kv_wgmma_ws_persistent<") for e in tma_backward), tma_backward
    tma_backward.clear()
    _run(rng, 1, 2, 1, 130, 97, d, BFLOAT16, causal, deterministic=True)
    assert tma_backward and all("attn_bwd_kv_wgmma_tma<" in e for e in tma_backward), tma_backward
