"""The GPU a plan is made for: the few facts about it the dispatch reads.

The kernels layer describes the current device with one of these (cuflash.kernels.device); the
accounting plans for the modelled H200 whatever the machine has."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    compute_capability: int  # 90 for sm_90
    sm_count: int
    name: str = ""

    @property
    def hopper(self) -> bool:
        """sm_90: wgmma, TMA, setmaxnreg and the float64 tensor cores' m16n8k8 (sm_90a kernels)."""
        return self.compute_capability == 90

    @property
    def clusters(self) -> bool:
        """Thread-block clusters and distributed shared memory (sm_90 and newer)."""
        return self.compute_capability >= 90


H200 = Target(90, 132, "NVIDIA H200")  # the GPU the accounting models
