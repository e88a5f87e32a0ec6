"""Honest accounting: exact pair and FLOP counts, the device-memory boundary, and an HBM-traffic model.

Three questions that are easy to conflate, answered separately:

* :func:`flops` — how much arithmetic the dense operator does: the exact number of visible
  (query, key) pairs under the mask, times the products' multiply-adds, next to the peers'
  "dense-equivalent" convention, each result stating which convention it uses.
* :func:`memory_report` — which device bytes exist while a pass runs, by class: inputs, outputs,
  saved state, workspace, quadratic intermediates (reference only), and on-chip storage per block
  (which is *not* device memory). Nothing is called "auxiliary" that is really an input or output.
* :func:`io_model` — the logical HBM traffic of a tile schedule, counted tile by tile, next to the
  FlashAttention paper's Theta(N^2 d^2 / M) and standard attention's Theta(N d + N^2). A model, not a
  measurement: caches, transaction sizes and write-back timing change what a profiler sees.

:func:`context_parallel` models the ring and all-gather context parallelism of cuflash.distributed.

All counts are Python ints (exact, never overflow). Mask semantics follow :mod:`cuflash.core.masks`.

Modules, each with one job: ``arguments`` (the checks), ``pairs`` (exact pair counts),
``flop_count``, ``launches`` (what plan.dispatch launches on the modelled H200), ``reports`` (the
result types), ``memory``, ``tile_walk`` (the tiles a schedule visits), ``traffic``, ``e4m3`` (both
questions for the float8_e4m3fn forward), ``cp_model``, ``tables``.
"""

from .arguments import LAYOUTS, METHODS, PASSES
from .cp_model import (CP_HBM_GBPS, CP_LINK_GBPS, CP_TFLOPS_BWD, CP_TFLOPS_FWD, ContextParallelModel,
                       ContextParallelStep, context_parallel)
from .e4m3 import DESCALES, E4M3_OUT_DTYPES, FP8_VT_SMEM_BYTES
from .flop_count import BWD_PRODUCTS, FWD_PRODUCTS, FlopCount, flops
from .launches import H200_SM_COUNT, H200_SMEM_PER_SM_BYTES, MODEL, backward_launch, forward_launch, model_forward_plan
from .memory import memory_report
from .pairs import pairs_per_head
from .reports import (ACC_ITEMSIZE, CATEGORIES, INPUT, INTERMEDIATE, LSE_ITEMSIZE, ON_CHIP, OUTPUT, SAVED, WORKSPACE,
                      IOEntry, IOModel, MemoryEntry, MemoryReport)
from .tables import format_table
from .traffic import io_model

__all__ = [
    "flops", "FlopCount", "pairs_per_head", "FWD_PRODUCTS", "BWD_PRODUCTS",
    "memory_report", "MemoryReport", "MemoryEntry", "CATEGORIES", "INPUT", "OUTPUT", "SAVED", "WORKSPACE",
    "INTERMEDIATE", "ON_CHIP", "LSE_ITEMSIZE", "ACC_ITEMSIZE",
    "io_model", "IOModel", "IOEntry",
    "forward_launch", "backward_launch", "model_forward_plan", "MODEL", "H200_SM_COUNT", "H200_SMEM_PER_SM_BYTES",
    "DESCALES", "E4M3_OUT_DTYPES", "FP8_VT_SMEM_BYTES",
    "context_parallel", "ContextParallelModel", "ContextParallelStep",
    "CP_TFLOPS_FWD", "CP_TFLOPS_BWD", "CP_LINK_GBPS", "CP_HBM_GBPS",
    "format_table", "PASSES", "METHODS", "LAYOUTS",
]
