"""The models on this machine and the caches ssd-chat derives from them (``ssd-chat models``).

Three kinds of local model: hub repositories in the Hugging Face cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``), the packaged GGUF, and GGUF files the user has run (remembered by the converter's
``hashes.json``).  Two caches hang off a model: ``converted/`` (a GGUF dequantized to safetensors, keyed
by the file's content) and ``aoti/`` (AOTInductor packages, named ``<model name>-<rows>rows-<key>.pt2``
after the name the model was loaded by).  A package whose name is no alias, hub id or packaged name
(a local folder's path, a test's model) cannot be traced to its source: it is "unattributed", and only
``prune --all`` removes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..config import cache_dir, cpu_name
from . import models

_PACKAGE = re.compile(r"^(?P<name>.+)-(?P<rows>\d+)rows-(?P<key>[0-9a-f]{20})\.pt2$")
MARKER = "ssd-chat-converted.json"  # as convert.MARKER (convert imports torch; this module need not)
# caches derived from models, removed by ``prune --all``; the timing files (fastlinear.json, mode-probe.json)
# are measurements of this machine, not of a model, and stay
DERIVED = ("converted", "aoti", "inductor", "kernels", "distill")
KINDS = {"converted": "GGUF models converted to safetensors", "aoti": "compiled model graphs (AOTInductor packages)",
         "inductor": "torch inductor's kernel cache", "kernels": "compiled CPU row kernels",
         "distill": "draft-training data", "timings": "timings of this machine (matrix kernels, mode probe)"}


def hub_cache() -> Path:
    """The hub cache as huggingface_hub resolves it, read now (tests and users set these per run)."""
    for env in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def size_of(path: Path) -> int:
    """Bytes on disk under ``path`` (a hub repo's blobs once, not its snapshot links)."""
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                try:
                    total += p.stat().st_size
                except OSError:
                    pass
    return total


def human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def aliases_of(repo_id: str) -> list[str]:
    return [a for a, h in models.ALIASES.items() if h == repo_id]


def hub_repos() -> dict[str, Path]:
    """Model repositories in the hub cache: repo id -> its folder (``models--org--name``)."""
    root = hub_cache()
    out = {}
    if root.is_dir():
        for d in sorted(root.glob("models--*")):
            if d.is_dir():
                out["/".join(d.name.split("--")[1:])] = d
    return out


@dataclass
class Package:
    path: Path
    name: str  # the model name it was compiled for
    size: int


def packages() -> list[Package]:
    root = cache_dir() / "aoti"
    out = []
    for p in sorted(root.glob("*.pt2")) if root.is_dir() else []:
        m = _PACKAGE.match(p.name)
        if m:
            out.append(Package(p, m["name"], size_of(p)))
    return out


def names_of(repo_id: str) -> set[str]:
    """The names a package for ``repo_id`` is filed under: its aliases and its id ('/' as '_')."""
    return {repo_id.replace("/", "_"), *aliases_of(repo_id)}


@dataclass
class Converted:
    path: Path
    sources: list[str]  # the GGUF files known to hold this content
    size: int

    @property
    def source_present(self) -> bool:
        return any(Path(s).is_file() for s in self.sources)


def converted() -> list[Converted]:
    root = cache_dir() / "converted"
    by_hash: dict[str, list[str]] = {}
    for path, seen in _memo().items():
        if isinstance(seen, dict) and "sha256" in seen:
            by_hash.setdefault(str(seen["sha256"])[:16], []).append(path)
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not (d / MARKER).is_file():
            continue
        try:
            marker = json.loads((d / MARKER).read_text())
        except (OSError, ValueError):
            marker = {}
        sources = list(dict.fromkeys([*([marker["gguf"]] if "gguf" in marker else []),
                                      *by_hash.get(str(marker.get("sha256", ""))[:16], [])]))
        out.append(Converted(d, sources, size_of(d)))
    return out


@dataclass
class Local:
    """One model on this machine, with the caches derived from it."""

    name: str  # hub id, or the GGUF's path
    kind: str  # "hub", "packaged" or "gguf"
    path: Path
    size: int
    aliases: list[str] = field(default_factory=list)
    converted: list[Converted] = field(default_factory=list)
    packages: list[Package] = field(default_factory=list)

    @property
    def derived(self) -> list[Path]:
        return [c.path for c in self.converted] + [p.path for p in self.packages]

    def row(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": str(self.path), "size": self.size, "aliases": self.aliases,
                "converted": sum(c.size for c in self.converted), "compiled": sum(p.size for p in self.packages),
                "compiled_packages": len(self.packages)}


def _memo() -> dict:
    try:
        memo = json.loads((cache_dir() / "converted" / "hashes.json").read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def content_key(path: Path, memo: dict, hash_it: bool = False) -> str:
    """The first 16 hex digits of the file's SHA-256 as the converter keys it (remembered while its size and mtime
    stay; ``hash_it``: computed otherwise, about 0.3 s for the packaged file), else its path."""
    import hashlib

    st = path.stat()
    seen = memo.get(str(path.resolve()))
    if isinstance(seen, dict) and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        return str(seen["sha256"])[:16]
    if not hash_it:
        return str(path.resolve())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def local_models() -> list[Local]:
    """Every model on this machine: the packaged GGUF, the GGUF files that were run (copies of one content once),
    and the hub repos."""
    pkgs, convs, memo = packages(), converted(), _memo()
    out: list[Local] = []
    packaged = models.packaged_gguf()
    found: dict[str, Local] = {}
    candidates = ([packaged] if packaged is not None else []) + [Path(s) for c in convs for s in c.sources]
    for g in candidates:
        if not g.is_file():
            continue
        is_packaged = packaged is not None and g == packaged
        key = content_key(g, memo, hash_it=is_packaged)
        if key in found:
            continue
        mine = [c for c in convs if c.path.name.endswith("-" + key)]
        found[key] = Local(str(g), "packaged" if is_packaged else "gguf", g, size_of(g),
                           [models.PACKAGED] if is_packaged else [], mine,
                           [p for p in pkgs if is_packaged and p.name == models.PACKAGED])
    out += found.values()
    for repo_id, path in hub_repos().items():
        out.append(Local(repo_id, "hub", path, size_of(path), aliases_of(repo_id), [],
                         [p for p in pkgs if p.name in names_of(repo_id)]))
    return out


def find(name: str) -> Local | None:
    """The local model ``name`` (alias, hub id, packaged name or GGUF path) names, or None."""
    spec = models.resolve(name)  # a ModelError for a name that is no model
    for m in local_models():
        if spec.kind == "hub" and m.kind == "hub" and m.name == spec.source:
            return m
        if spec.kind == "gguf" and m.kind != "hub" and Path(spec.source).resolve() == m.path.resolve():
            return m
    return None


def _unlink(p: Path) -> None:
    """A cache file, and a compiled package's sidecars (who built it, its build lock)."""
    p.unlink(missing_ok=True)
    if p.suffix == ".pt2":
        p.with_suffix(".json").unlink(missing_ok=True)
        p.with_suffix(".lock").unlink(missing_ok=True)


def remove(m: Local) -> int:
    """Delete ``m`` from the hub cache (never a GGUF file: the user's own, or the pip package's) and every
    cache derived from it; the bytes freed."""
    freed = 0
    targets = [*m.derived, *([m.path] if m.kind == "hub" else [])]
    for p in targets:
        freed += size_of(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            _unlink(p)
    return freed


def cache_sizes() -> dict[str, int]:
    """ssd-chat's own caches by kind (see KINDS), in bytes."""
    root = cache_dir()
    out = {k: size_of(root / k) if (root / k).exists() else 0 for k in DERIVED}
    out["timings"] = sum(size_of(p) for p in root.glob("*.json")) if root.is_dir() else 0
    return out


def built_elsewhere(package: Path) -> bool:
    """Whether a compiled package was built by another torch version or for another CPU (what its ``.json``
    says; a package without one is kept): this install never loads it."""
    import torch

    try:
        built = json.loads(package.with_suffix(".json").read_text(encoding="utf-8"))
        return built.get("torch") != torch.__version__ or built.get("cpu") != cpu_name()
    except (OSError, ValueError, AttributeError):
        return False


def orphans() -> list[Path]:
    """Derived caches no model here can use: converted folders no GGUF file holds any more, compiled packages
    of an alias, hub id or the packaged model that is no longer here, and packages another torch version or
    CPU built."""
    present_hub = set(hub_repos())
    out = [c.path for c in converted() if not c.source_present]
    known = {models.PACKAGED: models.packaged_gguf() is not None}
    for alias, repo in models.ALIASES.items():
        known[alias] = repo in present_hub
    for p in packages():  # one filed under a hub id, or unattributed (its source untold by its name), stays
        if (p.name in known and not known[p.name]) or built_elsewhere(p.path):
            out.append(p.path)
    return out


def prune(paths: list[Path]) -> int:
    freed = 0
    for p in paths:
        freed += size_of(p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            _unlink(p)
    return freed


def all_derived() -> list[Path]:
    root = cache_dir()
    return [root / k for k in DERIVED if (root / k).exists()]
