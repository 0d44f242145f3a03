"""A trained draft derived from its target: shared trunk + small trained tail + reduced-vocabulary head.

Shape (for a Llama-style target with ``model.layers``)::

    target embedding ─> target layers 0..S-1 ─> new layers (trained) ─> final norm (trained) ─> reduced head
    └──────────── shared, frozen, never saved ─┘  └────────────────── saved in the draft folder ───────────┘

* The shared trunk is the target's own modules (no copy, no extra memory); the
  draft folder stores only the tail, the final norm, a bias over the reduced
  vocabulary and the list of its token ids.  A hash of the shared weights in the
  manifest makes loading refuse a different target.
* The head scores only the ``V'`` tokens the target actually emits on the training
  data, with the target's own output-embedding rows (rebuilt at load time), and
  returns full-vocabulary logits with ``-inf`` elsewhere.  Speculative sampling is
  exact for *any* proposal distribution q: a token outside the support of q is
  simply never drafted, and the residual ``max(p - q, 0)`` still gives it its
  target probability on a rejection.  Restricting q's support costs acceptance
  (only when the target's token is outside V'), never correctness.
* The draft is an object of the target's own class (a shallow copy with its own
  layer list and config), so it is called exactly like any model:
  ``model(input_ids=..., cache=DynamicCache(config=model.config), use_cache=True,
  position_ids=..., logits_to_keep=...)`` and its cache has one entry per layer it runs.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import fastlinear
from .errors import ModelError
from .models import LoadedModel, ModelSpec

MANIFEST = "draft.json"
WEIGHTS = "draft.safetensors"
FORMAT = "ssd-chat-draft"
VERSION = 1


class ReducedHead(nn.Module):
    """Logits over ``ids`` (the reduced vocabulary) from fixed target rows plus a trained bias,
    scattered into a full-vocabulary tensor that is ``-inf`` elsewhere.

    The rows are a buffer named ``rows`` (not ``weight``), so code that reads the head's
    width from ``weight`` falls back to ``config.vocab_size``: the full width."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int, row_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.register_buffer("rows", rows.detach().clone(), persistent=False)  # [V', H], from the target
        self.register_buffer("ids", ids.detach().clone().long(), persistent=False)  # [V']
        fixed = row_bias.detach().clone() if row_bias is not None else torch.zeros(len(ids), dtype=rows.dtype, device=rows.device)
        self.register_buffer("fixed_bias", fixed, persistent=False)  # the target head's own bias, if any
        self.bias = nn.Parameter(torch.zeros(len(ids), dtype=rows.dtype, device=rows.device))  # trained

    fast_linear_weights = ("rows",)  # fastlinear.install times its shape too

    def sub_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits over the reduced vocabulary [..., V']."""
        return fastlinear.linear(h, self.rows, None, self._rows_t) + (self.fixed_bias + self.bias)

    def _rows_t(self) -> torch.Tensor:
        return fastlinear.cached_transpose(self, self.rows)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.sub_logits(h)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.ids] = sub
        return full


@dataclass(frozen=True, slots=True)
class DraftShape:
    """Which target layers are shared and which target layers initialise the new ones."""

    num_shared: int
    init_from: tuple[int, ...]  # one target layer index per new layer

    @property
    def num_layers(self) -> int:
        return self.num_shared + len(self.init_from)


def _parts(target: nn.Module) -> tuple[nn.Module, Any, nn.Module, nn.Linear]:
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if layers is None or norm is None or not isinstance(head, nn.Linear) or not hasattr(inner, "embed_tokens"):
        raise ModelError(
            f"trained drafts need a Llama-style decoder (model.embed_tokens, model.layers, model.norm, a linear lm_head); "
            f"'{type(target).__name__}' is not one"
        )
    if getattr(target.config, "final_logit_softcapping", None) or getattr(target.config, "logit_scale", None):
        raise ModelError(f"trained drafts do not support targets that rescale their logits ('{type(target).__name__}')")
    return inner, layers, norm, head


def check_shape(target: nn.Module, shape: DraftShape) -> None:
    _, layers, _, _ = _parts(target)
    n = len(layers)
    if not 0 <= shape.num_shared < n:
        raise ModelError(f"--layers {shape.num_shared}: the target has {n} layers, so share between 0 and {n - 1}")
    if not shape.init_from:
        raise ModelError("a trained draft needs at least one new layer")
    bad = [i for i in shape.init_from if not 0 <= i < n]
    if bad:
        raise ModelError(f"cannot initialise new layers from target layer(s) {bad}: the target has layers 0-{n - 1}")


def _shallow(module: nn.Module) -> nn.Module:
    """A shallow copy whose module/parameter registries are its own (edits don't touch the original)."""
    c = copy.copy(module)
    c._modules = dict(module._modules)
    c._parameters = dict(module._parameters)
    c._buffers = dict(module._buffers)
    return c


def _set_layer_idx(layer: nn.Module, idx: int) -> None:
    for m in layer.modules():
        if hasattr(m, "layer_idx"):
            m.layer_idx = idx


def _sub_config(config: Any, source_layers: list[int]) -> Any:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(source_layers)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == config.num_hidden_layers:
        cfg.layer_types = [types[i] for i in source_layers]
    return cfg


def reduced_head(head: nn.Linear, vocab_ids: torch.Tensor) -> "ReducedHead":
    """A zero-bias head over ``vocab_ids`` made of the target head's rows (checked ids)."""
    vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=head.weight.device)
    vocab_size = int(head.weight.shape[0])
    if vocab_ids.numel() == 0 or int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= vocab_size:
        raise ModelError(f"the draft's vocabulary ids must lie in 0..{vocab_size - 1}")
    bias = head.bias.detach()[vocab_ids] if head.bias is not None else None
    return ReducedHead(head.weight.detach()[vocab_ids], vocab_ids, vocab_size, bias)


def build(target: nn.Module, shape: DraftShape, vocab_ids: torch.Tensor) -> nn.Module:
    """A fresh draft for ``target``: shared trunk, new layers copied from ``shape.init_from``,
    a copy of the final norm, and a zero-bias head over ``vocab_ids``."""
    check_shape(target, shape)
    inner, layers, norm, head = _parts(target)
    lm_head = reduced_head(head, vocab_ids)
    new_layers = []
    for j, src in enumerate(shape.init_from):
        layer = copy.deepcopy(layers[src])
        _set_layer_idx(layer, shape.num_shared + j)
        layer.requires_grad_(True)
        new_layers.append(layer)
    source = list(range(shape.num_shared)) + list(shape.init_from)
    cfg = _sub_config(target.config, source)
    draft_inner = _shallow(inner)
    draft_inner.layers = nn.ModuleList(list(layers)[: shape.num_shared] + new_layers)  # shared layers are the same objects
    draft_inner.norm = copy.deepcopy(norm).requires_grad_(True)
    draft_inner.config = cfg
    draft = _shallow(target)
    draft.model = draft_inner
    draft.config = cfg
    draft.lm_head = lm_head
    draft.ssd_shape = shape
    return draft.eval()


# --- the pieces training needs ---------------------------------------------------------------


def shared_params(target: nn.Module, num_shared: int) -> list[tuple[str, torch.Tensor]]:
    """The target tensors a draft with ``num_shared`` shared layers depends on (names are stable).
    ``num_shared`` -1: the whole target (a feature draft reads its final hidden states)."""
    inner, layers, norm, head = _parts(target)
    out = [(f"embed.{n}", p) for n, p in inner.embed_tokens.named_parameters()]
    for i in range(len(layers) if num_shared < 0 else num_shared):
        out += [(f"layers.{i}.{n}", p) for n, p in layers[i].named_parameters()]
    if num_shared < 0:
        out += [(f"norm.{n}", p) for n, p in norm.named_parameters()]
    if head.weight is not inner.embed_tokens.weight:
        out.append(("head.weight", head.weight))
    if head.bias is not None:
        out.append(("head.bias", head.bias))
    return out


def shared_hash(target: nn.Module, num_shared: int) -> str:
    """sha256 over the shared tensors rounded to bfloat16 (so fp32 and bf16 loads of the same
    checkpoint agree), with their names and shapes."""
    h = hashlib.sha256()
    cfg = target.config
    h.update(f"{getattr(cfg, 'model_type', '')}:{cfg.hidden_size}:{cfg.vocab_size}:{num_shared}".encode())
    for name, t in shared_params(target, num_shared):
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def tail(draft: nn.Module) -> nn.Module:
    """The draft's own layers + norm as a model that takes the shared trunk's output as
    ``inputs_embeds`` (used by training; no cache)."""
    shape: DraftShape = draft.ssd_shape
    inner = draft.model
    t = _shallow(inner)
    t.layers = nn.ModuleList(list(inner.layers)[shape.num_shared :])
    cfg = copy.deepcopy(inner.config)
    cfg.num_hidden_layers = len(t.layers)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) == shape.num_layers:
        cfg.layer_types = types[shape.num_shared :]
    t.config = cfg
    return t


def output_module(target: nn.Module, n: int) -> nn.Module:
    """The module whose output is the output of the target's first ``n`` layers (the embedding for 0);
    a forward hook on it records that hidden state (see :func:`hidden_of`)."""
    inner, layers, _, _ = _parts(target)
    return inner.embed_tokens if n == 0 else layers[n - 1]


def hidden_of(out: Any) -> torch.Tensor:
    """The hidden state in a module's output (decoder layers may return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def trunk_output(target: nn.Module, ids: torch.Tensor, num_shared: int, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over ``ids`` [B, T] once; return (output of layer num_shared-1 (the
    embedding when 0), the target's final normed hidden state), both [B, T, H]."""
    _, _, norm, _ = _parts(target)
    got: dict[str, torch.Tensor] = {}
    hooks = [
        output_module(target, num_shared).register_forward_hook(lambda m, a, o: got.__setitem__("trunk", hidden_of(o))),
        norm.register_forward_hook(lambda m, a, o: got.__setitem__("final", o)),
    ]
    try:
        with torch.no_grad():  # not inference_mode: training reuses these tensors
            target.model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    return got["trunk"], got["final"]


def is_feature_draft(model: Any) -> bool:
    """A feature draft (feature_draft.py) reads the target's hidden states besides its tokens."""
    return bool(getattr(model, "needs_features", False))


def own_state(layers: Any, norm: nn.Module, head: "ReducedHead") -> dict[str, torch.Tensor]:
    """The stored names of a draft's own layers, final norm and head bias."""
    out: dict[str, torch.Tensor] = {}
    for j, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            out[f"layers.{j}.{n}"] = p
    for n, p in norm.named_parameters():
        out[f"norm.{n}"] = p
    out["head.bias"] = head.bias
    return out


def trainable_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the draft folder stores (tail layers, norm, head bias; a feature draft adds its fc)."""
    if is_feature_draft(draft):
        return draft.trainable_state()
    return own_state(list(draft.model.layers)[draft.ssd_shape.num_shared :], draft.model.norm, draft.lm_head)


def trainable_parameters(draft: nn.Module) -> list[nn.Parameter]:
    return list(trainable_state(draft).values())


# --- folders ----------------------------------------------------------------------------------


def is_draft_dir(name: str | Path) -> bool:
    try:
        return (Path(name).expanduser() / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def save(draft: nn.Module, folder: Path, target_name: str, target: nn.Module, extra: dict[str, Any] | None = None,
         dtype: torch.dtype = torch.float16) -> Path:
    """Write the draft's own weights (matrices in ``dtype``, vectors in fp32) and its manifest."""
    from safetensors.torch import save_file

    shape: DraftShape = draft.ssd_shape
    kind = "features" if is_feature_draft(draft) else "layers"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    def stored(p: torch.Tensor) -> torch.dtype:  # matrices in `dtype`, vectors in at least fp32
        return dtype if p.dim() >= 2 else (torch.float64 if p.dtype == torch.float64 else torch.float32)

    tensors = {n: p.detach().to("cpu", stored(p)).contiguous() for n, p in trainable_state(draft).items()}
    tensors["vocab_ids"] = draft.lm_head.ids.detach().to("cpu", torch.int32).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    cfg = target.config
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "target": {
            "name": target_name,
            "model_type": getattr(cfg, "model_type", None),
            "hidden_size": cfg.hidden_size,
            "vocab_size": int(draft.lm_head.vocab_size),
            "num_hidden_layers": cfg.num_hidden_layers,
            "shared_hash": shared_hash(target, -1 if kind == "features" else shape.num_shared),
        },
        "num_shared": shape.num_shared,
        "init_from": list(shape.init_from),
        "num_vocab": int(draft.lm_head.ids.numel()),
        "kind": kind,
        **({"fuse_layer": draft.fuse_layer} if kind == "features" and draft.fuse_layer is not None else {}),
        **(extra or {}),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


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


def load(folder: str | Path, target: LoadedModel) -> LoadedModel:
    """Rebuild the draft in ``folder`` on top of ``target`` (refusing a target it was not trained for)."""
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
        from .errors import ParamError
        from .feature_draft import FeatureDraft

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
        name=str(manifest.get("name") or folder.name),
        spec=ModelSpec(str(folder), "derived", str(folder)),
        model=draft.eval(),
        tokenizer=target.tokenizer,
        placement=target.placement,
        folder=folder,
        eos_ids=target.eos_ids,
    )
