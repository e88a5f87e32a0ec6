"""The plan of packed sequences' offset clamp (cuda_src/packed_offsets.cu): one block per offsets
array, run before the band kernels when the host has not read the offsets."""

from __future__ import annotations

from .spec import KernelSpec

OFFSET_THREADS = 1024  # kOffsetThreads


def clamp_offsets_spec() -> KernelSpec:
    return KernelSpec("packed_offsets.cu", "clamp_packed_offsets", OFFSET_THREADS, 0)


def all_packed_specs():
    return [clamp_offsets_spec()]
