"""GGUF tensors -> :class:`quant.GGUFLinear` modules for a model transformers loaded from the file.

Names map through the gguf package's name table (as transformers' loader does) and rows through
transformers' tensor processor, so the row permutation transformers applies to llama q/k
projections is applied to the blocks too (:func:`_row_order`).  Sampled rows of every module
are checked against the weights the model holds, bit for bit.

Reading a GGUF's metadata and re-tiling its blocks takes seconds (GGUFReader parses every
field in Python); ``cache`` (the content-keyed converted folder) keeps the tiles in a
safetensors file, so later starts read them in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..cpu.quant import KEPT, SUPPORTED, GGUFLinear, QuantError
from . import gguf_header

CACHE_FILE = "gguf-tiles-v1.safetensors"  # the version names the tile layout of quant.pack


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if v.dtype == np.uint8 else v[0].item()


def _row_order(processor: Any, name: str, rows: int, mapping: dict[str, str]) -> np.ndarray | None:
    """The row order transformers gives this tensor (llama q/k: un-permuting the rotary halves),
    found by running its tensor processor on the row numbers; None when it keeps the order."""
    ids = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        out = processor.process(weights=ids, name=name, tensor_key_mapping=mapping,
                                parsed_parameters={"config": processor.config, "tensors": {}})
        order = np.asarray(out.weights).reshape(-1)
    except Exception as e:
        raise QuantError(f"transformers transforms GGUF tensor {name} in a way these modules cannot follow: {e}") from e
    if order.shape != (rows,) or not np.array_equal(np.sort(order), ids[:, 0]):
        raise QuantError(f"transformers transforms GGUF tensor {name} by more than a reordering of its rows")
    order = order.astype(np.int64)
    return None if np.array_equal(order, np.arange(rows)) else order


def gguf_linears(model: nn.Module, gguf_path: str | Path, *, keep_unsupported: bool = False,
                 check_rows: int = 4, cache: str | Path | None = None) -> dict[str, GGUFLinear]:
    """For ``model`` (loaded by transformers from ``gguf_path``, or from its dequantized copy):
    a :class:`GGUFLinear` for every ``nn.Linear`` whose weight is a Q4_0/Q4_1/Q8_0 tensor of the
    file, keyed by module name (a tied output head gets one built from the embedding's blocks).
    Linears stored as F32/F16/BF16 are left out (the model's own layer already computes in that
    precision).  Any other type raises :class:`QuantError`, or is left out with
    ``keep_unsupported``.  ``check_rows`` sampled rows of each module are compared bit for bit
    with the model's weight: a GGUF that is not the model's raises :class:`QuantError`.

    ``cache``: a folder that belongs to this GGUF's content (the converted safetensors folder):
    the tiles are read from it when present, written to it otherwise (skipped if read-only)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    path = Path(cache) / CACHE_FILE if cache is not None else None
    got = _read_cache(path, linears, keep_unsupported) if path is not None else None
    if got is None:
        got = _from_gguf(model, gguf_path, linears, keep_unsupported)
        if path is not None:
            _write_cache(path, got, keep_unsupported)
    for n, mod in got.items():
        _check(mod, linears[n].weight, n, check_rows)
    return got


def _from_gguf(model: nn.Module, gguf_path: str | Path, linears: dict[str, nn.Linear],
               keep_unsupported: bool) -> dict[str, GGUFLinear]:
    try:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    except ImportError as e:  # an incompatible transformers or gguf
        raise QuantError(f"cannot map GGUF tensors to the model: {e}") from e
    try:
        reader = gguf_header.reader(str(gguf_path))
    except Exception as e:
        raise QuantError(f"could not read GGUF file '{gguf_path}': {e}") from e
    cfg = getattr(model, "config", None)
    arch = _field(reader, "general.architecture") or getattr(cfg, "model_type", "")
    heads = {"num_attention_heads": getattr(cfg, "num_attention_heads", None),
             "num_key_value_heads": getattr(cfg, "num_key_value_heads", None)}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=heads)
    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise QuantError(f"GGUF architecture '{arch}' is unknown to the installed gguf package")
    # gguf's own name table (the one transformers' loader uses), built once: transformers'
    # get_gguf_hf_weights_map rebuilds it for every submodule (seconds for a 30-layer model)
    table = get_tensor_name_map(arch_id, int(_field(reader, f"{arch}.block_count") or getattr(cfg, "num_hidden_layers", 0)))
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[str, str] = {}
    for n in params:
        g = table.get_name(n, try_suffixes=(".weight", ".bias"))
        if g is not None:
            mapping.setdefault(g, n)
    by_ptr: dict[int, list[str]] = {}
    for n, m in linears.items():
        by_ptr.setdefault(m.weight.data_ptr(), []).append(n)
    out: dict[str, GGUFLinear] = {}
    bad: list[str] = []
    for t in reader.tensors:
        hf = mapping.get(t.name)
        if hf is None or hf not in params:
            continue
        names = by_ptr.get(params[hf].data_ptr(), [])  # the linear itself, or heads tied to an embedding
        kind = t.tensor_type.name
        if not names or kind in KEPT:
            continue
        if kind not in SUPPORTED:
            bad.append(f"{t.name} ({kind})")
            continue
        rows = int(t.shape[-1])  # gguf lists dims innermost first
        order = _row_order(processor, t.name, rows, mapping)
        raw = np.asarray(t.data).reshape(rows, -1)
        first = None
        for n in names:
            lin = linears[n]
            if first is None:
                first = GGUFLinear(raw, kind, lin.in_features, lin.bias, order, dense=lin.weight.detach())
                out[n] = first
            else:  # a second module on the same tensor shares the tiles
                out[n] = GGUFLinear.from_tiles(kind, first.tiles(), lin.in_features, lin.out_features, lin.bias, lin.weight.detach())
    if bad and not keep_unsupported:
        raise QuantError(f"GGUF quantization not supported for {', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''} "
                         f"(supported: {', '.join(SUPPORTED)})")
    return out


def _check(mod: GGUFLinear, weight: torch.Tensor, name: str, rows: int) -> None:
    if tuple(weight.shape) != (mod.out_features, mod.in_features):
        raise QuantError(f"{name}: the GGUF tensor is {mod.out_features}x{mod.in_features}, the model's {tuple(weight.shape)}")
    if rows <= 0:
        return
    n = min(rows, mod.out_features)
    pick = [round(i * (mod.out_features - 1) / max(n - 1, 1)) for i in range(n)]
    got = mod.dequantized(torch.tensor(pick))
    want = torch.stack([weight.detach()[i] for i in pick])  # row by row: cheaper than fancy indexing, per module
    if not torch.equal(got, want.to(device="cpu", dtype=torch.float32)):
        raise QuantError(f"{name}: the GGUF blocks do not decode to the model's weights (a different checkpoint?)")


# --- the tile cache -------------------------------------------------------------------------------


def _write_cache(path: Path, mods: dict[str, GGUFLinear], keep_unsupported: bool) -> None:
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    index: dict[str, list[Any]] = {}
    for n, mod in mods.items():
        index[n] = [mod.kind, mod.in_features, mod.out_features]
        for k, a in mod.tiles().items():
            tensors[f"{n}.{k}"] = np.ascontiguousarray(a if k == "q" else a.view(np.int16))
    meta = {"modules": json.dumps(index), "keep_unsupported": str(bool(keep_unsupported))}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:  # a read-only cache: parse the GGUF again next time
        pass


def _read_cache(path: Path, linears: dict[str, nn.Linear], keep_unsupported: bool) -> dict[str, GGUFLinear] | None:
    """The modules the cache holds, or None (absent, unreadable, or for other modules: rebuild)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("keep_unsupported") != str(bool(keep_unsupported)):
                return None
            index = json.loads(meta["modules"])
            names = set(f.keys())
            out = {}
            for n, (kind, in_f, out_f) in index.items():
                lin = linears.get(n)
                if lin is None or (lin.out_features, lin.in_features) != (out_f, in_f):
                    return None
                tiles = {k: f.get_tensor(f"{n}.{k}") for k in ("q", "d", "m") if f"{n}.{k}" in names}
                tiles = {k: (a if k == "q" else a.view(np.uint16)) for k, a in tiles.items()}
                out[n] = GGUFLinear.from_tiles(kind, tiles, in_f, out_f, lin.bias, lin.weight.detach())
    except (OSError, ValueError, KeyError, TypeError, QuantError, SafetensorError):
        return None
    return out
