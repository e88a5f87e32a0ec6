"""The cost model of context parallelism (cuflash.distributed.ring_attention): per-rank FLOPs, the
bytes each rank sends per step, and the overlap of compute and transfer."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import masks, sequence_split
from ..core.arrays import BFLOAT16
from .arguments import check_choice, check_dtype, check_heads, check_int
from .tables import format_table


# Assumed rates of the overlap model (override per call): the 16-bit kernels' measured throughput
# on the H200 at d = 128, 16k tokens (docs/performance.md: forward 683-711, backward 553-562
# TFLOP/s), NVLink 4 at 450 GB/s per direction of which a ring's send and receive each reach
# about 400, and the HBM bandwidth the merge streams at (copy ceiling, 4.28 TB/s measured).
CP_TFLOPS_FWD = 680.0
CP_TFLOPS_BWD = 550.0
CP_LINK_GBPS = 400.0
CP_HBM_GBPS = 4280.0


@dataclass(frozen=True)
class ContextParallelStep:
    """One step of the ring (the slowest rank's compute; every rank sends one block)."""

    step: int
    flops: int  # the busiest rank's FLOPs in this step
    bytes_sent: int  # per rank
    compute_s: float
    transfer_s: float

    @property
    def time_s(self) -> float:
        """Compute and transfer overlap: the step takes the longer of the two."""
        return max(self.compute_s, self.transfer_s)


@dataclass(frozen=True)
class ContextParallelModel:
    """Per-rank FLOPs, bytes per step and the overlap model of one pass (cuflash.distributed)."""

    world: int
    mode: str
    balance: str
    pass_: str
    seq_len: int
    rank_flops: tuple  # per rank, the whole pass
    steps: tuple  # ContextParallelStep (ring) or one entry per phase (all-gather)
    serial_flops: int  # the single-device pass's exact FLOPs
    tflops: float
    link_gbps: float
    notes: tuple = ()

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    @property
    def single_device_s(self) -> float:
        return self.serial_flops / (self.tflops * 1e12)

    @property
    def speedup(self) -> float:
        return self.single_device_s / self.time_s if self.time_s else float("inf")

    @property
    def efficiency(self) -> float:
        return self.speedup / self.world

    def table(self) -> str:
        rows = [(s.step, f"{s.flops:,}", f"{s.bytes_sent:,}", f"{s.compute_s * 1e3:.3f}", f"{s.transfer_s * 1e3:.3f}",
                 "compute" if s.compute_s >= s.transfer_s else "transfer") for s in self.steps]
        return format_table(("step", "busiest rank FLOPs", "bytes sent / rank", "compute ms", "transfer ms",
                             "bound by"), rows)


def _chunk_pairs(causal, qa, qb, ka, kb):
    """Visible (query, key) pairs between global rows [qa, qb) and [ka, kb) of one sequence."""
    if qb <= qa or kb <= ka:
        return 0
    if not causal:
        return (qb - qa) * (kb - ka)
    # row i sees keys [ka, min(kb, i + 1)): i + 1 - ka of them for ka <= i < kb - 1, all from kb - 1 on
    lo, hi = max(qa, ka), max(max(qa, ka), min(qb, kb - 1))
    partial = (hi - ka) * (hi - ka + 1) // 2 - (lo - ka) * (lo - ka + 1) // 2
    full = max(0, qb - max(qa, kb - 1)) * (kb - ka)
    return partial + full


def context_parallel(q_shape, world, *, hkv=None, causal=False, dtype=None, mode="ring", balance="zigzag",
                     pass_="fwd", tflops=None, link_gbps=CP_LINK_GBPS, hbm_gbps=CP_HBM_GBPS) -> ContextParallelModel:
    """The model of ``cuflash.distributed.ring_attention`` over a whole sequence of ``q_shape``
    (B, Hq, N, d) on ``world`` ranks: each rank's FLOPs, the bytes each rank sends per step, and
    per step the compute time (the busiest rank at ``tflops``, plus the float32 merge of its
    partial o at ``hbm_gbps``) against the transfer time at ``link_gbps`` (GB/s per direction).

    Ring (``mode="ring"``): step s computes this rank's rows against the block of rank r - s while
    the next block is sent, so a step takes max(compute, transfer). Forward sends K and V
    (``dtype``); backward also dK and dV (float32). All-gather: the K/V all-gather (forward and
    backward) and the backward's dK/dV all-reduce (float32, 2 (P-1)/P of it) are not overlapped.
    ``tflops`` defaults to the 16-bit kernels' measured H200 rates (CP_TFLOPS_FWD / _BWD)."""
    check_choice("mode", mode, ("ring", "allgather"))
    check_choice("balance", balance, sequence_split.BALANCES)
    check_choice("pass_", pass_, ("fwd", "bwd"))
    if len(q_shape) != 4:
        raise ValueError(f"q_shape: expected (B, Hq, N, d), got {q_shape}")
    b, hq, n, d = (check_int("q_shape", x, minimum=1) for x in q_shape)
    world = check_int("world", world, minimum=1)
    hkv = hq if hkv is None else check_int("hkv", hkv, minimum=1)
    check_heads(hq, hkv)
    dt = check_dtype("dtype", dtype if dtype is not None else BFLOAT16)
    causal = bool(masks.normalize_causal(causal))
    per_pair = 4 if pass_ == "fwd" else 10
    rate = tflops if tflops is not None else (CP_TFLOPS_FWD if pass_ == "fwd" else CP_TFLOPS_BWD)
    if not (rate > 0 and link_gbps > 0 and hbm_gbps > 0):
        raise ValueError("tflops, link_gbps, hbm_gbps: expected positive rates")
    chunks = [[(lo, hi) for _, lo, hi in cs] for cs in sequence_split.chunk_bounds(n, world, balance)]
    lens = [sum(e - s for s, e in cs) for cs in chunks]
    unit = per_pair * b * hq * d  # FLOPs per visible pair
    serial = unit * _chunk_pairs(causal, 0, n, 0, n)
    kv_elems = 2 * b * hkv * d  # K and V per sequence row
    steps, rank_flops, notes = [], [0] * world, []
    if mode == "ring":
        for s in range(world):
            flops, merge_bytes = [], 0
            for r in range(world):
                src = (r - s) % world
                pairs = sum(_chunk_pairs(causal, qa, qb, ka, kb) for qa, qb in chunks[r] for ka, kb in chunks[src])
                flops.append(unit * pairs)
                rank_flops[r] += unit * pairs
            busiest = max(flops)
            # the merge of this step's float32 partial o into the running one: read two, write one
            merge_bytes = 3 * b * hq * max(lens) * d * 4 if (s > 0 and pass_ == "fwd") else 0
            # K, V on to the next rank but after the last step; the backward's float32 dK, dV every step
            # (after the last one they return to their owner, overlapping nothing: counted in that step)
            sent = 0
            if world > 1:
                sent = (kv_elems * max(lens) * dt.itemsize if s < world - 1 else 0) + \
                    (kv_elems * max(lens) * 4 if pass_ == "bwd" else 0)
            steps.append(ContextParallelStep(s, busiest, sent, busiest / (rate * 1e12) + merge_bytes / (hbm_gbps * 1e9),
                                             sent / (link_gbps * 1e9)))
        notes.append("ring: each step's transfer overlaps its compute; a step lasts the longer of the two")
    else:
        for r in range(world):
            rank_flops[r] = unit * sum(_chunk_pairs(causal, qa, qb, 0, n) for qa, qb in chunks[r])
        gathered = kv_elems * n * dt.itemsize * (world - 1) // world
        steps.append(ContextParallelStep(0, 0, gathered, 0.0, gathered / (link_gbps * 1e9)))
        steps.append(ContextParallelStep(1, max(rank_flops), 0, max(rank_flops) / (rate * 1e12), 0.0))
        if pass_ == "bwd":
            reduced = 2 * kv_elems * n * 4 * (world - 1) // world
            steps.append(ContextParallelStep(2, 0, reduced, 0.0, reduced / (link_gbps * 1e9)))
        notes.append("all-gather: step 0 gathers K/V, step 1 computes, (backward) step 2 all-reduces dK/dV; "
                     "not overlapped")
    notes.append(f"assumed rates: {rate:g} TFLOP/s, link {link_gbps:g} GB/s per direction, HBM {hbm_gbps:g} GB/s")
    return ContextParallelModel(world, mode, balance, pass_, n, tuple(rank_flops), tuple(steps), serial, rate,
                                link_gbps, tuple(notes))
