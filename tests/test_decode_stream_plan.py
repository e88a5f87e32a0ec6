"""The stream decode kernel's plan (CPU): block ranges within the kernel's Q slots, pairs within
their partial slots."""

from cuflash import gpu_decode


def test_decode_stream_plan_bounds():
    # Every block's range touches at most STREAM_Q_SLOTS pairs and every pair fits max_seg slots.
    from types import SimpleNamespace

    t = gpu_decode._stream_base_tile(128)
    unit = t.warps * t.block_n
    for batch, hkv, nk, sms in [(64, 8, 4096, 132), (8, 32, 65536, 132), (3, 1, 300, 132), (1000, 8, 256, 132),
                                (5, 2, 1300, 1), (7, 3, 5000, 3)]:
        p = SimpleNamespace(batch=batch, hkv=hkv, nk=nk, nq=1, causal=None, window=None, d=128)
        sp = gpu_decode.stream_plan(p, t, sms, 110592)
        upp = -(-sp.keys // unit)
        units = batch * hkv * upp
        starts = [g * units // sp.blocks for g in range(sp.blocks + 1)]
        assert sp.blocks <= units and starts[-1] == units
        for g in range(sp.blocks):
            first, last = starts[g] // upp, (starts[g + 1] - 1) // upp
            assert last - first + 1 <= gpu_decode.STREAM_Q_SLOTS
        for pair in range(batch * hkv):
            owners = {g for g in range(sp.blocks) if starts[g] < (pair + 1) * upp and starts[g + 1] > pair * upp}
            assert len(owners) <= sp.max_seg
