"""A compact, static-shape forward for Llama-family models: the core AR, SD and SSD run on.

Why: a transformers module call per forward is a dozen small kernels per layer, each launched from
Python, on a ``DynamicCache`` that grows by concatenation.  Like gpt-fast and nano-vllm, the core is
a plain loop over the layers that transformers already built (no second loader, no weight copies)
over a preallocated cache (:mod:`cache`), with explicit positions, slots and masks, so each row
shape (1, k+1, B, ...) can be compiled once (:mod:`compile`).

One call, ``step(ids [T], positions [T], slots [T], mask [T, W])``, writes the T rows' K/V at
``slots``, then every row attends to the slots its mask row allows: a prefill, a step, a verify of
k+1 tokens and an SSD tree depth are all single calls.

Every projection is *called*, never read as a raw weight (a fastlinear, int8, reduced-head or
tensor-parallel module, or what a ``linear`` hook maps it to), so a draft made of the target's first
N layers shares the target's weights through its core too.  The one exception is a compiled graph,
which calls a plain ``nn.Linear``'s weight through the product fastlinear chose (:func:`traceable`).

Supported: ``llama`` (Llama 2/3.x, SmolLM2 with its tied head), ``qwen2`` (qkv biases), ``qwen3``
(q/k norms), ``mistral`` without a sliding window; RoPE ``default``, ``linear``, ``llama3`` and
``yarn``.  :func:`supports` says why anything else is not, and callers keep transformers for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import numba_attention
from ..errors import ModelError
from .cache import StaticKV
from .compile import Compiler

ROW_MAX = 16  # row_attention: eager CPU forwards of up to this many rows (decode steps, verifies)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init (no length-dependent rescaling)
Linear = Callable[[torch.Tensor], torch.Tensor]


def supports(model: nn.Module) -> tuple[bool, str]:
    """(True, "") if the core can run ``model``; else (False, why) in words for a notice."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if getattr(model, "needs_features", False):
        return False, "a feature draft reads the target's hidden states; the core runs plain decoders"
    if kind not in ARCHS:
        return False, f"architecture '{kind or type(model).__name__}' is not one the core runs ({', '.join(ARCHS)})"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        return False, f"'{type(model).__name__}' lacks the Llama layout (model.embed_tokens/layers/norm/rotary_emb)"
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if att is None or mlp is None or not all(hasattr(att, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")) \
                or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return False, f"a layer of '{type(model).__name__}' is not a Llama-style attention + gated MLP"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False, f"activation '{cfg.hidden_act}' (the core has SiLU)"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope not in ROPE_TYPES:
        return False, f"RoPE type '{rope}' rescales with the length (the core has {', '.join(ROPE_TYPES)})"
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    ctx = getattr(cfg, "max_position_embeddings", None)
    if any(t != "full_attention" for t in types) or (kind == "mistral" and window is not None and (not ctx or window < ctx)):
        return False, "sliding-window attention"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False, "rescaled logits"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return False, "the model is split over several devices"
    return True, ""


@dataclass
class CoreOutput:
    logits: torch.Tensor | None  # [rows asked for, V]
    hidden: torch.Tensor | None = None  # [T, H]: the final normed hidden state (what the head reads)
    mid: torch.Tensor | None = None  # [T, H]: the output of the first ``mid_layer`` layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, the same operations in the same order (fp32 statistics)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention written out for inductor (CPU graphs): ``q`` [T, Hq, D], ``k``/``v`` [Hkv, W, D],
    ``mask`` bool [T, W] -> [T, Hq, D].  Every sum runs over a fixed axis (D, or the window W with
    masked slots adding exact zeros), so a row's result does not depend on the other rows: a verify
    of k + 1 rows computes the very numbers of k + 1 one-row steps (the window is padded alike by
    the compiler).  SDPA's blocked kernels do not have that property."""
    T, hq, d = q.shape
    hkv, W = k.shape[0], k.shape[1]
    qh = q.reshape(T, hkv, hq // hkv, d).permute(1, 0, 2, 3)  # [Hkv, T, G, D]
    s = (qh[:, :, :, None, :] * k[:, None, None, :, :]).sum(-1) * scale  # [Hkv, T, G, W]
    s = s.masked_fill(~mask[None, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = (p[..., None] * v[:, None, None, :, :]).sum(-2)  # [Hkv, T, G, D]
    return o.permute(1, 0, 2, 3).reshape(T, hq, d)


def attend_op(head_dim: int, dtype: torch.dtype) -> Callable | None:
    """With ``SSD_CHAT_ATTENTION=numba``, the numba attention (:mod:`cpu.attend`: the same row invariance
    as :func:`attend_rows`) where it applies (float32, a head of a multiple of 8).  On one thread it
    costs a fraction of inductor's on a long chat; on two it computes on one, and lost to inductor's
    (docs/performance-cpu.md), so it is not the default: every graph must attend alike, or greedy SD
    and SSD could part from AR."""
    if not numba_attention() or dtype != torch.float32:
        return None
    from ..cpu import attend  # numba, imported only when asked for

    return attend.op() if attend.supported(head_dim) else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _norm(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Llama/Qwen RMSNorm as a function of its (shared) weight; anything else is called."""
    if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor):
        eps = float(m.variance_epsilon)
        return lambda x: rms_norm(x, m.weight, eps)
    return m


def traceable(m: nn.Module, rows: int) -> Linear:
    """The default projection inside a compiled graph of ``rows`` rows.  A plain Linear is called as
    ``F.linear`` on its own weight, or on CPU with fastlinear installed, as the product fastlinear timed
    fastest for that row count (its numba kernels as an opaque custom op); anything else is called as it is."""
    wrapped = getattr(m, "graph_call", None)
    if wrapped is not None:  # a wrapper around a projection (a tensor-parallel shard) says how a graph calls it
        return wrapped(rows)
    from ..cpu.fastlinear import FastLinear

    if isinstance(m, FastLinear) and m.weight.device.type == "cpu":
        return m.path.traceable(m, rows)
    if type(m) is not nn.Linear and type(m) is not FastLinear:
        return m
    return lambda x: F.linear(x, m.weight, m.bias)


@dataclass
class _Layer:
    ln1: Callable
    ln2: Callable
    qn: Callable | None
    kn: Callable | None
    mods: dict[str, nn.Module]  # q k v o gate up down: the model's own projection modules
    proj: dict[str, Linear]  # the same, as eager forwards call them
    scaling: float


def _span(x: list[int] | torch.Tensor) -> tuple[int, int]:
    """(min, max) of ids, positions or slots; from a list without touching a device."""
    if isinstance(x, torch.Tensor):
        return int(x.min()), int(x.max())
    return min(x), max(x)


class Core:
    """The compact forward over ``model``'s own modules, with its own :class:`StaticKV`.

    ``mid_layer`` n: forwards asked for ``hidden`` also return the output of the first n layers
    (0: the embedding), what a fused feature draft reads.  ``lookahead``: slots allowed past the
    model's context for scratch rows.  ``linear(module) -> callable``: how to call a projection
    (default: the module itself); ``compile``: ``off`` | ``on`` | ``auto`` (see model/compile.py).
    ``notify(text)`` gets one line when compiling fails and the core runs uncompiled;
    ``progress(text)`` gets "compiling <name> for <T> rows (once)" before each first compile.
    ``row_attention``: CPU forwards of up to ROW_MAX rows attend with :func:`attend_rows` over a
    padded window, where a row's result does not depend on the other rows: with row-independent
    projections (GGUF linears) a verify of k + 1 rows equals k + 1 one-row steps bit for bit.
    Compiled CPU graphs always attend that way; eager, it costs more than SDPA.
    """

    def __init__(self, model: nn.Module, name: str = "model", compile: str = "off", rows: tuple[int, ...] = (),
                 mid_layer: int | None = None, lookahead: int = 0, linear: Callable[[nn.Module], Linear] | None = None,
                 notify: Callable[[str], None] | None = None, progress: Callable[[str], None] | None = None,
                 row_attention: bool = False) -> None:
        ok, why = supports(model)
        if not ok:
            raise ModelError(f"'{name}' cannot run on the compact core: {why}")
        cfg, inner = model.config, model.model
        self.model, self.name = model, name
        self.embed = inner.embed_tokens
        self.final_norm = _norm(inner.norm)
        self.head = model.get_output_embeddings()
        self.rotary = inner.rotary_emb
        self.linear = linear
        call = linear or (lambda m: m)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            mods = {"q": att.q_proj, "k": att.k_proj, "v": att.v_proj, "o": att.o_proj,
                    "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
            qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
            self.layers.append(_Layer(_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm),
                                      None if qn is None else _norm(qn), None if kn is None else _norm(kn),
                                      mods, {n: call(m) for n, m in mods.items()}, float(att.scaling)))
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.mid_layer = mid_layer
        self.row_attention = row_attention
        if mid_layer is not None and not 0 <= mid_layer < len(self.layers):
            raise ValueError(f"mid_layer must be in [0, {len(self.layers)}), got {mid_layer}")
        w = self.embed.weight
        self.device, self.dtype = w.device, w.dtype
        ctx = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.max_positions = ctx or None
        self.kv = StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, name,
                           limit=ctx + lookahead if ctx else None)
        self.compiler = Compiler(self, compile, tuple(rows), notify, progress)
        self.latency: Callable[[int], Any] | None = None  # a context per forward of n rows (:func:`simulate.latency`)

    # -- the public calls ------------------------------------------------------------------------
    @torch.inference_mode()
    def append(self, ids: list[int] | torch.Tensor, logits: str = "all", hidden: bool = False) -> CoreOutput:
        """Feed ``ids`` after the committed slots (causal) and commit them.  ``logits``: ``all``,
        ``last`` or ``none``."""
        ids_t = self._ids(ids)
        start, n = self.kv.length, int(ids_t.numel())
        self._check(n, logits)
        self._check_positions(start + n - 1)
        self.kv.reserve(start + n)
        slots = torch.arange(start, start + n, device=self.device)
        mask = self.kv.causal_mask(start, n, start + n)
        out = self._forward(ids_t, slots, slots, mask, logits, hidden)
        self.kv.length = start + n
        return out

    @torch.inference_mode()
    def step(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int] | torch.Tensor,
             mask: torch.Tensor, logits: str = "all", hidden: bool = False) -> CoreOutput:
        """Rows ``ids`` at RoPE ``positions``, K/V written to ``slots``, row r attending to the slots
        where ``mask[r]`` (bool [T, W]) is True.  The committed length is not changed."""
        (pos_lo, pos_hi), (sl_lo, sl_hi) = _span(positions), _span(slots)  # before a GPU copy: no sync
        ids_t, pos, sl = self._ids(ids), self._ids(positions), self._ids(slots)
        if not ids_t.numel() == pos.numel() == sl.numel() == mask.shape[0]:
            raise ValueError(f"step: {ids_t.numel()} ids, {pos.numel()} positions, {sl.numel()} slots, {mask.shape[0]} mask rows")
        self._check(int(ids_t.numel()), logits)
        if sl_lo < 0 or pos_lo < 0:
            raise ValueError("step: slots and positions must be >= 0")
        self._check_positions(pos_hi)
        self.kv.reserve(max(sl_hi + 1, mask.shape[1]))
        return self._forward(ids_t, pos, sl, mask.to(self.device, torch.bool), logits, hidden)

    def tree(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int] | torch.Tensor,
             ancestors: list[list[int]] | torch.Tensor, prefix: int | None = None, logits: str = "all",
             hidden: bool = False) -> CoreOutput:
        """A :meth:`step` whose row r sees slots [0, prefix) (default: the committed length), the
        slots in ``ancestors[r]`` and its own slot: one depth of an SSD tree, or a whole tree."""
        sl_hi = _span(slots)[1]
        sl = self._ids(slots)
        anc_max = max((max(a) for a in ancestors if a), default=-1) if isinstance(ancestors, list) else ancestors.shape[1] - 1
        width = max(sl_hi, anc_max, (self.kv.length if prefix is None else prefix) - 1) + 1
        mask = self.kv.tree_mask(sl, ancestors, self.kv.length if prefix is None else prefix, width)
        return self.step(ids, positions, slots, mask, logits, hidden)

    def reset(self) -> None:
        """Forget the sequence (a new chat): length 0, the buffer is kept."""
        self.kv.length = 0

    def warm(self) -> None:
        """Compile (or time, under ``auto``) every row shape now instead of at its first use."""
        self.compiler.warm()

    # -- internals ---------------------------------------------------------------------------------
    def _ids(self, x: list[int] | torch.Tensor) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)
        return t.reshape(-1).to(self.device, torch.long)

    @staticmethod
    def _check(n: int, logits: str) -> None:
        if n == 0:
            raise ValueError("a forward needs at least one token")
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be all, last or none, got '{logits}'")

    def _check_positions(self, last: int) -> None:
        if self.max_positions is not None and last >= self.max_positions:
            raise ValueError(f"'{self.name}': position {last} is past its context of {self.max_positions} tokens")

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, logits: str,
                 hidden: bool) -> CoreOutput:
        if self.latency is None:
            return self._compute(ids, pos, slots, mask, logits, hidden)
        with self.latency(int(ids.shape[0])):  # simulated hardware (:mod:`simulate`): compute, then sleep
            return self._compute(ids, pos, slots, mask, logits, hidden)

    def _compute(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, logits: str,
                 hidden: bool) -> CoreOutput:
        # compiled graphs serve decode-time forwards (every row's logits, or one row's: a draft step);
        # a prefill (last/none) runs eagerly, so a prompt is computed one way whatever row shapes a
        # decoder compiled
        decode = logits == "all" or (logits == "last" and ids.shape[0] == 1)
        got = self.compiler.run(ids, pos, slots, mask) if decode else None
        if got is not None:  # compiled: logits of every row
            lg, h, mid = got
            lg = None if logits == "none" else lg[-1:] if logits == "last" else lg
        else:
            if self.row_attention and self.device.type == "cpu" and ids.shape[0] <= ROW_MAX:
                mask = self.compiler.pad_width(mask)  # the window a compiled graph would see
            h, mid = self.trunk(self.kv.k, self.kv.v, ids, pos, slots, mask, [L.proj for L in self.layers])
            rows = None if logits == "none" else h[-1:] if logits == "last" else h
            lg = None if rows is None else self.head(rows)
        return CoreOutput(lg, h if hidden else None, mid if hidden else None)

    def graph_for(self, rows: int) -> Callable:
        """What the compiled graph for ``rows`` rows runs: the trunk and the head over every row, with
        the projections as :func:`traceable` (or the ``linear`` hook) gives them for that row count."""
        pick = self.linear or (lambda m: traceable(m, rows))
        projs = [{n: pick(m) for n, m in L.mods.items()} for L in self.layers]
        head = pick(self.head)

        def graph(ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            h, mid = self.trunk(ks, vs, ids, pos, slots, mask, projs)
            return head(h), h, mid

        return graph

    def trunk(self, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor, projs: list[dict[str, Linear]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding, layers and final norm for rows ``ids`` [T]; writes their K/V into ``ks``/``vs`` at
        ``slots``.  Returns (final normed hidden [T, H], the ``mid_layer`` output or None)."""
        T, W = ids.shape[0], mask.shape[-1]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        groups = hq // hkv
        x = self.embed(ids)  # [T, H]
        cos, sin = self._rope(pos, x.dtype)  # [T, 1, D]
        # query head h reads KV head h // groups: fold the groups into rows instead of copying K/V
        fmask = mask[None].expand(groups, T, W).reshape(1, 1, groups * T, W)  # 4D: what every SDPA backend takes
        mid = x if self.mid_layer == 0 else None
        rowwise = self.row_attention
        fast = attend_op(d, x.dtype) if x.device.type == "cpu" else None
        for i, L in enumerate(self.layers):
            p = projs[i]
            a = L.ln1(x)
            q = p["q"](a).reshape(T, hq, d)
            k = p["k"](a).reshape(T, hkv, d)
            v = p["v"](a).reshape(T, hkv, d)
            if L.qn is not None:
                q, k = L.qn(q), L.kn(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = ks[i], vs[i]  # [hkv, C+1, D]
            kc[:, slots] = k.transpose(0, 1)
            vc[:, slots] = v.transpose(0, 1)
            if x.device.type == "cpu" and (torch.compiler.is_compiling() or (rowwise and T <= ROW_MAX)):
                if fast is not None:  # reads the cache up to the mask's width
                    o = fast(q, kc, vc, mask, L.scaling).reshape(T, hq * d)
                else:
                    o = attend_rows(q, kc[:, :W], vc[:, :W], mask, L.scaling).reshape(T, hq * d)
            else:
                qf = q.transpose(0, 1).reshape(1, hkv, groups * T, d)
                o = F.scaled_dot_product_attention(qf, kc[None, :, :W], vc[None, :, :W], attn_mask=fmask, scale=L.scaling)
                o = o.reshape(hq, T, d).transpose(0, 1).reshape(T, hq * d)
            x = x + p["o"](o)
            m = L.ln2(x)
            x = x + p["down"](F.silu(p["gate"](m)) * p["up"](m))
            if self.mid_layer == i + 1:
                mid = x
        return self.final_norm(x), mid

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] as transformers' rotary embedding computes them (fp32, then the dtype)."""
        freqs = pos[:, None].float() * self.rotary.inv_freq.to(device=pos.device, dtype=torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]
