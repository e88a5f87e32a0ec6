"""The decode grid of benchmarks/peers.py (d=128, Hq=32) for decode measurements: cells, inputs,
and a case that times a variant next to torch SDPA's backends."""

CELLS = [(L, B, hkv) for L in (4096, 16384, 65536) for B, hkv in ((8, 8), (64, 8), (8, 32))]


def decode_inputs(L, B, hkv, hq=32, d=128, nq=1):
    """(q, k, v, bytes read) of one cell on the GPU: torch bf16 q (B, hq, nq, d) and a K/V cache
    (B, hkv, L, d); the bytes are the K and V cache read once plus q and o."""
    import torch

    q = torch.randn(B, hq, nq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, 2 * B * hkv * L * d * 2 + 2 * B * hq * nq * d * 2


class ProbeCase:
    """One decode shape for measurements that time forced launches (GPU machine): decode_inputs' torch
    tensors, their CuPy views, the validated problem, output buffers, and cuDNN's output (float32)
    as the check a variant's result must pass before it is timed (no mask: nq query tokens see
    every key)."""

    def __init__(self, L, B, hkv, hq=32, d=128, nq=1):
        import cupy as cp
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from cuflash.core.problem import validate_forward

        self.q, self.k, self.v, self.nbytes = decode_inputs(L, B, hkv, hq, d, nq)
        self.qc, self.kc, self.vc = (cp.from_dlpack(x) for x in (self.q, self.k, self.v))
        self.p = validate_forward(self.qc, self.kc, self.vc)
        self.o4 = cp.empty_like(self.qc)
        self.lse3 = cp.empty((B, hq, nq), dtype=cp.float32)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)
        self.ref = cp.from_dlpack(ref).astype(cp.float32)

    def peer_us(self, timer, peer):
        """Microseconds of torch SDPA on one backend: peer "cudnn" or "flash"."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[peer]
        with sdpa_kernel([backend]):
            return timer(lambda: F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True))[0] * 1e3

    def forward_us(self, timer, **kw):
        """Microseconds of gpu_decode.forward(**kw) once its output, written over NaNs, is within 0.02
        of cuDNN's; else "wrong <error>", or the exception's text (one variant must not end a run)."""
        import cupy as cp

        from cuflash.kernels import decode as gpu_decode

        def f():
            gpu_decode.forward(self.p, self.qc, self.kc, self.vc, self.o4, self.lse3, **kw)

        try:
            self.o4.fill(float("nan"))
            f()
            err = float(cp.abs(self.o4.astype(cp.float32) - self.ref).max())
            return timer(f)[0] * 1e3 if err < 0.02 else f"wrong {err}"
        except Exception as e:  # noqa: BLE001
            return repr(e)[:60]

    def alternate(self, timer, variants, passes, label, plans=None, peers=("cudnn", "flash"), digits=3):
        """`passes` rounds: torch SDPA on each of `peers` ("cudnn", "flash"), then `variants` (name ->
        callable returning microseconds, or a message where the variant failed), the variants' order
        reversed every other round so that neither side always runs first. Prints each round as x the
        faster peer (its time / the variant's), with plans[name] where given; returns the rounds,
        each {name: microseconds or message}."""
        names = list(variants)
        rounds = []
        for i in range(passes):
            us = {peer: self.peer_us(timer, peer) for peer in peers}
            for name in names if i % 2 == 0 else names[::-1]:
                us[name] = variants[name]()
            rounds.append(us)
            best = min(us[peer] for peer in peers)
            cells = []
            for name in names:
                tag = f"{name} [{plans[name]}]" if plans and name in plans else f"{name}"
                x = us[name]
                cells.append(f"{tag} {best / x:.{digits}f}" if isinstance(x, float) else f"{tag} {x}")
            print(f"{label} pass {i}: " + " ".join(f"{peer} {us[peer]:.1f}" for peer in peers) + " us | "
                  + ", ".join(cells), flush=True)
        return rounds
