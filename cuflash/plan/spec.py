"""What one launch compiles: a kernel source file, its template instantiation, threads, shared memory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """One launchable instantiation: a source file and the template name expression."""

    source: str
    expression: str
    threads: int
    smem_bytes: int

    @property
    def short_name(self) -> str:
        return self.expression.replace(" ", "")


def cpp_bool(x: bool) -> str:
    """A C++ template argument of a bool."""
    return "true" if x else "false"
