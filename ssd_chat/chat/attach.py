"""Text files in a prompt: ``ssd-chat ask -a FILE`` and the app's ``/attach FILE``.

A file goes into the user's turn as a fenced block headed by its name, before the user's own text::

    File: src/app.py
    ```python
    ...
    ```

    What does this do?

The turn is stored as sent, so a saved chat, an export and a regenerated reply see the file too.
Only UTF-8 text is attached: a file with a NUL byte or invalid UTF-8 is refused, and so is one
with more tokens than the target's context (counted with the target's own tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .terminal import printable

MAX_BYTES = 16 * 1024 * 1024  # far above any context's worth of text: never read a huge file into memory

LANGS = {
    ".py": "python", ".pyi": "python", ".rs": "rust", ".go": "go", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp",
    ".hpp": "cpp", ".js": "javascript", ".mjs": "javascript", ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx",
    ".java": "java", ".kt": "kotlin", ".rb": "ruby", ".php": "php", ".sh": "bash", ".bash": "bash", ".zsh": "zsh",
    ".sql": "sql", ".html": "html", ".css": "css", ".json": "json", ".jsonl": "json", ".toml": "toml",
    ".yaml": "yaml", ".yml": "yaml", ".xml": "xml", ".md": "markdown", ".tex": "latex", ".lua": "lua", ".swift": "swift",
    ".cs": "csharp", ".r": "r", ".jl": "julia", ".hs": "haskell", ".ml": "ocaml", ".scala": "scala", ".dart": "dart",
}


class AttachError(ValueError):
    """A file that cannot go into a prompt; the message is one line."""


@dataclass(frozen=True)
class Attachment:
    path: str  # as the user gave it: the name the model and the transcript see
    text: str

    @property
    def lang(self) -> str:
        return LANGS.get(Path(self.path).suffix.lower(), "")

    @property
    def shown(self) -> str:
        return printable(self.path, one_line=True)

    def block(self) -> str:
        """The file as a fenced block; the fence is longer than any backtick run inside the file."""
        fence = "```"
        while fence in self.text:
            fence += "`"
        return f"File: {self.path}\n{fence}{self.lang}\n{self.text.rstrip(chr(10))}\n{fence}"


def read(path: str) -> Attachment:
    """The file at ``path`` as text, or an AttachError saying in one line why it cannot be attached."""
    shown = printable(path, one_line=True)
    p = Path(path).expanduser()
    try:
        if not p.exists():
            raise AttachError(f"cannot attach {shown}: no such file")
        if p.is_dir():
            raise AttachError(f"cannot attach {shown}: it is a directory (attach its files one by one)")
        if not p.is_file():
            raise AttachError(f"cannot attach {shown}: not a regular file")
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise AttachError(f"cannot attach {shown}: it is {size / 1e6:.1f} MB, more than the {MAX_BYTES / 1e6:.0f} MB "
                              "a file may have (far more than a model's context holds)")
        data = p.read_bytes()
    except OSError as e:
        raise AttachError(f"cannot attach {shown}: {e.strerror or e}") from None
    if b"\0" in data:
        raise AttachError(f"cannot attach {shown}: it is a binary file (it holds NUL bytes); only text files can be attached")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AttachError(f"cannot attach {shown}: it is not UTF-8 text (a bad byte at offset {e.start}); "
                          "only text files can be attached") from None
    return Attachment(path, text.removeprefix("\ufeff"))


def turn(attachments: list[Attachment], text: str) -> str:
    """The user's turn: each file as a fenced block, then what the user wrote."""
    parts = [a.block() for a in attachments]
    if text.strip():
        parts.append(text)
    return "\n\n".join(parts)


def count(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` alone (a file's block: what it adds to the turn)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def check_fits(sizes: list[tuple[Attachment, int]], context: int | None, model: str) -> None:
    """Refuse files whose tokens do not fit the context: each file, then all of them together."""
    if not context:
        return
    for a, n in sizes:
        if n >= context:
            raise AttachError(f"cannot attach {a.shown}: it is {n:,} tokens, more than {model}'s context of {context:,} tokens")
    total = sum(n for _, n in sizes)
    if len(sizes) > 1 and total >= context:
        raise AttachError(f"the attached files are {total:,} tokens in all, more than {model}'s context of {context:,} tokens")


def precheck(values: dict[str, Any], attachments: list[Attachment]) -> None:
    """Before any weights load: count the files with the target's tokenizer against its configured context.
    Anything that stops this check (a model not yet downloaded) is left to the load to report."""
    if not attachments:
        return
    try:
        import json

        from ..engine import load_tokenizer, resolve_model as resolve, tokenizer_folder
        from .loading import quiet_libraries

        quiet_libraries()
        spec = resolve(values["target"])
        if spec.kind == "gguf":  # the tokenizer of its converted folder, if it was converted before (the load converts it)
            from ..engine import CONVERTED_MARKER as MARKER, content_hash, cache_dir

            gguf, root = Path(spec.source), cache_dir() / "converted"
            folder = root / f"{gguf.stem}-{content_hash(gguf, root, lambda *_: None)[:16]}"
            if not (folder / MARKER).is_file():
                return
        else:
            folder = tokenizer_folder(spec)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        context = int(config.get("max_position_embeddings") or 0) or None
        tokenizer = load_tokenizer(folder, bool(values.get("trust_remote_code")))
    except Exception:  # noqa: BLE001 - the exact check after loading still runs
        return
    check_fits([(a, count(tokenizer, a.block())) for a in attachments], context, values["target"])
