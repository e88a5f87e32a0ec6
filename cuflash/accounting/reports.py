"""What the accounting returns: device buffers by category (MemoryReport) and HBM traffic per tensor
(IOModel), with the sizes they count in."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tables import format_table, mib


LSE_ITEMSIZE = 4  # row statistics and accumulators are float32 whatever the input dtype
ACC_ITEMSIZE = 4


INPUT, OUTPUT, SAVED, WORKSPACE, INTERMEDIATE, ON_CHIP = (
    "input", "output", "saved state", "workspace", "intermediate", "on-chip (not device memory)")
CATEGORIES = (INPUT, OUTPUT, SAVED, WORKSPACE, INTERMEDIATE, ON_CHIP)
_TRANSIENT = (WORKSPACE, INTERMEDIATE)  # alive only during one phase of the pass


@dataclass(frozen=True)
class MemoryEntry:
    name: str
    category: str  # one of CATEGORIES
    bytes: int
    note: str = ""
    phase: str = "all"  # "fwd" / "bwd": a transient that exists only during that phase
    reuses: str | None = None  # an entry whose buffer this one may overwrite (in-place variant)


@dataclass(frozen=True)
class MemoryReport:
    """Device bytes of one pass, by category. Transients of different phases never coexist."""

    method: str
    pass_: str
    dtype: str
    shape: dict
    entries: tuple
    notes: tuple = ()

    def total(self, category) -> int:
        return sum(e.bytes for e in self.entries if e.category == category)

    def _device_bytes(self, in_place):
        persistent = sum(e.bytes for e in self.entries if e.category in (INPUT, OUTPUT, SAVED))
        phases = {e.phase for e in self.entries if e.category in _TRANSIENT}
        peak = max((sum(e.bytes for e in self.entries if e.category in _TRANSIENT and e.phase == ph
                        and not (in_place and e.reuses)) for ph in phases), default=0)
        return persistent + peak

    @property
    def device_bytes(self) -> int:
        """Peak device bytes: inputs + outputs + saved state + the largest phase's transients."""
        return self._device_bytes(False)

    @property
    def device_bytes_in_place(self) -> int:
        """The same when every intermediate that can overwrite another one does."""
        return self._device_bytes(True)

    @property
    def beyond_inputs_outputs(self) -> int:
        """What the method adds to the unavoidable inputs and outputs (saved state included)."""
        return self.device_bytes - self.total(INPUT) - self.total(OUTPUT)

    @property
    def beyond_inputs_outputs_in_place(self) -> int:
        return self.device_bytes_in_place - self.total(INPUT) - self.total(OUTPUT)

    def table(self) -> str:
        s = self.shape
        head = (f"memory [{self.method}, {self.pass_}] B={s['batch']} Hq={s['hq']} Hkv={s['hkv']} "
                f"Nq={s['nq']} Nk={s['nk']} d={s['d']}" + (f" dv={s['dv']}" if "dv" in s else "") + f" {self.dtype}")
        show_phase = self.pass_ == "fwd+bwd"
        rows = [(e.category, e.name + (f" ({e.phase} phase)" if show_phase and e.phase != "all" else ""),
                 f"{e.bytes:,}", mib(e.bytes), e.note) for e in self.entries]
        rows.append(("total device", "peak, all phases", f"{self.device_bytes:,}", mib(self.device_bytes), ""))
        rows.append(("beyond in/out", "total - inputs - outputs", f"{self.beyond_inputs_outputs:,}",
                     mib(self.beyond_inputs_outputs), "saved state + workspace + intermediates"))
        if any(e.reuses for e in self.entries):
            rows.append(("total device", "in-place variant", f"{self.device_bytes_in_place:,}",
                         mib(self.device_bytes_in_place), "each reusable intermediate overwrites another"))
            rows.append(("beyond in/out", "in-place variant", f"{self.beyond_inputs_outputs_in_place:,}",
                         mib(self.beyond_inputs_outputs_in_place), ""))
        out = head + "\n" + format_table(("category", "name", "bytes", "MiB", "note"), rows)
        return out + "".join(f"\nnote: {n}" for n in self.notes)

    __str__ = table


@dataclass(frozen=True)
class IOEntry:
    name: str
    reads: int  # elements read from HBM
    writes: int  # elements written to HBM
    itemsize: int
    note: str = ""

    @property
    def bytes(self) -> int:
        return (self.reads + self.writes) * self.itemsize


@dataclass(frozen=True)
class IOModel:
    """Logical HBM traffic of a tile schedule, next to the paper's and standard attention's counts."""

    pass_: str
    batch: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: str
    causal: str | None
    block_m: int  # forward tile: query rows
    block_n: int  # forward tile: keys
    bwd_block_m: int  # backward main kernel: query rows streamed per step (0 without a backward)
    bwd_block_n: int  # backward main kernel: keys owned by one block
    entries: tuple
    sram_bytes: int
    sram_elements: int  # M of the paper: on-chip capacity in elements of the input dtype
    paper_elements: float  # Theta(Nq Nk d^2 / M) per head, unit constant, per pass
    standard_elements: int  # Theta((Nq + Nk) d + Nq Nk) per head, unit constant, per pass
    reference_elements: int  # the materializing reference, each N x N matrix written and read once
    computed_pairs: int  # (query, key) pairs inside the visible tiles the forward computes
    bwd_computed_pairs: int  # the same for the backward's main kernel (0 without a backward)
    compulsory_bytes: int  # Q, K, V read once; O and LSE written once (the forward's minimum)
    assumptions: tuple = field(default=())

    @property
    def read_elements(self) -> int:
        return sum(e.reads for e in self.entries)

    @property
    def write_elements(self) -> int:
        return sum(e.writes for e in self.entries)

    @property
    def elements(self) -> int:
        return self.read_elements + self.write_elements

    @property
    def read_bytes(self) -> int:
        return sum(e.reads * e.itemsize for e in self.entries)

    @property
    def write_bytes(self) -> int:
        return sum(e.writes * e.itemsize for e in self.entries)

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def table(self) -> str:
        head = (f"HBM traffic model [tiled, {self.pass_}] B={self.batch} Hq={self.hq} Hkv={self.hkv} "
                f"Nq={self.nq} Nk={self.nk} d={self.d} {self.dtype} causal={self.causal} "
                f"fwd tile {self.block_m}x{self.block_n}"
                + (f", bwd tile {self.bwd_block_m}x{self.bwd_block_n}" if self.bwd_block_n else ""))
        rows = [(e.name, f"{e.reads:,}", f"{e.writes:,}", str(e.itemsize), f"{e.bytes:,}", e.note) for e in self.entries]
        rows.append(("total", f"{self.read_elements:,}", f"{self.write_elements:,}", "", f"{self.bytes:,}",
                     f"{self.bytes / 1e9:.4g} GB"))
        t = format_table(("tensor", "elements read", "elements written", "B/elem", "bytes", "note"), rows)
        extra = [
            f"compulsory (Q, K, V read once; O, LSE written once): {self.compulsory_bytes:,} bytes",
            f"tile schedule total: {self.elements:,} elements",
            f"FlashAttention paper Theta(Nq*Nk*d^2/M) x B*Hq, M = {self.sram_elements:,} elements "
            f"({self.sram_bytes:,} B on chip): {self.paper_elements:,.4g} elements (unit constant)",
            f"standard attention Theta((Nq+Nk)*d + Nq*Nk) x B*Hq: {self.standard_elements:,} elements (unit constant)",
            f"materializing reference, each N x N matrix written once and read once per use: "
            f"{self.reference_elements:,} elements",
        ]
        return "\n".join([head, t] + extra + [f"assumption: {a}" for a in self.assumptions])

    __str__ = table
