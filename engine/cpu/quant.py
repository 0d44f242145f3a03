"""Linear layers computed from GGUF blocks (Q4_0, Q4_1, Q8_0) on CPU, in the checkpoint's precision.

A GGUF loaded through transformers is dequantized to float32: a decode step then streams 4 bytes
per weight (about 540 MB per forward for SmolLM2-135M).  :class:`GGUFLinear` keeps the file's blocks
(0.625 byte per Q4_1 weight, 1.06 per Q8_0 weight, about 97 MB per forward for that model) and
dequantizes inside the product (:mod:`qkernels`, which also states why the result is exact and
row- and thread-independent).  Each weight ``w = d * q + m`` is bit-identical to the one
transformers loads (``gguf.dequantize``); outputs differ from ``F.linear`` only by the order of the
float32 sums.  Beyond ``KERNEL_MAX_ROWS`` rows (a prompt) the product is ``F.linear`` on the
dequantized weight, since MKL's GEMM is far better at compute-bound products.

:func:`quantize` makes Q8_0 blocks from a float weight (gguf's own quantizer), for drafts: a draft
need not reproduce anything, and SD/SSD stay exact because the target verifies.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from . import qkernels

TILE, BLOCK = qkernels.TILE, qkernels.BLOCK
# Q4 blocks in a compiled CPU target go through torch's int4 GEMM with bfloat16 activations
# (_int4pack; AVX2 or better): a verify of 3 rows costs little more than one row, and the compiled
# graph keeps rows invariant (use_int4).  Eager forwards (a prompt, a draft sharing these modules)
# keep the float32 kernels: with SDPA and bfloat16 outputs greedy SD drifts from AR
# (docs/performance-cpu.md).  SSD_CHAT_CPU_KERNELS=numba: never int4; =int4: eager forwards too.
_KERNELS = os.environ.get("SSD_CHAT_CPU_KERNELS", "").strip().lower()
INT4 = [_KERNELS != "numba" and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX"))]
EAGER_INT4 = [_KERNELS == "int4"]
KERNEL_MAX_ROWS = 16  # above this many rows, dequantize and use F.linear (a prompt)
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")
KEPT = ("F32", "F16", "BF16")  # already float in the model: its nn.Linear stays
_HEAD = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # bytes before the quants in a block


class QuantError(ModelError):
    """A GGUF tensor cannot be served by these modules."""


# --- GGUF blocks <-> per-row arrays <-> kernel tiles ----------------------------------------------


def split_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks ``raw`` (uint8 ``[rows, bytes]``) -> (quants ``[rows, in]``: uint8 0..15 for Q4,
    int8 for Q8_0; scales and offsets as float16 bits, uint16 ``[rows, in / 32]``; offsets None for
    Q8_0).  Q4_0 gets the offset ``-8 d`` (exact in float16), so it decodes as Q4_1 does.

    Block layouts (ggml): Q4_0 = fp16 d, 16 bytes of nibbles; Q4_1 = fp16 d, fp16 m, 16 bytes;
    in both, byte j holds weight j in its low nibble and weight j + 16 in its high one.
    Q8_0 = fp16 d, 32 int8."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    head = _HEAD.get(kind)
    if head is None:
        raise QuantError(f"GGUF quantization {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    size = head + (BLOCK if kind == "Q8_0" else BLOCK // 2)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise QuantError(f"{kind} data of shape {raw.shape} is not whole {size}-byte blocks")
    rows, nb = raw.shape[0], raw.shape[1] // size
    blocks = raw.reshape(rows, nb, size)
    d = blocks[:, :, 0:2].copy().view(np.uint16)[..., 0]
    body = blocks[:, :, head:]
    if kind == "Q8_0":
        return np.ascontiguousarray(body.view(np.int8).reshape(rows, nb * BLOCK)), d, None
    q = np.concatenate([body & 0x0F, body >> 4], axis=-1).reshape(rows, nb * BLOCK)
    if kind == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.uint16)[..., 0]
    else:
        with np.errstate(over="ignore"):
            m16 = (d.view(np.float16) * np.float16(-8)).astype(np.float16)
        if not np.isfinite(m16).all():
            raise QuantError("a Q4_0 scale is too large to serve (|d| >= 8192)")
        m = m16.view(np.uint16)
    return np.ascontiguousarray(q), d, m


def _f32(h: np.ndarray) -> np.ndarray:
    return h.view(np.float16).astype(np.float32)


def pack(q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per-row arrays (as :func:`split_blocks` gives them) -> the kernels' tiles: ``q`` (Q4: uint8
    ``[tiles, blocks, 32, 32]`` of nibble pairs; Q8_0: int8 ``[tiles, blocks, 32, 64]``), ``d`` and
    ``m`` (uint16 ``[tiles, blocks, 64]``).  Rows are padded with zeros to whole tiles."""
    rows, cols = q.shape
    pad = (-rows) % TILE
    nt, nb = (rows + pad) // TILE, cols // BLOCK

    def tiles(a: np.ndarray) -> np.ndarray:  # [rows, ...] -> padded
        return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a

    def scales(s: np.ndarray) -> np.ndarray:  # [rows, blocks] -> [tiles, blocks, 64]
        return np.ascontiguousarray(tiles(s).reshape(nt, TILE, nb).transpose(0, 2, 1))

    qt = tiles(q).reshape(nt, TILE, nb, BLOCK).transpose(0, 2, 3, 1)  # [tiles, blocks, 32 inputs, 64 outputs]
    if m is None:
        return {"q": np.ascontiguousarray(qt), "d": scales(d)}
    qp = (qt[..., :32] | (qt[..., 32:] << 4)).astype(np.uint8)
    return {"q": np.ascontiguousarray(qp), "d": scales(d), "m": scales(m)}


def unpack(tiles: dict[str, np.ndarray], rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The inverse of :func:`pack` (``rows``: the unpadded row count)."""
    q, d, m = tiles["q"], tiles["d"], tiles.get("m")
    nt, nb = q.shape[0], q.shape[1]

    def scales(s: np.ndarray) -> np.ndarray:
        return s.transpose(0, 2, 1).reshape(nt * TILE, nb)[:rows]

    if m is None:
        return q.transpose(0, 3, 1, 2).reshape(nt * TILE, nb * BLOCK)[:rows], scales(d), None
    full = np.concatenate([q & 0x0F, q >> 4], axis=-1)  # [tiles, blocks, 32, 64]
    return full.transpose(0, 3, 1, 2).reshape(nt * TILE, nb * BLOCK)[:rows], scales(d), scales(m)


# --- the module ----------------------------------------------------------------------------------


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` kept as GGUF blocks (Q4_0, Q4_1, Q8_0).

    Inference only.  Inputs of another float dtype are computed in float32 and cast back.  Up to
    ``KERNEL_MAX_ROWS`` rows use the kernels, on ``torch.get_num_threads()`` threads (tiles split
    between them; the same result at any count).  ``dense``: the float32 weight these blocks
    decode to, if the caller holds it already (used for prompts instead of dequantizing)."""

    def __init__(self, raw: np.ndarray, kind: str, in_features: int, bias: torch.Tensor | None = None,
                 row_order: np.ndarray | None = None, dense: torch.Tensor | None = None) -> None:
        q, d, m = split_blocks(raw, kind)
        if q.shape[1] != in_features:
            raise QuantError(f"{kind} tensor has {q.shape[1]} inputs per row, the layer {in_features}")
        if row_order is not None:
            q, d, m = q[row_order], d[row_order], (m[row_order] if m is not None else None)
        self._setup(kind, pack(q, d, m), in_features, q.shape[0], bias, dense)

    @classmethod
    def from_tiles(cls, kind: str, tiles: dict[str, np.ndarray | torch.Tensor], in_features: int, out_features: int,
                   bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> "GGUFLinear":
        """A module over tiles as :func:`pack` makes them (read back from a cache, or selected rows)."""
        mod = cls.__new__(cls)
        arrays = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in tiles.items()}
        mod._setup(kind, arrays, in_features, out_features, bias, dense)
        return mod

    def _setup(self, kind: str, tiles: dict[str, np.ndarray], in_features: int, out_features: int,
               bias: torch.Tensor | None, dense: torch.Tensor | None) -> None:
        super().__init__()
        if kind not in SUPPORTED:
            raise QuantError(f"GGUF quantization {kind} is not supported (supported: {', '.join(SUPPORTED)})")
        q = tiles["q"]
        want = (BLOCK, TILE) if kind == "Q8_0" else (BLOCK, TILE // 2)
        if q.ndim != 4 or q.shape[2:] != want or q.shape[1] * BLOCK != in_features or q.shape[0] * TILE < out_features \
                or (kind == "Q8_0") != ("m" not in tiles):
            raise QuantError(f"{kind} tiles of shape {q.shape} do not fit a {out_features}x{in_features} layer")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        # int16 tensors hold the float16 bits (torch's uint16 is a storage-only dtype); the kernels read them as uint16
        tiles = {k: np.ascontiguousarray(v) if k == "q" else np.ascontiguousarray(v).view(np.uint16) for k, v in tiles.items()}
        for name in ("q", "d", "m"):
            a = tiles.get(name)
            t = None if a is None else torch.from_numpy(a if name == "q" else a.view(np.int16))
            self.register_buffer(name, t, persistent=False)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self._arrays = (tiles["q"], tiles["d"], tiles.get("m"))  # numpy views of the buffers, for the eager kernels
        self.dense = dense  # not a parameter: the caller's tensor, never copied
        self.int4 = _int4pack(kind, tiles, out_features) if kind != "Q8_0" and INT4[0] and EAGER_INT4[0] else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, bias={self.bias is not None}"

    def tiles(self) -> dict[str, np.ndarray]:
        """The kernel arrays (numpy views; d and m as uint16)."""
        out = {"q": self.q.numpy(), "d": self.d.numpy().view(np.uint16)}
        if self.m is not None:
            out["m"] = self.m.numpy().view(np.uint16)
        return out

    @property
    def block_weights(self) -> int:
        """How many weights the blocks hold (a model's parameter count includes them)."""
        return self.in_features * self.out_features

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: quants, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (or only ``rows`` of it), computed as the kernels do."""
        if rows is None:
            q, d, m = unpack(self.tiles(), self.out_features)
        else:  # only the tiles that hold these rows (a start checks a few rows of every module)
            idx = rows.cpu().numpy().astype(np.int64)
            tix, inv = np.unique(idx // TILE, return_inverse=True)
            q, d, m = unpack({k: v[tix] for k, v in self.tiles().items()}, len(tix) * TILE)
            sel = inv.reshape(-1) * TILE + idx % TILE
            q, d, m = q[sel], d[sel], (m[sel] if m is not None else None)
        w = np.repeat(_f32(d), BLOCK, axis=1) * q.astype(np.float32)
        if m is not None:
            w = w + np.repeat(_f32(m), BLOCK, axis=1)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    def select_rows(self, ids: torch.Tensor | np.ndarray) -> "GGUFLinear":
        """A module over output rows ``ids`` of this one (same blocks: a reduced draft head)."""
        idx = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
        q, d, m = unpack(self.tiles(), self.out_features)
        bias = self.bias.detach()[torch.from_numpy(idx)] if self.bias is not None else None
        return GGUFLinear.from_tiles(self.kind, pack(q[idx], d[idx], None if m is None else m[idx]), self.in_features,
                                     len(idx), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.detach().reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows > KERNEL_MAX_ROWS or x2.device.type != "cpu" or rows == 0:
            w = self.dense if self.dense is not None else self.dequantized()
            y = F.linear(x2.float(), w.to(x2.device))
        elif self.int4 is not None and INT4[0] and (EAGER_INT4[0] or torch.compiler.is_compiling()):
            packed, sz = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), packed, BLOCK, sz).float()
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features]
        elif torch.compiler.is_compiling():
            y = torch.ops.ssd_chat.gguf_mm(x2.float().contiguous(), self.q, self.d, self.d if self.m is None else self.m,
                                           self.out_features)
        else:
            y = torch.from_numpy(_product(x2.float().contiguous().numpy(), self._arrays, self.out_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features).to(dtype)


def _int4pack(kind: str, tiles: dict[str, np.ndarray], out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4 blocks -> torch's int4 CPU GEMM operands: the nibbles packed, and per 32-block (scale, zero)
    in bfloat16 [in / 32, out, 2], ``w = (q - 8) * d + (m + 8 d) = d q + m``; rows padded to 16."""
    q, d, m = unpack(tiles, out_features)
    pad = (-out_features) % 16
    d32, m32 = _f32(d), _f32(m)
    q32 = torch.from_numpy(np.ascontiguousarray(q, dtype=np.int32))
    sz = torch.from_numpy(np.stack([d32, m32 + 8 * d32], axis=-1))  # [out, blocks, 2]
    if pad:
        q32 = torch.cat([q32, q32.new_zeros(pad, q32.shape[1])])
        sz = torch.cat([sz, sz.new_zeros(pad, *sz.shape[1:])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
    return packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def use_int4(model: nn.Module) -> bool:
    """Give every Q4 GGUF linear of ``model`` its int4 GEMM operands (once): what a compiled CPU target
    runs.  False where none can (no Q4 blocks, no AVX2, SSD_CHAT_CPU_KERNELS=numba)."""
    mods = _q4_modules(model) if INT4[0] else []
    for m in mods:
        if m.int4 is None:
            m.int4 = _int4pack(m.kind, m.tiles(), m.out_features)
    return bool(mods)


def int4_ready(model: nn.Module) -> bool:
    """Whether :func:`use_int4` would give ``model`` int4 products (no packing)."""
    return INT4[0] and bool(_q4_modules(model))


def _q4_modules(model: nn.Module) -> list["GGUFLinear"]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear) and m.kind != "Q8_0"]


PARALLEL_MIN_OUT = 4096  # output features from which a product runs on torch's thread count
_threads = [1]  # numba's thread count last set (setting it costs a call into the threading layer)


def _product(x: np.ndarray, arrays: tuple[np.ndarray, ...], out_features: int) -> np.ndarray:
    """The kernel call for float32 C-contiguous ``x`` on as many threads as torch uses.  ``arrays``:
    (q, d, m) as the kernels take them (m None for Q8_0).  Numpy throughout: a torch.Tensor.numpy()
    costs about as much as the product of a small matrix."""
    q, d, m = arrays
    y = np.empty((x.shape[0], q.shape[0] * TILE), np.float32)
    # threads pay only for a large matrix (an output head): waking a second thread costs more than a
    # layer's product (a 576 x 1536 one takes about 0.05 ms)
    threads = torch.get_num_threads() if q.shape[0] * TILE >= PARALLEL_MIN_OUT else 1
    if threads > 1:
        import numba

        threads = min(threads, numba.config.NUMBA_NUM_THREADS, q.shape[0])
        if threads != _threads[0]:
            numba.set_num_threads(threads)
            _threads[0] = threads
    if m is None:
        (qkernels.q8_parallel if threads > 1 else qkernels.q8_serial)(x, q, d, y)
    else:
        (qkernels.q4_parallel if threads > 1 else qkernels.q4_serial)(x, q, d, m, y)
    return y if y.shape[1] == out_features else y[:, :out_features]


@torch.library.custom_op("ssd_chat::gguf_mm", mutates_args=())
def _gguf_mm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out_features: int) -> torch.Tensor:
    """The kernels as an opaque op, so a compiled graph calls them (``m`` is ``d`` for Q8_0)."""
    arrays = (q.numpy(), d.numpy().view(np.uint16), None if q.dtype == torch.int8 else m.numpy().view(np.uint16))
    return torch.from_numpy(np.ascontiguousarray(_product(x.numpy(), arrays, out_features)))


@_gguf_mm.register_fake
def _(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "Q8_0") -> GGUFLinear:
    """A :class:`GGUFLinear` of ``weight`` ``[out, in]`` quantized to ``kind`` blocks by gguf's own
    quantizer (llama.cpp's rounding).  For drafts: it changes the weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    out_f, in_f = weight.shape
    if in_f % BLOCK:
        raise QuantError(f"cannot quantize a layer with {in_f} inputs to {kind} (needs a multiple of {BLOCK})")
    try:
        raw = gguf_quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[kind])
    except (KeyError, NotImplementedError) as e:
        raise QuantError(f"cannot quantize to {kind}: {e}") from e
    return GGUFLinear(np.asarray(raw).reshape(out_f, -1), kind, in_f, bias)


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
