"""GGUF files dequantized once into an fp32 safetensors folder that loads in about a second.

The cache is keyed by a SHA-256 of the GGUF's whole *content*, not its path: every virtual
environment or checkout holds its own copy of the packaged GGUF, and a path key made each of them
write another ~0.5 GB folder; a hash of the header, size and name could mistake two fine-tunes of
one architecture and quantization for one.  The hash (about 0.3 s for the packaged 98 MB file) is
remembered per (path, size, mtime) in ``hashes.json``, so a start after the first only stats the file.

Conversion reports a real fraction to ``progress``: the tokenizer, each dequantized tensor
(transformers' own loop, whose progress bar is redirected here), then copying and saving.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import write_atomic
from ..errors import ModelError

ProgressFn = Callable[[str, "float | None"], None]
MARKER = "ssd-chat-converted.json"
_HASHES = "hashes.json"
_patch_lock = threading.RLock()  # the two patches nest


def content_hash(path: Path, root: Path, progress: ProgressFn | None = None) -> str:
    """SHA-256 of ``path``'s bytes, remembered in ``root/hashes.json`` for as long as its size and mtime stay."""
    st = path.stat()
    where = str(path.resolve())
    memo_file = root / _HASHES
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    seen = memo.get(where) if isinstance(memo, dict) else None
    if isinstance(seen, dict) and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        return str(seen["sha256"])
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(f"checking {path.name}", done / max(1, st.st_size))
    digest = h.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[where] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    write_atomic(memo_file, json.dumps(memo, indent=1))  # a read-only cache only costs the hash again next time
    return digest


@contextlib.contextmanager
def _tensor_progress(report: Callable[[float], None]) -> Iterator[None]:
    """Route transformers' per-tensor GGUF progress bar to ``report(fraction)`` (no bar on the terminal)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - transformers moved it: conversion works, with coarser progress
        yield
        return
    if not hasattr(gguf_utils, "tqdm"):  # pragma: no cover
        yield
        return

    def counted(items: Iterable[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(items)
        for i, item in enumerate(items):
            report(i / max(1, len(items)))
            yield item
        report(1.0)

    with _patch_lock:
        original = gguf_utils.tqdm
        gguf_utils.tqdm = counted
        try:
            yield
        finally:
            gguf_utils.tqdm = original


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses the GGUF three times (config, tokenizer, weights), each slice of it through
    ``np.memmap`` (whose per-slice ``__array_finalize__`` dominates), and builds gguf's tensor-name map
    once per tensor: 44 s of a 98 MB file's conversion on 2 cores.  Here the file is parsed once, through
    a plain ndarray view of the same mapping, and the name map is built once per (arch, layers): 10 s,
    the same bytes."""
    try:
        import gguf as gguf_pkg
    except ImportError:  # pragma: no cover - transformers' GGUF support needs gguf; it reports that itself
        yield
        return
    from .gguf_header import reader as fast_reader

    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = fast_reader(path, mode)
        return readers[key]

    with _patch_lock:
        saved = gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map
        gguf_pkg.GGUFReader = reader  # transformers imports both from gguf at each call
        gguf_pkg.get_tensor_name_map = functools.cache(saved[1])
        try:
            yield
        finally:
            gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map = saved
            readers.clear()


def converted_gguf(gguf: Path, root: Path, progress: ProgressFn) -> Path:
    """The fp32 safetensors folder for ``gguf`` under ``root`` (``<cache>/converted``), converting it once."""
    digest = content_hash(gguf, root, progress)
    out = root / f"{gguf.stem}-{digest[:16]}"
    if (out / MARKER).is_file():
        return out
    stage = f"converting {gguf.name} to safetensors (once)"
    progress(stage, 0.0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            progress(stage, 0.2)
            with _tensor_progress(lambda f: progress(stage, 0.2 + 0.6 * f)):
                src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # corrupt or unsupported GGUF
        raise ModelError(f"could not read GGUF file '{gguf}': {e}") from e
    progress(stage, 0.8)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    progress(stage, 0.9)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size, "sha256": digest}))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    progress(stage, 1.0)
    return out
