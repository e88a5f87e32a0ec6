"""GPUs for the plan tests (no device needed): the dispatch reads only a plan.target.Target."""

from cuflash.kernels import device
from cuflash.plan.target import H200, Target

SM90 = H200
SM80 = Target(80, 108, "NVIDIA A100-SXM4-80GB")


def on_target(monkeypatch, target: Target):
    """Make the backends plan for `target` as the current device (cuflash.kernels.device.current)."""
    monkeypatch.setattr(device, "current", lambda: target)

FAKE = Target(90, 132, "FakeGPU")  # the tuning tests' stand-in device (its name keys the tuning cache)
