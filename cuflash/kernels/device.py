"""The current CUDA device, as the plans need it (plan.target.Target), read once per device."""

from __future__ import annotations

from functools import lru_cache

from ..plan import device_limits
from ..plan.target import Target


@lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


@lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def target(device_id: int) -> Target:
    return Target(compute_capability(device_id), sm_count(device_id), device_limits.device_name(device_id))


def current_id() -> int:
    import cupy

    return cupy.cuda.Device().id


def current() -> Target:
    """The Target of CuPy's current device."""
    return target(current_id())
