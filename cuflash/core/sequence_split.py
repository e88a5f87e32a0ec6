"""How context parallelism cuts one sequence over P ranks: the chunks each rank holds, and which
of its query chunks see which key chunks. Shared by the torch ring (cuflash.distributed), the
JAX ring (cuflash.jax_distributed) and their cost model (cuflash.accounting.context_parallel).

``"zigzag"`` cuts the sequence into 2P chunks and gives rank r chunks r and 2P - 1 - r: under a
causal mask an early chunk (little work) pairs with a late one (much work), so every rank has the
same work. ``"contiguous"`` gives rank r chunk r of P.
"""

from __future__ import annotations

MODES = ("auto", "ring", "allgather")
BALANCES = ("zigzag", "contiguous")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def chunk_ids(world: int, balance: str = "zigzag"):
    """[rank's chunk indices] (of 2P chunks for zigzag, P for contiguous)."""
    check_choice("balance", balance, BALANCES)
    return [(r, 2 * world - 1 - r) if balance == "zigzag" else (r,) for r in range(world)]


def chunk_bounds(n: int, world: int, balance: str = "zigzag"):
    """[rank's chunks as (chunk, start, stop) global rows] for a sequence of n rows on ``world`` ranks."""
    ids = chunk_ids(world, balance)
    chunks = 2 * world if balance == "zigzag" else world
    edge = [c * n // chunks for c in range(chunks + 1)]
    return [[(c, edge[c], edge[c + 1]) for c in cs] for cs in ids]


def relation(causal: bool, q_chunk: int, k_chunk: int):
    """How the query rows of one chunk see the keys of another (aligned chunks of one sequence):
    "full", "causal" (the same chunk: query i sees keys j <= i) or None (no pair)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "causal" if k_chunk == q_chunk else None


def pick_mode(hq: int, hkv: int, world: int) -> str:
    """mode="auto": the all-gather when the gathered K and V (2 Hkv N d) are no larger than twice the
    local q (Hq N / P d), i.e. Hq >= P Hkv; else the ring."""
    return "allgather" if hq >= world * hkv else "ring"
