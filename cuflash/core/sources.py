"""The CUDA sources (cuda_src/): where they are, their text with local headers inlined, its hash.

One text per kernel file, so that what NVRTC compiles, what the compile cache keys and what the
tuning cache keys are the same bytes: editing a ``.cuh`` can never serve a stale kernel."""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def source_dir() -> Path:
    package = Path(__file__).resolve().parent.parent  # cuflash/
    for cand in (package / "cuda_src", package.parent / "cuda_src"):  # installed, or a source checkout
        if cand.is_dir():
            return cand
    raise FileNotFoundError("cuflash: kernel sources (cuda_src/) not found next to the package")


@lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """The kernel file's text with its local headers inlined once each (like #pragma once)."""
    root = source_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (root / fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: f"// ---- {m.group(1)} ----\n" + expand(m.group(1)), text)

    return expand(name)


def source_hash(name: str) -> str:
    # get_function asks on every launch: load_source returns its cached text object, whose hash
    # Python keeps, so _text_hash's lookup is cheap and the SHA-256 runs once per text.
    return _text_hash(load_source(name))


@lru_cache(maxsize=None)
def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
