"""A trained draft's folder: its manifest and weights, and rebuilding the draft from them.

A folder holds ``draft.json`` (what the draft is and which target it was trained for, with a
hash of the target weights it shares) and ``draft.safetensors`` (only the draft's own tensors).
:func:`load_draft_folder` rebuilds the draft on top of the loaded target and refuses a target it does not
fit.  Writing a folder is training's job (``ssd_chat.train``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..cpu import fastlinear
from ..errors import ModelError, ParamError
from ..load.models import LoadedModel, ModelSpec
from .feature import FeatureDraft
from .model import DraftShape, build, shared_hash, trainable_state

MANIFEST = "draft.json"
WEIGHTS = "draft.safetensors"
FORMAT = "ssd-chat-draft"
VERSION = 1


def is_draft_dir(name: str | Path) -> bool:
    try:
        return (Path(name).expanduser() / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"'{folder}' is not a readable ssd-chat draft: {e}") from e
    if manifest.get("format") != FORMAT:
        raise ModelError(f"'{path}' is not an ssd-chat draft manifest")
    if manifest.get("version") != VERSION:
        raise ModelError(f"draft '{folder}' has format version {manifest.get('version')}; this ssd-chat reads version {VERSION}")
    return manifest


def shape_text(manifest: dict[str, Any]) -> str:
    """What a trained draft is, from its manifest: "2 shared layers + 2 own, 8192-token head"."""
    own = len(manifest.get("init_from") or ())
    shared = int(manifest.get("num_shared") or 0)
    if manifest.get("kind", "layers") == "features":
        body = f"{own} own layer{'s' * (own != 1)} on the target's hidden states"
    elif shared:
        body = f"{shared} shared layer{'s' * (shared != 1)} + {own} own"
    else:
        body = f"{own} own layer{'s' * (own != 1)}"
    head, full = manifest.get("num_vocab"), (manifest.get("target") or {}).get("vocab_size")
    return body + (f", {head}-token head" if head and head != full else ", full head")


def label(folder: str | Path, alias: str | None = None) -> str:
    """How a trained draft is named to users: the alias it was chosen by (``trained``) or its folder's
    name, then what it is, so the shipped ``smollm2-135m-instruct`` folder does not read as the target."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    return f"{alias or manifest.get('name') or folder.name} ({shape_text(manifest)})"


def load_draft_folder(folder: str | Path, target: LoadedModel, alias: str | None = None) -> LoadedModel:
    """Rebuild the draft in ``folder`` on top of ``target`` (refusing a target it was not trained for);
    ``alias``: the name it was chosen by (``trained``), for its label."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    want = manifest["target"]
    model = target.model
    cfg = model.config
    num_shared = int(manifest["num_shared"])
    kind = manifest.get("kind", "layers")
    mismatch = (
        want.get("hidden_size") != cfg.hidden_size
        or want.get("num_hidden_layers") != cfg.num_hidden_layers
        or want.get("vocab_size") != int(model.get_output_embeddings().weight.shape[0])
        or want.get("shared_hash") != shared_hash(model, -1 if kind == "features" else num_shared)
    )
    if mismatch:
        raise ModelError(
            f"draft '{folder}' was trained for target '{want.get('name')}' and does not fit '{target.name}' "
            f"(its {'weights' if kind == 'features' else 'shared weights'} differ); train one for this target with: ssd-chat draft train --target {target.name} --out DIR"
        )
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - missing or corrupt file
        raise ModelError(f"could not read the draft weights in '{folder}': {e}") from e
    shape = DraftShape(num_shared, tuple(int(i) for i in manifest["init_from"]))
    dev, dt = target.device, next(model.parameters()).dtype
    if kind == "features":
        try:
            draft = FeatureDraft(model, shape.init_from, tensors.pop("vocab_ids").to(torch.long), manifest.get("fuse_layer"))
        except ParamError as e:
            raise ModelError(f"draft '{folder}' does not fit '{target.name}': {e}") from e
    elif kind == "layers":
        draft = build(model, shape, tensors.pop("vocab_ids").to(torch.long))
    else:
        raise ModelError(f"draft '{folder}' is of kind '{kind}', which this ssd-chat does not know")
    state = trainable_state(draft)
    missing = sorted(set(state) - set(tensors))
    if missing or set(tensors) - set(state):
        raise ModelError(f"draft '{folder}' does not match its manifest (missing or extra tensors: {missing[:3]})")
    with torch.no_grad():
        for n, p in state.items():
            p.copy_(tensors[n].to(dev, dt))
    for p in state.values():
        p.requires_grad_(False)
    fastlinear.install(draft)  # a feature draft's new fc; the head's shape is timed (copied layers keep the target's fast path)
    return LoadedModel(
        name=label(folder, alias),
        spec=ModelSpec(str(folder), "derived", str(folder)),
        model=draft.eval(),
        tokenizer=target.tokenizer,
        placement=target.placement,
        folder=folder,
        eos_ids=target.eos_ids,
    )
