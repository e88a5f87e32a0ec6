"""What one GPU allows a kernel launch: the limits that decide legality and occupancy.

Read from a CuPy device (``cupy.cuda.Device().attributes``, the CUDA runtime's ``cudaDevAttr*``
values with the prefix trimmed), or taken from the recorded H200 description so that the CPU
tests and ``python -m cuflash schedules`` can reason about that machine without one.

The allocation rules (register granularity per warp, four register sub-partitions, the shared
memory unit and the 1 KiB the driver reserves per block) are those of the CUDA occupancy
calculator (cuda_occupancy.h) for compute capability 8.x/9.x.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    cc: int  # compute capability as major*10 + minor (90 = Hopper)
    sm_count: int
    smem_per_block_optin: int  # largest dynamic+static shared memory one block may ask for (bytes)
    smem_per_sm: int  # shared memory of one SM at the largest carveout (bytes)
    regs_per_sm: int
    regs_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    l2_bytes: int
    max_threads_per_block: int = 1024
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256 (= 8 per thread)
    reg_sub_partitions: int = 4  # the register file is split over 4 schedulers; warps allocate in one
    smem_alloc_unit: int = 128  # shared memory is allocated per block in 128-byte units
    smem_reserved_per_block: int = 1024  # the driver's per-block reservation (sm_80+: 1 KiB)
    warp_size: int = 32

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @property
    def arch(self) -> str:
        """The NVRTC architecture the kernels are built for on this device (sm_90a on Hopper)."""
        return "sm_90a" if self.cc == 90 else f"sm_{self.cc}"

    def regs_per_warp(self, regs_per_thread: int) -> int:
        """Registers one warp holds: per-thread count x 32, rounded up to the allocation unit."""
        return _round_up(regs_per_thread * self.warp_size, self.reg_alloc_unit)

    def smem_per_block(self, smem_bytes: int) -> int:
        """Shared memory one block takes from the SM: its own plus the reservation, in whole units."""
        return _round_up(smem_bytes + self.smem_reserved_per_block, self.smem_alloc_unit)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceLimits":
        return cls(**d)


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps of one kernel on one SM, and what limits them."""

    blocks_per_sm: int
    warps_per_sm: int
    limiter: str  # "registers", "shared memory", "threads", "blocks", or why nothing fits
    by_registers: int
    by_smem: int
    by_threads: int
    by_blocks: int
    fraction: float = 0.0  # resident warps over the SM's maximum (what a profiler calls occupancy)


def occupancy(limits: DeviceLimits, threads: int, regs_per_thread: int | None, smem_bytes: int) -> Occupancy:
    """Blocks of (threads, regs_per_thread, smem_bytes) resident on one SM of ``limits``.

    ``regs_per_thread=None`` (not compiled yet) leaves registers out of the minimum."""
    warps = -(-threads // limits.warp_size)
    if threads > limits.max_threads_per_block:
        return Occupancy(0, 0, f"{threads} threads > {limits.max_threads_per_block} per block", 0, 0, 0, 0)
    if smem_bytes > limits.smem_per_block_optin:
        return Occupancy(0, 0, f"{smem_bytes} B shared memory > {limits.smem_per_block_optin} B per block", 0, 0, 0, 0)
    by_threads = limits.max_threads_per_sm // (warps * limits.warp_size)
    by_blocks = limits.max_blocks_per_sm
    by_smem = limits.smem_per_sm // limits.smem_per_block(smem_bytes)
    by_regs = by_blocks
    if regs_per_thread is not None:
        if regs_per_thread > limits.max_regs_per_thread:
            return Occupancy(0, 0, f"{regs_per_thread} registers/thread > {limits.max_regs_per_thread}", 0, by_smem, by_threads, by_blocks)
        per_warp = limits.regs_per_warp(regs_per_thread)
        # The hardware check assumes the block's warps spread over all sub-partitions.
        assumed = per_warp * _round_up(warps, limits.reg_sub_partitions)
        if assumed > limits.regs_per_block or per_warp * warps > limits.regs_per_block:
            return Occupancy(0, 0, f"{regs_per_thread} registers x {threads} threads > {limits.regs_per_block} per block",
                             0, by_smem, by_threads, by_blocks)
        warps_per_partition = (limits.regs_per_sm // limits.reg_sub_partitions) // per_warp
        by_regs = (warps_per_partition * limits.reg_sub_partitions) // warps
    limits_by = {"registers": by_regs, "shared memory": by_smem, "threads": by_threads, "blocks": by_blocks}
    blocks = min(limits_by.values())
    # Name the binding limit; on ties prefer the resource a tile choice can change.
    limiter = next(k for k, v in limits_by.items() if v == blocks)
    return Occupancy(blocks, blocks * warps, limiter, by_regs, by_smem, by_threads, by_blocks,
                     blocks * warps / limits.max_warps_per_sm)


# The H200's limits, read off the device with CuPy (2026-11-29).
H200 = DeviceLimits(
    name="NVIDIA H200",
    cc=90,
    sm_count=132,
    smem_per_block_optin=232448,
    smem_per_sm=233472,
    regs_per_sm=65536,
    regs_per_block=65536,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    l2_bytes=62914560,
)

# cudaDevAttr* names (prefix trimmed, as cupy.cuda.Device().attributes spells them) -> field.
_ATTRIBUTES = {
    "MultiProcessorCount": "sm_count",
    "MaxSharedMemoryPerBlockOptin": "smem_per_block_optin",
    "MaxSharedMemoryPerMultiprocessor": "smem_per_sm",
    "MaxRegistersPerMultiprocessor": "regs_per_sm",
    "MaxRegistersPerBlock": "regs_per_block",
    "MaxThreadsPerMultiProcessor": "max_threads_per_sm",
    "MaxBlocksPerMultiprocessor": "max_blocks_per_sm",
    "L2CacheSize": "l2_bytes",
    "MaxThreadsPerBlock": "max_threads_per_block",
    "ReservedSharedMemoryPerBlock": "smem_reserved_per_block",
}
_REQUIRED = tuple(v for k, v in _ATTRIBUTES.items() if k not in ("MaxThreadsPerBlock", "ReservedSharedMemoryPerBlock"))


def from_attributes(name: str, cc: int, attributes: dict) -> DeviceLimits:
    """DeviceLimits from a cudaDevAttr dictionary (keys without the ``cudaDevAttr`` prefix)."""
    values = {field: int(attributes[key]) for key, field in _ATTRIBUTES.items() if key in attributes}
    missing = [f for f in _REQUIRED if f not in values]
    if missing:
        raise ValueError(f"attributes: missing {missing} (expected cupy.cuda.Device().attributes)")
    return DeviceLimits(name=name, cc=int(cc), **values)


def from_cupy(device=None) -> DeviceLimits:
    """The limits of a CuPy device (default: the current one)."""
    import cupy

    dev = cupy.cuda.Device() if device is None else device
    name = device_name(dev.id)
    return from_attributes(name, int(dev.compute_capability), dev.attributes)


_NAMES: dict = {}


def device_name(device_id: int) -> str:
    """The device's marketing name (cached: the property query is slow)."""
    name = _NAMES.get(device_id)
    if name is None:
        import cupy

        raw = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        _NAMES[device_id] = name
    return name


MAX_GRID_YZ = 65535  # a launch grid's y and z limit: batch entries and sequences go in chunks of this many
