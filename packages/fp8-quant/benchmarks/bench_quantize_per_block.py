"""``ops/quantize_per_block.py``: ``quantize_per_block`` with 128x128 blocks (DeepSeek-style
weights); the harness (timing, the table) is ``conftest.py``. Bytes are the minimal ones:
read x once (``x.nbytes``), write q (FP8 codes, 1 B each) and one fp32 scale (4 B) per
block."""

import fp8_quant


def test_quantize_per_block(record, x):
    nbytes = x.nbytes + x.numel() + x.numel() // (128 * 128) * 4
    record(
        "quantize_per_block 128x128", lambda: fp8_quant.quantize_per_block(x, (128, 128)), nbytes
    )
