"""A GGUF's file type (``general.file_type``: Q4_1, Q8_0, ...) read from its header alone.

gguf's ``GGUFReader`` parses every field and tensor record in Python, about 4 s for a file with a
49k-token vocabulary; ``ssd-chat config`` and the load-time label need one integer that sits near
the start of the metadata, so this reads key/value records until it meets it.  Imports no torch.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
KEY = "general.file_type"
# value type -> struct format of one value (GGUF value types 0-12; 8 = string, 9 = array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def file_type(path: str | Path, max_fields: int = 64) -> str | None:
    """The file type name as llama.cpp prints it (``Q4_1``, ``Q8_0``, ``F16``, ...), or None when the
    header does not say (or is not a GGUF header; loading reports that properly)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                return None
            version = _read(f, "<I")
            wide = "<Q" if version >= 2 else "<I"
            _read(f, wide)  # tensor count
            fields = _read(f, wide)
            for _ in range(min(fields, max_fields)):
                key = _string(f, wide)
                vtype = _read(f, "<I")
                if key == KEY and vtype in _SCALAR:
                    return _name(int(_read(f, _SCALAR[vtype])))
                _skip(f, vtype, wide)
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _name(value: int) -> str:
    try:
        from gguf import LlamaFileType

        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ImportError, ValueError):
        return f"file type {value}"


def _read(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO, wide: str) -> str:
    n = _read(f, wide)
    if n > 1 << 20:
        raise ValueError("implausible GGUF string length")
    return f.read(n).decode("utf-8")


def _skip(f: BinaryIO, vtype: int, wide: str) -> None:
    if vtype in _SCALAR:
        f.seek(struct.calcsize(_SCALAR[vtype]), 1)
    elif vtype == _STRING:
        f.seek(_read(f, wide), 1)
    elif vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, wide)
        if etype in _SCALAR:
            f.seek(count * struct.calcsize(_SCALAR[etype]), 1)
        else:
            for _ in range(count):
                _skip(f, etype, wide)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def reader(path: str | Path, mode: str = "r") -> Any:
    """gguf's ``GGUFReader`` over a plain ndarray view of the file's mapping: the reader slices its data
    once per field and tensor record, and ``np.memmap``'s per-slice Python hooks made that about 8 s for
    the packaged model on 2 cores (under 2 s this way, the same bytes)."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself (a conversion patches the package's name)

    class Reader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._data

        @data.setter
        def data(self, value: Any) -> None:
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader(path, mode)
