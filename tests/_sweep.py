"""Randomized cases for the sweeps (tests/test_random_sweep.py on the CPU, tests/test_gpu_random_sweep.py
on the GPU): shapes, masks and options drawn from the test's seeded ``rng`` (a fresh seed every run,
printed on failure, replayed with CUFLASH_SEED=<seed>), for a wall-clock budget.

Each case is checked against the float64 reference by the accuracy rule of cuflash.testing, with the
visibility built by the oracle (cuflash.testing.visibility), never by cuflash.core.masks."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from cuflash.core.arrays import BFLOAT16

DTYPES = (np.dtype(np.float16), np.dtype(BFLOAT16), np.dtype(np.float32))
CAUSAL = (False, "bottom_right", "top_left")


@dataclass
class Case:
    dtype: np.dtype
    batch: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: object
    window: tuple | None
    layout: str
    scale: float | None
    input_scale: tuple
    block_m: int | None
    block_n: int | None

    def shapes(self):
        if self.layout == "bhsd":
            return (self.batch, self.hq, self.nq, self.d), (self.batch, self.hkv, self.nk, self.d)
        return (self.batch, self.nq, self.hq, self.d), (self.batch, self.nk, self.hkv, self.d)


def draw(rng, *, dtypes=DTYPES, max_n=160, head_dims=(1, 3, 8, 16, 24, 40, 64, 72, 96, 111, 128),
         window_ok=lambda dtype: True, blocks=True):
    """One random case."""
    dtype = dtypes[rng.integers(len(dtypes))]
    hkv = int(rng.integers(1, 4))
    group = int(rng.integers(1, 4))
    # Lengths: mostly small, sometimes 1 or equal; Nq > Nk and Nq < Nk both occur.
    nq = int(rng.choice([1, 2, int(rng.integers(1, max_n + 1))]))
    nk = int(rng.choice([1, nq, int(rng.integers(1, max_n + 1))]))
    causal = CAUSAL[rng.integers(len(CAUSAL))]
    window = None
    if window_ok(dtype) and rng.random() < 0.3:
        window = (int(rng.choice([-1, 0, int(rng.integers(0, 40))])), int(rng.choice([-1, 0, int(rng.integers(0, 40))])))
        if window == (-1, -1):
            window = None
    big = rng.random() < 0.25  # large scores: q x5, k x3
    return Case(
        dtype=dtype, batch=int(rng.integers(1, 3)), hq=hkv * group, hkv=hkv, nq=nq, nk=nk,
        d=int(rng.choice(head_dims)), causal=causal, window=window,
        layout=("bhsd", "bshd")[rng.integers(2)],
        scale=None if rng.random() < 0.7 else float(rng.uniform(0.05, 2.0)),
        input_scale=(5.0, 3.0, 1.0) if big else (1.0, 1.0, 1.0),
        block_m=int(rng.choice([1, 5, 16, 32, 64])) if blocks and rng.random() < 0.6 else None,
        block_n=int(rng.choice([1, 7, 16, 32, 64])) if blocks and rng.random() < 0.6 else None,
    )


def budget_seconds(default):
    """The sweep's wall-clock budget: CUFLASH_SWEEP_SECONDS, else ``default``."""
    return float(os.environ.get("CUFLASH_SWEEP_SECONDS", default))


def run_sweep(rng, check_case, *, seconds, min_cases, **draw_options):
    """Draw and check cases until ``seconds`` have passed and at least ``min_cases`` ran; returns
    the cases checked. A failing case's assertion names the case (the rng seed replays the run)."""
    start = time.monotonic()
    done = []
    while len(done) < min_cases or time.monotonic() - start < seconds:
        case = draw(rng, **draw_options)
        try:
            check_case(rng, case)
        except AssertionError as exc:
            raise AssertionError(f"case {len(done)}: {case}\n{exc}") from exc
        done.append(case)
    return done
