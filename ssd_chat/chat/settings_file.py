"""Writing the config file: TOML text for what the file holds, and a write that is whole or none.

No TOML writer is among the dependencies, and the file holds only flat values, so the few forms are
written here; each write is parsed back with ``tomllib`` before it replaces the file, so text that
no command could read never lands.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

# the short escapes TOML has; every other control character is written \uXXXX
_SHORT = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def string(s: str) -> str:
    """``s`` as a TOML basic string.  ValueError for a lone surrogate (text that was not valid UTF-8,
    e.g. undecodable bytes on the command line): TOML, being UTF-8, has no way to write one."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04X}")
        elif 0xD800 <= o <= 0xDFFF:
            raise ValueError(f"the text is not valid UTF-8 (it holds {ch.encode('utf-8', 'backslashreplace').decode()})")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def value(v: Any) -> str:
    """``v`` in TOML: the settings' types, and whatever else a hand-written file holds (kept as written)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # inf and nan are TOML's spellings too
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
    if not isinstance(v, str):  # dates and times
        return v.isoformat()
    return string(v)


def key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else string(k)


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file in the same folder, flushed to
    disk, then renamed over it.  A symlinked file is written where its link points; a file the user
    cannot write (read-only) is refused even where renaming over it would be allowed.  OSError on failure."""
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask  # a new file: as open() would make it
    if target.exists():
        with open(target, "r+b"):  # PermissionError for a read-only file, as writing it in place would give
            pass
        mode = target.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".toml.tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
