"""One tensor-parallel rank's share of a Llama-family model, read straight from its safetensors.

Megatron-style plain column/row-parallel linears (as gpt-fast, nano-vllm and vLLM), not DTensor:
the core calls every projection as a module, so a rank is the same transformers layout with fewer
heads and MLP columns, plus two all-reduces per layer, and it compiles to fixed graphs (DTensor's
per-op sharding propagation is dispatch overhead a decode step of a few rows cannot afford).

* ``q/k/v_proj``, ``gate/up_proj``: column-parallel.  Key/value heads are split in contiguous
  blocks as evenly as they go (N must not exceed the kv heads; SmolLM2-135M's 3 over 2 ranks split
  1 + 2), each rank keeping the query heads that read its kv heads, so GQA stays local.
* ``o_proj``, ``down_proj``: row-parallel, then an all-reduce; a bias is added once (rank 0's).
* norms are replicated: the residual stream is whole on every rank.

Embedding and head are vocab-parallel, also for small models (one rule; for a 70B target they are
2 GiB each in bf16): rank r holds vocabulary rows ``[r*P, (r+1)*P)``, P = ceil(V/N), zero-padded.
The embedding's all-reduce is exact (one non-zero term per element); the head all-gathers its
logits, so every rank holds them all.  A tied head is the embedding's own shard.
"""

from __future__ import annotations

import copy
import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def block(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [lo, hi) of ``n`` items split as evenly as they go."""
    return rank * n // world, (rank + 1) * n // world


@dataclass(frozen=True)
class Split:
    """What rank ``rank`` of ``world`` holds (head and column ranges are [lo, hi))."""

    rank: int
    world: int
    kv: tuple[int, int]
    q: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]  # real rows; the block is ``vocab_rows`` long (padded)
    vocab_rows: int
    head_dim: int


def dims(cfg: Any) -> tuple[int, int, int, int, int]:
    """(query heads, kv heads, head_dim, MLP width, vocabulary) of a transformers config."""
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return heads, kv, head_dim, int(cfg.intermediate_size), int(cfg.vocab_size)


def check(cfg: Any, world: int, name: str = "model") -> None:
    """Refuse, before any weight loads, a model that ``world`` ranks cannot split (one line)."""
    from ..model.core import ARCHS

    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHS:
        raise ModelError(f"tensor parallelism runs on the compact core, which does not cover '{name}' (architecture "
                         f"'{kind}'; it runs {', '.join(ARCHS)}): split it over GPUs with --target-device "
                         "pipeline:cuda:0,cuda:1 (device_map, one GPU at a time) instead")
    heads, kv, _, ffn, _ = dims(cfg)
    if world < 1:
        raise ModelError(f"tensor parallelism needs at least 1 rank, got {world}")
    if kv < world:
        raise ModelError(f"'{name}' has {kv} key/value heads, so it splits over at most {kv} tensor-parallel ranks, "
                         f"not {world}; list at most {kv} devices")
    if heads % kv or ffn < world:
        raise ModelError(f"'{name}' cannot be split: {heads} query heads over {kv} key/value heads, MLP width {ffn}")


def split_for(cfg: Any, rank: int, world: int) -> Split:
    heads, kv, head_dim, ffn, vocab = dims(cfg)
    groups = heads // kv
    k = block(kv, world, rank)
    rows = -(-vocab // world)
    lo = min(rank * rows, vocab)
    return Split(rank, world, k, (k[0] * groups, k[1] * groups), block(ffn, world, rank), (lo, min(lo + rows, vocab)),
                 rows, head_dim)


# -- the parallel modules (called by the core like any projection) ----------------------------------


class Comm:
    """The collectives a shard makes, over the default process group (set once it exists).
    Functional collectives: ``torch.compile`` traces them into the graph (CUDA graphs with NCCL).
    A single rank makes none (a one-rank gloo all-reduce still costs about a millisecond)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.group: str | None = None

    def bind(self) -> None:
        import torch.distributed as dist

        self.group = dist.group.WORLD.group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the new name, torch >= 2.10
        return gather(x, 0, self.group)


class RowParallel(nn.Module):
    """A row-parallel projection: the rank's input columns, then the sum over ranks."""

    def __init__(self, inner: nn.Linear, comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))

    def graph_call(self, rows: int) -> Any:
        """What a compiled graph of ``rows`` rows calls (see core.traceable)."""
        from ..model.core import traceable

        f = traceable(self.inner, rows)
        return lambda x: self.comm.all_reduce(f(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: int, hidden: int, lo: int, dtype: torch.dtype, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)
        self.lo, self.rows, self.comm = lo, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight).masked_fill(~inside[..., None], 0)
        return self.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The rank's block of logits, gathered: every rank returns [T, vocab]."""

    def __init__(self, inner: nn.Linear, vocab: int, comm: Comm) -> None:
        super().__init__()
        self.inner, self.vocab, self.comm = inner, vocab, comm

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        t, rows = local.shape
        full = self.comm.all_gather(local).view(self.comm.world, t, rows).permute(1, 0, 2).reshape(t, -1)
        return full[:, : self.vocab]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(self.inner(x))

    def graph_call(self, rows: int) -> Any:
        from ..model.core import traceable

        f = traceable(self.inner, rows)
        return lambda x: self._gather(f(x))


# -- reading the checkpoint ---------------------------------------------------------------------------


class Tensors:
    """Checkpoint tensors by name, read a slice at a time: the ``*.safetensors`` of a folder
    (``safe_open(...).get_slice``: only the rank's block is read), or a dict of tensors."""

    def __init__(self, source: str | os.PathLike | dict[str, torch.Tensor]) -> None:
        self._open: list[Any] = []
        self._where: dict[str, Any] = {}
        if isinstance(source, dict):
            self._where = dict(source)
            return
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(os.fspath(source), "*.safetensors")))
        if not files:
            raise ModelError(f"'{source}' has no .safetensors files: tensor parallelism reads each rank's block from them")
        for path in files:
            f = safe_open(path, framework="pt", device="cpu")
            self._open.append(f)
            for key in f.keys():
                self._where[key] = f

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> list[int]:
        src = self._where[key]
        return list(src.shape) if isinstance(src, torch.Tensor) else list(src.get_slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, lo: int = 0, hi: int = 0) -> torch.Tensor:
        src = self._where[key]
        sl = src if isinstance(src, torch.Tensor) else src.get_slice(key)
        if dim is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    def close(self) -> None:
        self._open.clear()


def _rule(key: str, s: Split) -> tuple[int | None, int, int]:
    """(dim, lo, hi) of ``key``'s block on this rank; dim None: the whole tensor."""
    d = s.head_dim
    proj = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else ""
    is_bias = key.endswith(".bias")
    if proj == "q_proj":
        return 0, s.q[0] * d, s.q[1] * d
    if proj in ("k_proj", "v_proj"):
        return 0, s.kv[0] * d, s.kv[1] * d
    if proj in ("gate_proj", "up_proj"):
        return 0, s.ffn[0], s.ffn[1]
    if proj == "o_proj" and not is_bias:
        return 1, s.q[0] * d, s.q[1] * d
    if proj == "down_proj" and not is_bias:
        return 1, s.ffn[0], s.ffn[1]
    if key.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0, s.vocab[0], s.vocab[1]
    return None, 0, 0


@dataclass
class ShardInfo:
    """What a rank loaded (reported at load; tests assert the shapes)."""

    rank: int
    device: str
    split: Split
    weight_bytes: int
    layer_bytes: int  # this rank's share of the decoder layers
    full_layer_bytes: int  # the whole model's decoder layers, in the same dtype
    layer0: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter shapes of layer 0

    def line(self) -> str:
        s = self.split
        return (f"rank {self.rank} on {self.device}: {_size(self.weight_bytes)} of weights, "
                f"{self.layer_bytes / max(1, self.full_layer_bytes):.1%} of the layers' {_size(self.full_layer_bytes)} "
                f"(kv heads {s.kv[0]}-{s.kv[1] - 1}, MLP columns {s.ffn[0]}-{s.ffn[1] - 1}, "
                f"vocabulary rows {s.vocab[0]}-{s.vocab[1] - 1})")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def load_config(folder: str | os.PathLike) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.fspath(folder))
    except (OSError, ValueError) as e:
        raise ModelError(f"could not read the model config in '{folder}': {e}") from e


def build(source: str | os.PathLike | dict[str, torch.Tensor], cfg: Any, rank: int, world: int,
          device: torch.device | str, dtype: torch.dtype, name: str = "model") -> tuple[nn.Module, Comm, ShardInfo]:
    """Rank ``rank``'s shard of the model in ``source`` as a transformers model with local shapes,
    its row-parallel projections, embedding and head replaced by the parallel modules above.
    Only this rank's blocks are read and allocated.  ``comm.bind()`` once the process group exists."""
    from transformers import AutoModelForCausalLM

    check(cfg, world, name)
    s = split_for(cfg, rank, world)
    dev = torch.device(device)
    scfg = copy.deepcopy(cfg)
    scfg.num_attention_heads, scfg.num_key_value_heads = s.q[1] - s.q[0], s.kv[1] - s.kv[0]
    scfg.intermediate_size, scfg.head_dim = s.ffn[1] - s.ffn[0], s.head_dim
    scfg.tie_word_embeddings = False  # the tie is made below, between the parallel modules
    comm = Comm(world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(scfg, dtype=dtype)
        inner = model.model
        hidden = int(cfg.hidden_size)
        inner.embed_tokens = VocabParallelEmbedding(s.vocab_rows, hidden, s.vocab[0], dtype, comm)
        model.lm_head = VocabParallelHead(nn.Linear(hidden, s.vocab_rows, bias=False, dtype=dtype), int(cfg.vocab_size), comm)
        for layer in inner.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    model.to_empty(device=dev)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if tied:
        model.lm_head.inner.weight = inner.embed_tokens.weight
    with torch.device(dev):
        inner.rotary_emb = type(inner.rotary_emb)(config=scfg)  # inv_freq from the real config, on the device
    tensors = Tensors(source)
    try:
        full_layers = _load(model, tensors, s, name, dtype)
    finally:
        tensors.close()
    model.eval().requires_grad_(False)
    el = torch.empty(0, dtype=dtype).element_size()
    params = list(model.named_parameters())
    info = ShardInfo(rank, str(dev), s, sum(p.numel() for _, p in params) * el,
                     sum(p.numel() for n, p in params if ".layers." in n) * el, full_layers * el,
                     {n.split("layers.0.", 1)[1]: tuple(p.shape) for n, p in params if ".layers.0." in n})
    return model, comm, info


@torch.no_grad()
def _load(model: nn.Module, tensors: Tensors, s: Split, name: str, dtype: torch.dtype) -> int:
    """Copy every parameter's block in; returns the element count of the whole model's layers."""
    full_layers = 0
    for pname, p in model.named_parameters():
        key = pname.replace(".inner.", ".")
        if key not in tensors:
            tie = " and the config does not tie it to the embedding" if key == "lm_head.weight" else ""
            raise ModelError(f"'{name}': the checkpoint has no tensor '{key}'{tie}")
        dim, lo, hi = _rule(key, s)
        shape = tensors.shape(key)
        if ".layers." in key:
            full_layers += math.prod(shape)
        if key.endswith(".bias") and key.rsplit(".", 2)[-2] in ROW:
            t = tensors.read(key) if s.rank == 0 else torch.zeros(shape)
        else:
            t = tensors.read(key, dim, lo, hi)
        if t.shape[0] < p.shape[0] and dim == 0 and key.endswith(("embed_tokens.weight", "lm_head.weight")):
            t = torch.cat([t, t.new_zeros(p.shape[0] - t.shape[0], *t.shape[1:])])  # the padded last vocabulary block
        if tuple(t.shape) != tuple(p.shape):
            raise ModelError(f"'{name}': checkpoint tensor '{key}' has shape {tuple(shape)}, which does not split into "
                             f"{tuple(p.shape)} on rank {s.rank} of {s.world}")
        p.copy_(t.to(dtype))
    return full_layers
