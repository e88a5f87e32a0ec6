"""The peers' decode grid (peers-h200.md) for the decode probes: cells and their inputs."""

CELLS = [(L, B, hkv) for L in (4096, 16384, 65536) for B, hkv in ((8, 8), (64, 8), (8, 32))]


def decode_inputs(L, B, hkv, hq=32, d=128):
    """(q, k, v, bytes read) of one cell on the GPU: torch bf16 q (B, hq, 1, d) and a K/V cache
    (B, hkv, L, d); the bytes are the K and V cache read once plus q and o."""
    import torch

    q = torch.randn(B, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, 2 * B * hkv * L * d * 2 + 2 * B * hq * d * 2
