"""A fingerprint of a checkpoint's weights: two engines whose KV blocks are exchanged must run the
same weights, and an architecture and shape check cannot tell two fine-tunes (or a rolling
upgrade's old and new revisions) apart.

Hashes every safetensors file's header (tensor names, dtypes, shapes, offsets) and a fixed sample
of every tensor's bytes: its first and last ``SAMPLE_BYTES`` (the whole tensor when smaller). Two
checkpoints that differ anywhere in those bytes differ in the fingerprint; reading them costs a
few seeks per tensor, not a pass over the weights.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from pdserve.models.loader import checkpoint_files

SAMPLE_BYTES = 4096
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound


def weights_fingerprint(folder: str | Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in checkpoint_files(Path(folder)):
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"{path}: not a safetensors file (header of {header_len} bytes)")
            header_bytes = handle.read(header_len)
            digest.update(path.name.encode() + b"\0" + header_bytes)
            data_start = 8 + header_len
            header = json.loads(header_bytes)
            for name in sorted(key for key in header if key != "__metadata__"):
                begin, end = header[name]["data_offsets"]
                if end - begin <= 2 * SAMPLE_BYTES:
                    spans = [(begin, end)]
                else:
                    spans = [(begin, begin + SAMPLE_BYTES), (end - SAMPLE_BYTES, end)]
                for start, stop in spans:
                    handle.seek(data_start + start)
                    digest.update(handle.read(stop - start))
    return digest.hexdigest()
