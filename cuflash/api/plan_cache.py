"""The plans of cuflash.attention's recent decode geometries, so that a decoding loop's calls skip
validation, planning and CuPy's argument conversion.

A decode call's kernel takes 10-100 us on a few-thousand-key cache; re-validating, re-planning and
converting ~35 launch arguments took 90-200 us of host time per call on the H200 machine
(tools/decode_host_parts.py), so an eager decoding loop was bound by the host. A geometry seen
twice (all plain CuPy arrays or all plain CUDA torch tensors, with the same shapes, strides,
dtypes and device; same options; kv_lens / block_table given or not; for an FP8 KV cache, a
16-bit q with e4m3 k and v, the same k_descale / v_descale geometry, or the same of them not
given) is prepared once, as ``cuflash.prepare_attention`` does, and later calls of that geometry
run its decode fast path: per call the out= / alignment checks, kv_lens / block_table's
values when validate=True, fresh outputs and a packed launch. Results are bitwise those of the
uncached path (tests/test_gpu_plan_cache.py, tests/test_gpu_prepared_fp8_cache.py), and errors
too: any call the prepared plan cannot take exactly as attention would (out= of another layout,
K/V not 16-byte aligned, descales attention would copy first, an option that cannot be a
dictionary key) runs the uncached path.

A geometry is prepared on its second sighting, so that a loop whose shapes change every call (a
cache sliced to a growing length) pays only a key and two dictionary lookups. A plan keeps the
planner's choices of when it was made (CUFLASH_KERNELS and tuning settings read then). Set
``CUFLASH_PLAN_CACHE=0`` to turn it off; ``clear()`` empties it; ``stats()`` counts.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import OrderedDict

from ..core import config
from .prepared import PreparedAttention
from .prepared import _geometry as out_geometry

MISS = object()  # the call is not a cached decode geometry: run the uncached path
_NOT_DECODE = object()  # prepared, but not the decode fast path (prefill shapes, unaligned K/V...)

MAX_PLANS = 32  # decode geometries kept (a model has a few: its layers share one)
MAX_SEEN = 256  # geometries seen once, waiting for a second call

enabled = config.plan_cache_enabled()
_lock = threading.Lock()
_plans: OrderedDict = OrderedDict()
_seen: OrderedDict = OrderedDict()
_counts = {"hits": 0, "prepared": 0, "misses": 0}


def _cupy_geometry(a, ndarray):
    if a is None:
        return None
    if type(a) is not ndarray:
        raise TypeError  # not a plain CuPy array: no key
    return (a.shape, a.strides, a.dtype, a.data.device_id)


def _torch_geometry(a, tensor):
    if a is None:
        return None
    if type(a) is not tensor:
        raise TypeError  # not a plain torch.Tensor (a subclass, another kind): no key
    return (a.shape, a.stride(), a.dtype, a.device)


def _key(q, k, v, kv_lens, block_table, options, descales=(None, None)):
    """The dictionary key of a call, or None when it has none: not all plain CuPy arrays or all
    plain torch tensors, an unhashable option. Option values carry their types: scale=1 and
    scale=True, or causal=1 and causal=True, are different calls to the validation, so they must
    be different keys. ``descales``: an FP8 KV cache's (k_descale, v_descale), whose geometry is
    part of the key."""
    cupy = sys.modules.get("cupy")
    cls = getattr(cupy, "ndarray", None)
    if cls is not None and type(q) is cls:
        geometry = _cupy_geometry
    else:
        torch = sys.modules.get("torch")
        cls = getattr(torch, "Tensor", None)
        if cls is None or type(q) is not cls:
            return None
        geometry = _torch_geometry
    try:
        key = (cls, geometry(q, cls), geometry(k, cls), geometry(v, cls), geometry(kv_lens, cls),
               geometry(block_table, cls), geometry(descales[0], cls), geometry(descales[1], cls), options,
               tuple(map(type, options)))
        hash(key)
    except (TypeError, AttributeError):
        return None
    window = options[-1]
    if window is not None and (type(window) is not tuple or any(type(x) is not int for x in window)):
        return None  # (a tuple of NumPy ints hashes like one of ints but may not validate the same)
    return key


def run(q, k, v, kv_lens, block_table, out, options, descales=(None, None)):
    """cuflash.attention's result from a cached plan, or MISS. ``options`` = (causal, scale,
    layout, return_lse, validate, window), in prepare_attention's order below; ``descales`` =
    (k_descale, v_descale) of an FP8 KV cache."""
    if not enabled:
        return MISS
    key = _key(q, k, v, kv_lens, block_table, options, descales)
    if key is None:
        return MISS
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            if key not in _seen:
                _seen[key] = True
                if len(_seen) > MAX_SEEN:
                    _seen.popitem(last=False)
                _counts["misses"] += 1
                return MISS
            del _seen[key]
        else:
            _plans.move_to_end(key)
    if plan is None:
        plan = _prepare(q, k, v, kv_lens, block_table, options, descales)
        if plan is None:
            return MISS
        with _lock:
            _plans[key] = plan
            _counts["prepared"] += 1
            if len(_plans) > MAX_PLANS:
                _plans.popitem(last=False)
    if plan is _NOT_DECODE:
        return MISS
    if out is not None:
        if out_geometry(plan.kind, out) != plan.out_geometry:
            return MISS  # attention writes other layouts through a scratch array
    result = plan(dict(q=q, k=k, v=v, kv_lens=kv_lens, block_table=block_table, k_descale=descales[0],
                       v_descale=descales[1]), out)
    if result is None:
        return MISS
    with _lock:
        _counts["hits"] += 1
    return result


def _prepare(q, k, v, kv_lens, block_table, options, descales=(None, None)):
    """The decode fast path of this geometry (prepared.PreparedAttention's), _NOT_DECODE, or None
    for a call it rejects (invalid arguments or values): nothing is cached, and the uncached path
    raises its own error. Anything else that goes wrong while preparing (NotImplementedError
    included) leaves the geometry to the uncached path for good (_NOT_DECODE), which then fails or
    succeeds on its own."""
    causal, scale, layout, return_lse, validate, window = options
    try:
        prepared = PreparedAttention(q, k, v, dict(causal=causal, scale=scale, layout=layout, return_lse=return_lse,
                                                   window=window, validate=validate), kv_lens, block_table,
                                     descales=descales)
    except (TypeError, ValueError):
        return None
    except Exception:  # noqa: BLE001 - never fail a call the uncached path might run
        return _NOT_DECODE
    return prepared._decode if prepared._decode is not None else _NOT_DECODE


def clear():
    """Forget every plan and sighting (the counts stay)."""
    with _lock:
        _plans.clear()
        _seen.clear()


def stats() -> dict:
    """{"hits", "prepared", "misses", "plans"}: calls run from a plan, plans made, first sightings
    (calls with no key are not counted), plans kept now."""
    with _lock:
        return dict(_counts, plans=sum(p is not _NOT_DECODE for p in _plans.values()))


@contextlib.contextmanager
def disabled():
    """Run the block's calls uncached (tests compare the two paths; not thread-local)."""
    global enabled
    before = enabled
    enabled = False
    try:
        yield
    finally:
        enabled = before
