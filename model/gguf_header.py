"""A GGUF file's header: its architecture and tensor infos, read without decoding the metadata.

gguf-py's ``GGUFReader`` parses every metadata value into NumPy views of a memory map: several
seconds for a tokenizer's 50-130k strings and merges. Serving needs only the tensor infos and the
architecture (``gguf_weights.py``), and the import checks a file is whole before reading it
(``gguf_import.open_gguf``), so this walks the metadata without decoding it. Checked against
gguf-py in tests/model/test_gguf_serving.py.

Source: the GGUF specification (github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic,
version, tensor and metadata counts, metadata (key, type, value), tensor infos (name, dims, type,
offset), data aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["TensorInfo", "read_tensor_infos", "tensor_bytes"]


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file: ``shape`` in NumPy order (the file's dims reversed), GGML type id,
    absolute byte offset of its data."""
    shape: tuple
    type_id: int
    offset: int


# GGUF metadata value types (gguf.md): fixed sizes of the scalar ones; 8 = string, 9 = array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_infos(path) -> tuple[str | None, dict[str, TensorInfo]]:
    """``(general.architecture, {name: TensorInfo})`` of a GGUF file (versions 2 and 3), from its
    header alone.

    gguf-py's ``GGUFReader`` parses every metadata value into NumPy views of a memory map, several
    seconds for a tokenizer's 50-130k strings and merges; serving needs only the tensor infos and
    the architecture, so this walks the metadata without decoding it (the tokenizer and config
    are read with gguf-py once, at import). ``tests/model/test_gguf_serving.py`` checks it against
    gguf-py.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, an unknown version, or a header cut short (truncated file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    try:
        return _parse_header(buf, path)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is truncated or corrupt (its header ends early: {e})") from None
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _parse_header(buf, path: Path):
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; folio reads versions 2 and 3")
    at = 24

    def string(at):
        (n,) = struct.unpack_from("<Q", buf, at)
        end = at + 8 + n
        if end > len(buf):
            raise IndexError("a string runs past the end of the file")
        return bytes(buf[at + 8:end]).decode("utf-8"), end

    def skip(vtype, at):
        if vtype in _SCALAR_BYTES:
            return at + _SCALAR_BYTES[vtype]
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + n
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[etype]
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise ValueError(f"{path}: unknown metadata value type {vtype}")

    arch, alignment = None, 32
    for _ in range(n_kv):
        key, at = string(at)
        (vtype,) = struct.unpack_from("<I", buf, at)
        at += 4
        if key == "general.architecture" and vtype == _STRING:
            arch, at = string(at)
        elif key == "general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", buf, at)
            at += 4
        else:
            at = skip(vtype, at)
    raw = []
    for _ in range(n_tensors):
        name, at = string(at)
        (n_dims,) = struct.unpack_from("<I", buf, at)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        raw.append((name, tuple(int(d) for d in reversed(dims)), int(type_id), int(offset)))
    data_start = (at + alignment - 1) // alignment * alignment
    return arch, {name: TensorInfo(shape, type_id, data_start + offset) for name, shape, type_id, offset in raw}


def tensor_bytes(info: TensorInfo) -> int:
    """Bytes of a tensor of any GGML type the ``gguf`` package knows (its block sizes); 0 for a type
    id it does not know."""
    import gguf
    try:
        values, nbytes = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.type_id)]
    except (ValueError, KeyError):
        return 0
    n = int(np.prod(info.shape, dtype=np.int64)) if info.shape else 1
    return n // values * nbytes
