"""Every switch cuflash reads from the environment, read in one place.

Each is read when asked (not at import), so a test or a script can set it for one call.

=============================  =========================================================  ==========
variable                       meaning                                                    default
=============================  =========================================================  ==========
``CUFLASH_KERNELS``            ``auto``: the Hopper (wgmma/TMA, float64 tensor-core)      ``auto``
                               kernels where they apply; ``mma_sync``: the portable
                               mma.sync / FMA kernels everywhere (fallback, A/B).
``CUFLASH_TUNE``               ``0``: the built-in tile tables; ``1``: autotune a shape   ``0``
                               bucket on first use and cache the winner; ``cached``:
                               use cached winners only.
``CUFLASH_CACHE_DIR``          where the tuning cache (``tune.json``) lives               ``$XDG_CACHE_HOME/cuflash``
``CUFLASH_TUNE_MAX_CANDIDATES``  tiles timed per bucket by first-use autotuning           ``8``
``CUFLASH_PLAN_CACHE``         ``0`` turns off the decode plan cache of                   ``1``
                               ``cuflash.attention``
``CUFLASH_NVRTC_OPTIONS``      debug: extra NVRTC options (space separated, e.g.          empty
                               ``-lineinfo`` for a profiler); part of the compiled-module
                               cache key
=============================  =========================================================  ==========
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

KERNELS = "CUFLASH_KERNELS"
TUNE = "CUFLASH_TUNE"
CACHE_DIR = "CUFLASH_CACHE_DIR"
TUNE_MAX_CANDIDATES = "CUFLASH_TUNE_MAX_CANDIDATES"
PLAN_CACHE = "CUFLASH_PLAN_CACHE"
NVRTC_OPTIONS = "CUFLASH_NVRTC_OPTIONS"

DEFAULT_MAX_CANDIDATES = 8


def hopper_kernels() -> bool:
    """Whether the Hopper kernels may run (``CUFLASH_KERNELS=auto``) or only the portable ones."""
    mode = os.environ.get(KERNELS, "auto")
    if mode not in ("auto", "mma_sync"):
        raise ValueError(f"{KERNELS}={mode!r}: expected 'auto' or 'mma_sync'")
    return mode == "auto"


def tune_mode() -> str:
    """"off" (CUFLASH_TUNE unset/0: tables only), "auto" (1) or "cached"."""
    raw = os.environ.get(TUNE, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return "off"
    if raw in ("1", "on", "true", "yes", "auto"):
        return "auto"
    if raw == "cached":
        return "cached"
    warnings.warn(f"{TUNE}={raw!r}: expected 0, 1 or 'cached'; using the built-in tables", RuntimeWarning, 3)
    return "off"


def cache_dir() -> Path:
    """The directory of the tuning cache."""
    d = os.environ.get(CACHE_DIR)
    if d:
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "cuflash"


def tune_max_candidates() -> int:
    raw = os.environ.get(TUNE_MAX_CANDIDATES)
    try:
        return max(1, int(raw)) if raw else DEFAULT_MAX_CANDIDATES
    except ValueError:
        return DEFAULT_MAX_CANDIDATES


def plan_cache_enabled() -> bool:
    return os.environ.get(PLAN_CACHE, "1") != "0"


def nvrtc_options() -> tuple[str, ...]:
    """Extra NVRTC options (a debugging aid for sanitizer/profiler runs)."""
    return tuple(os.environ.get(NVRTC_OPTIONS, "").split())
