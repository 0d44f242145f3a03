"""Linear layers computed from a GGUF checkpoint's own quantized blocks, on CPU.

A GGUF loaded through transformers is dequantized to float32: a decode step then streams
4 bytes per weight (about 540 MB per forward for SmolLM2-135M).  The modules here keep the
checkpoint's blocks instead and dequantize inside the matrix product, so a step reads
1.25 bytes per Q4 weight and 1.125 per Q8_0 weight.

Exactness.  GGUF's Q4_0, Q4_1 and Q8_0 blocks decode as ``w = d * q + m`` (Q4_0: ``q - 8``
and ``m = 0``; Q8_0: ``m = 0``) with ``d`` and ``m`` float16 and ``q`` at most 8 bits, so
``d * q`` is exact in float32 and each weight computed here is bit-identical to the one
transformers loads (``gguf.dequantize``).  The outputs differ from ``F.linear`` with those
weights only by the order of the float32 sums.  torch's own int4/int8 CPU products do not
offer that: its int4 product is vectorised for bfloat16 activations and scales only, and
its int8 product takes one scale per output row where Q8_0 has one per 32 weights.

Layout.  Outputs are grouped in tiles of ``TILE``; for each tile the quants are stored
``[in_features, TILE]`` (one signed byte each, 4-bit values unpacked: numba vectorises a
byte-to-float conversion but not a nibble split), the scales ``[in_features / 32, TILE]``.
The kernel walks a tile's weights once for all rows, which keeps a few-row product
memory-bound.  Beyond ``KERNEL_MAX_ROWS`` rows (a prompt) the weight is dequantized and
multiplied by ``F.linear``: compute-bound there, and MKL's GEMM is far better at it.

Mapping GGUF tensors to a model's modules uses the gguf package's name table (as transformers'
loader does) and transformers' tensor processor, so the row permutation transformers applies to llama q/k projections is applied
to the quant rows too (:func:`_row_order`); :func:`gguf_linears` checks sampled rows of
every module against the weights the model holds, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
from torch import nn

from .errors import ModelError

TILE = 64  # outputs per tile: four 16-float AVX-512 vectors, or eight AVX2 ones
BLOCK = 32  # weights per GGUF block for the types served here
KERNEL_MAX_ROWS = 16  # above this many rows, dequantize and use F.linear (a prompt)
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")
KEPT = ("F32", "F16", "BF16")  # already float in the model: its nn.Linear stays


class QuantError(ModelError):
    """A GGUF tensor cannot be served by these modules."""


# --- kernels --------------------------------------------------------------------------------------


@njit(fastmath=True, nogil=True, boundscheck=False, cache=True)
def _mm_dm(x, q, d, m, y):  # pragma: no cover - compiled
    # x [R, K] f32, q [NT, K, T] i8, d/m [NT, K/32, T] f32, y [R, NT*T] f32: y = x @ (d*q + m).T
    # Four inputs per pass over a row's accumulators: loading and storing them once per input
    # costs more than recomputing d * q + m for each row.  One thread: numba's parallel tiles
    # halved a matrix's time at two threads alone, but made whole decode steps inside
    # transformers' forward several times slower (measured), so that waits for the compact core.
    rows, n_in = x.shape
    n_tiles, _, tile = q.shape
    acc = np.empty((rows, tile), np.float32)
    for t in range(n_tiles):
        acc[:] = 0
        for k in range(0, n_in, 4):
            db = d[t, k >> 5]
            mb = m[t, k >> 5]
            q0, q1, q2, q3 = q[t, k], q[t, k + 1], q[t, k + 2], q[t, k + 3]
            for r in range(rows):
                x0, x1, x2, x3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                a = acc[r]
                for j in range(tile):  # d * q is exact: each weight is rounded once, as gguf's
                    a[j] += (x0 * (db[j] * np.float32(q0[j]) + mb[j]) + x1 * (db[j] * np.float32(q1[j]) + mb[j])
                             + x2 * (db[j] * np.float32(q2[j]) + mb[j]) + x3 * (db[j] * np.float32(q3[j]) + mb[j]))
        y[:, t * tile:(t + 1) * tile] = acc


@njit(fastmath=True, nogil=True, boundscheck=False, cache=True)
def _mm_d(x, q, d, y):  # pragma: no cover - compiled
    # as _mm_dm with m = 0 (Q4_0 stores q - 8, Q8_0 q): saves reading the zero offsets
    rows, n_in = x.shape
    n_tiles, _, tile = q.shape
    acc = np.empty((rows, tile), np.float32)
    for t in range(n_tiles):
        acc[:] = 0
        for k in range(0, n_in, 4):
            db = d[t, k >> 5]
            q0, q1, q2, q3 = q[t, k], q[t, k + 1], q[t, k + 2], q[t, k + 3]
            for r in range(rows):
                x0, x1, x2, x3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                a = acc[r]
                for j in range(tile):
                    a[j] += (x0 * (db[j] * np.float32(q0[j])) + x1 * (db[j] * np.float32(q1[j]))
                             + x2 * (db[j] * np.float32(q2[j])) + x3 * (db[j] * np.float32(q3[j])))
        y[:, t * tile:(t + 1) * tile] = acc


# --- decoding GGUF blocks -------------------------------------------------------------------------


def decode_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Split GGUF blocks ``raw`` (uint8 ``[rows, bytes]``) into quants (int8 ``[rows, in]``),
    scales and offsets (float32 ``[rows, in / 32]``; offsets None where zero).

    Block layouts (ggml): Q4_0 = fp16 d, 16 bytes of nibbles; Q4_1 = fp16 d, fp16 m, 16 bytes;
    in both, byte j holds weight j in its low nibble and weight j + 16 in its high one.
    Q8_0 = fp16 d, 32 int8."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}.get(kind)
    if head is None:
        raise QuantError(f"GGUF quantization {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    size = head + (BLOCK if kind == "Q8_0" else BLOCK // 2)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise QuantError(f"{kind} data of shape {raw.shape} is not whole {size}-byte blocks")
    rows, nb = raw.shape[0], raw.shape[1] // size
    blocks = raw.reshape(rows, nb, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    body = blocks[:, :, head:]
    if kind == "Q8_0":
        q = body.view(np.int8)
    else:
        q = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.int8)  # [rows, nb, 32]
        if kind == "Q4_0":
            q = q - np.int8(8)
    return np.ascontiguousarray(q.reshape(rows, nb * BLOCK)), d, m


def _tiles(a: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` -> ``[rows / TILE, cols, TILE]``, rows padded with zeros to whole tiles."""
    rows, cols = a.shape
    pad = (-rows) % TILE
    if pad:
        a = np.concatenate([a, np.zeros((pad, cols), a.dtype)])
    return np.ascontiguousarray(a.reshape(-1, TILE, cols).transpose(0, 2, 1))


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` kept as a GGUF block type (Q4_0, Q4_1, Q8_0).

    Inference only (no gradients).  Inputs of another float dtype are computed in float32 and
    cast back.  :meth:`dequantized` gives the float32 weight it computes with."""

    def __init__(self, raw: np.ndarray, kind: str, in_features: int, bias: torch.Tensor | None = None,
                 row_order: np.ndarray | None = None) -> None:
        super().__init__()
        q, d, m = decode_blocks(raw, kind)
        if q.shape[1] != in_features:
            raise QuantError(f"{kind} tensor has {q.shape[1]} inputs per row, the layer {in_features}")
        if row_order is not None:
            q, d, m = q[row_order], d[row_order], (m[row_order] if m is not None else None)
        self.kind, self.in_features, self.out_features = kind, in_features, q.shape[0]
        self.register_buffer("q", torch.from_numpy(_tiles(q)), persistent=False)
        self.register_buffer("d", torch.from_numpy(_tiles(d)), persistent=False)
        self.register_buffer("m", torch.from_numpy(_tiles(m)) if m is not None else None,
                             persistent=False)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, bias={self.bias is not None}"

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the quants and scales (and the offsets where present)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (or only ``rows`` of it), computed as the kernel does."""
        def rowwise(t: torch.Tensor) -> torch.Tensor:  # [tiles, cols, TILE] -> [out (or rows), cols]
            if rows is None:
                return t.permute(0, 2, 1).reshape(-1, t.shape[1])[: self.out_features]
            return t[rows // TILE, :, rows % TILE]

        w = rowwise(self.d).repeat_interleave(BLOCK, dim=1) * rowwise(self.q).float()
        if self.m is not None:
            w = w + rowwise(self.m).repeat_interleave(BLOCK, dim=1)
        return w

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        rows = x2.shape[0]
        if rows > KERNEL_MAX_ROWS or x2.device.type != "cpu":
            y = F.linear(x2, self.dequantized().to(x2.device))
        else:
            yp = torch.empty(rows, self.q.shape[0] * TILE, dtype=torch.float32)
            if self.m is not None:
                _mm_dm(x2.numpy(), self.q.numpy(), self.d.numpy(), self.m.numpy(), yp.numpy())
            else:
                _mm_d(x2.numpy(), self.q.numpy(), self.d.numpy(), yp.numpy())
            y = yp[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features).to(dtype)


# --- building modules for a loaded model ----------------------------------------------------------


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
                 check_rows: int = 4) -> dict[str, GGUFLinear]:
    """For ``model`` (loaded by transformers from ``gguf_path``, or from its dequantized copy):
    a :class:`GGUFLinear` for every ``nn.Linear`` whose weight is a Q4_0/Q4_1/Q8_0 tensor of the
    file, keyed by module name (a tied output head gets one built from the embedding's blocks).
    Linears stored as F32/F16/BF16 are left out (the model's own layer already computes in that
    precision).  Any other type raises :class:`QuantError`, or is left out with
    ``keep_unsupported``.  ``check_rows`` sampled rows of each module are compared bit for bit
    with the model's weight: a GGUF that is not the model's raises :class:`QuantError`."""
    try:
        from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    except ImportError as e:  # an incompatible transformers or gguf
        raise QuantError(f"cannot map GGUF tensors to the model: {e}") from e
    try:
        reader = GGUFReader(str(gguf_path))
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
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
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
        for n in names:
            lin = linears[n]
            mod = GGUFLinear(raw, kind, lin.in_features, lin.bias, order)
            _check(mod, lin.weight, n, check_rows)
            out[n] = mod
    if bad and not keep_unsupported:
        raise QuantError(f"GGUF quantization not supported for {', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''} "
                         f"(supported: {', '.join(SUPPORTED)})")
    return out


def _check(mod: GGUFLinear, weight: torch.Tensor, name: str, rows: int) -> None:
    if tuple(weight.shape) != (mod.out_features, mod.in_features):
        raise QuantError(f"{name}: the GGUF tensor is {mod.out_features}x{mod.in_features}, the model's {tuple(weight.shape)}")
    if rows <= 0:
        return
    pick = torch.linspace(0, mod.out_features - 1, min(rows, mod.out_features)).long()
    got = mod.dequantized(pick)
    if not torch.equal(got, weight.detach()[pick].to(device="cpu", dtype=torch.float32)):
        raise QuantError(f"{name}: the GGUF blocks do not decode to the model's weights (a different checkpoint?)")


def swap_modules(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each ``modules[name]`` in place of ``model``'s submodule ``name``; returns the modules
    it replaced, so ``swap_modules(model, returned)`` undoes it."""
    old: dict[str, nn.Module] = {}
    for name, new in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old[name] = getattr(parent, child)
        setattr(parent, child, new)
    return old
