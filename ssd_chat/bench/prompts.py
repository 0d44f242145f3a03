"""The prompt sets ``bench`` races on: the packaged families (``assets/prompts/*.jsonl``) or a file."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from . import BenchError

FAMILIES = ("code", "instructions", "math", "chat")


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    id: str
    family: str
    text: str


def _read_jsonl(text: str, source: str, default_family: str) -> list[BenchPrompt]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{source} line {n} is not valid JSON: {e.msg}") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise BenchError(f"{source} line {n}: expected an object with a non-empty \"prompt\" string (or a JSON string)")
        pid = str(obj.get("id") or f"{default_family}-{len(out) + 1:02d}")
        if any(p.id == pid for p in out):  # ids key the comparison with AR: keep them unique
            pid = f"{pid}-line{n}"
        out.append(BenchPrompt(pid, str(obj.get("family") or default_family), obj["prompt"]))
    return out


def load_prompts(spec: str, limit: int | None = None) -> tuple[list[BenchPrompt], str]:
    """Prompts for ``--prompts``: ``all``, families (``code,math``), or a ``.jsonl`` / ``.txt`` file.

    Families are interleaved (code-01, instructions-01, math-01, chat-01, code-02, …);
    ``limit`` keeps the first N of each family (of a file: its first N prompts)."""
    spec = (spec or "all").strip()
    if limit is not None and limit < 1:
        raise BenchError("--limit must be at least 1")
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names and all(n in FAMILIES or n == "all" for n in names):
        fams = list(FAMILIES) if "all" in names else list(dict.fromkeys(names))
        per_family = [_read_jsonl(files("ssd_chat.assets").joinpath("prompts", f"{f}.jsonl").read_text(encoding="utf-8"),
                                  f"prompts/{f}.jsonl", f)[:limit] for f in fams]
        interleaved = [p for group in itertools.zip_longest(*per_family) for p in group if p is not None]
        return interleaved, ",".join(fams)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BenchError(f"--prompts '{spec}' is neither a prompt set ({', '.join(('all',) + FAMILIES)}) nor an existing file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read prompts from '{path}': {e}") from None
    if path.suffix.lower() == ".jsonl":
        ps = _read_jsonl(text, str(path), path.stem)
    else:  # one prompt per line
        ps = [BenchPrompt(f"{path.stem}-{i + 1:02d}", path.stem, line.strip()) for i, line in
              enumerate(ln for ln in text.splitlines() if ln.strip())]
    if not ps:
        raise BenchError(f"'{path}' holds no prompts")
    return (ps[:limit] if limit else ps), str(path)
