"""A stored chunk decodes to exactly the length the manifest gives it, never to what its own header claims.

The bound is the caller's ``expected`` (from the manifest's chunk table): a
chunk whose header says another length is refused before anything is
decompressed or allocated, whether it claims less or more, raw or zstd, so a
well-formed chunk of another size (an object of another save, a bug in an
encoder) never reaches the chunk checksum with more bytes than the chunk has.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardckpt.format import codec


def _weights(n: int) -> bytes:
    """bf16-like bytes that compress (the zstd mode), ``n`` values."""
    rng = np.random.default_rng(0)
    return ((rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.parametrize("kind", ["zstd", "raw"])
def test_a_chunk_whose_header_claims_another_length_is_refused_before_decoding(kind):
    data = _weights(1 << 16) if kind == "zstd" else np.random.default_rng(1).bytes(1 << 17)
    stored = codec.encode_chunk(data)
    assert stored[2] == (codec.ZSTD if kind == "zstd" else codec.RAW)
    assert codec.decode_chunk(stored, len(data)) == data
    for expected in (len(data) // 4, len(data) - 1, len(data) + 1, 4 * len(data)):
        with pytest.raises(codec.CodecError, match="header"):
            codec.decode_chunk(stored, expected)
