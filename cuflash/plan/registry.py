"""Every kernel instantiation the package can launch, by family: what the CI compile check
builds for sm_90a (no errors, no spills), so that what CI compiles is what runs."""

from __future__ import annotations

from .backward import all_backward_specs
from .decode import all_decode_specs
from .decode_mla import all_mla_specs
from .forward import all_forward_specs
from .hopper import all_hopper_backward_specs, all_hopper_forward_specs, all_hopper_fp8_forward_specs
from .merge import all_merge_specs
from .packed import all_packed_specs

FAMILIES = {
    "forward": all_forward_specs,  # mma.sync, band and float32 forwards
    "backward": all_backward_specs,  # mma.sync, band and float32 backwards
    "hopper_forward": all_hopper_forward_specs,
    "hopper_fp8_forward": all_hopper_fp8_forward_specs,  # float8_e4m3fn q, k, v and its vt kernels
    "hopper_backward": all_hopper_backward_specs,
    "decode": all_decode_specs,
    "decode_mla": all_mla_specs,  # MLA (576, 512) decode and its 512-wide combine
    "merge": all_merge_specs,  # merge_attention_states
    "packed": all_packed_specs,  # packed offsets the host did not read, clamped (max_seqlen_*)
}


def all_specs() -> list:
    """Every instantiation once, in a stable order."""
    return list(dict.fromkeys(spec for family in FAMILIES.values() for spec in family()))
