"""Training a draft by distillation from its target (``ssd-chat draft train``).

Pipeline, every stage cached in a work folder so an interrupted run resumes:

1. **data**: the target answers each training prompt (under its chat template, as the
   app will prompt it) once greedily and ``samples`` more times by sampling at
   ``temperature``, in padded batches.  Sampled answers multiply the on-policy contexts
   the draft learns from (with greedy answers alone a draft over-fits).
2. **teacher pass**: one teacher-forced target forward per answer records the output of
   the shared trunk (the draft's input) and the target's final hidden state (from which
   its exact logits over the reduced vocabulary are recomputed during training).
3. **vocabulary**: the tokens the target emits in its answers (most frequent first),
   topped up with the tokens of highest total teacher probability, up to ``num_vocab``.
4. **training**: KL(target || draft) over the reduced vocabulary (the target distribution
   renormalised on it) at every answer position, AdamW with warm-up and cosine decay;
   held-out top-1 agreement is reported as training goes.  The batch order is a function
   of (seed, step), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import chat, draft_model, kv
from .draft_model import DraftShape
from .errors import ModelError, ParamError
from .feature_draft import FeatureDraft, FeatureState, FeatureTap, check_fuse_layer, is_feature_draft
from .models import LoadedModel, cache_dir

PROMPT_TEMPERATURE = 0.9  # of the prompts the target writes itself (--self-prompts)
ProgressFn = Callable[[str, int, int, dict[str, float]], None]  # (stage, done, total, info)


def _no_progress(stage: str, done: int, total: int, info: dict[str, float]) -> None:
    pass


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How a draft is shaped and trained.  ``kind``: "layers" (shared first layers + trained
    layers, :mod:`draft_model`) or "features" (EAGLE-style, :mod:`feature_draft`).  ``init_from``
    None: the target's last two layers ("layers") or its last layer ("features")."""

    kind: str = "layers"
    chain: bool = False  # features: also train on the draft's own features (a second pass; ~1.5x the time)
    num_shared: int = 2
    init_from: tuple[int, ...] | None = None
    num_vocab: int = 8192
    steps: int = 480
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    max_new_tokens: int = 128
    gen_batch: int = 128
    temperature: float = 0.8  # of the sampled training answers
    samples: int = 5  # sampled answers per training prompt, besides the greedy one
    fuse_layer: int | None = None  # features: also read the output of the target's first n layers
    feature_noise: float = 0.0  # features: uniform noise of this amplitude on the input features in training
    self_prompts: int = 0  # extra training prompts written by the target itself (answered greedily)
    eval_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("layers", "features"):
            raise ParamError(f"--kind must be 'layers' or 'features', got '{self.kind}'")
        if self.num_shared < 0:
            raise ParamError(f"--layers must be >= 0, got {self.num_shared}")
        if self.num_vocab < 2:
            raise ParamError(f"--vocab must be at least 2, got {self.num_vocab}")
        if self.fuse_layer is not None and (self.kind != "features" or self.fuse_layer < 0):
            raise ParamError(f"--fuse-layer needs --kind features and a layer >= 0, got {self.fuse_layer} with --kind {self.kind}")
        if self.feature_noise < 0 or (self.feature_noise and self.kind != "features"):
            raise ParamError(f"--feature-noise needs --kind features and a value >= 0, got {self.feature_noise} with --kind {self.kind}")
        if self.samples < 0:
            raise ParamError(f"--samples must be >= 0, got {self.samples}")
        if self.self_prompts < 0:
            raise ParamError(f"--self-prompts must be >= 0, got {self.self_prompts}")
        if self.samples and not self.temperature > 0:
            raise ParamError("--samples needs --temperature > 0 (sampled answers at temperature 0 would all be the greedy one)")
        for name in ("steps", "batch_size", "max_new_tokens", "gen_batch", "eval_every"):
            if getattr(self, name) < 1:
                raise ParamError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ParamError(f"--lr must be > 0, got {self.lr}")
        if self.temperature < 0:
            raise ParamError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def capture(self) -> int:
        """The hidden state recorded with the answers (``Features.trunk``): the output of the first
        n target layers, the draft's input ("layers") or the fused feature ("features" with ``fuse_layer``)."""
        return self.fuse_layer if self.fuse_layer is not None else self.num_shared

    def shape(self, num_target_layers: int) -> DraftShape:
        if self.kind == "features":
            return DraftShape(0, self.init_from if self.init_from is not None else (num_target_layers - 1,))
        default = tuple(range(max(0, num_target_layers - 2), num_target_layers))
        return DraftShape(self.num_shared, self.init_from if self.init_from is not None else default)


@dataclass(slots=True)
class Example:
    ids: torch.Tensor  # [T] prompt + answer
    start: int  # index of the first answer token


@dataclass(slots=True)
class Features:
    trunk: list[torch.Tensor]  # per example [T-1, H]: the draft's input (output of the shared layers)
    final: list[torch.Tensor]  # per example [T-1, H]: the target's final normed hidden state
    top1: list[torch.Tensor] | None = None  # per example [T-1]: the target's greedy next token (see with_top1)


@dataclass(slots=True)
class TrainResult:
    draft: torch.nn.Module
    shape: DraftShape
    history: list[dict[str, float]] = field(default_factory=list)
    heldout_agreement: float = 0.0
    vocab_coverage: float = 0.0


# --- prompts ----------------------------------------------------------------------------------


def load_prompts(path: str | Path | None = None, heldout: bool = False) -> list[str]:
    """Prompts from a JSON-lines file (``{"prompt": ...}`` per line) or the packaged set."""
    if path is None:
        name = "distill_heldout.jsonl" if heldout else "distill_prompts.jsonl"
        text = files("ssd_chat.assets").joinpath(name).read_text()
        where = name
    else:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as e:
            raise ParamError(f"cannot read prompt file '{path}': {e.strerror or e}") from e
        where = str(path)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(str(row["prompt"]) if isinstance(row, dict) else str(row))
        except (json.JSONDecodeError, KeyError) as e:
            raise ParamError(f"{where}:{n}: expected a JSON object with a \"prompt\" field") from e
    if not out:
        raise ParamError(f"{where} holds no prompts")
    return out


def prompt_ids(target: LoadedModel, prompts: list[str]) -> list[list[int]]:
    return [chat.prompt_ids(target.tokenizer, chat.messages_for(p))[0] for p in prompts]


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """The chat template's tokens up to where a user message's text starts (system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("--self-prompts needs a target with a chat template (it writes user turns in that format)")
    mark = "\x00\x01"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=False, tokenize=False)
    if mark not in text:
        raise ParamError("--self-prompts: this chat template does not show the user's text verbatim")
    return list(tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"])


@torch.no_grad()
def write_prompts(target: LoadedModel, n: int, seed: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                  progress: ProgressFn = _no_progress, batch: int = 64, max_tokens: int = 64,
                  temperature: float | None = None) -> list[str]:
    """``n`` distinct user prompts written by the target itself: its chat template opens a user
    turn and the target samples what a user would write, up to the end of the turn.  Kept: turns
    that end (an EOS within ``max_tokens``) with at least three words, not already in ``exclude``
    (the packaged and held-out prompts) nor written before.  Deterministic for a seed.  This is
    the distinct-context lever: sampled answers vary the replies but never the questions.
    ``temperature``: default :data:`PROMPT_TEMPERATURE`."""
    temperature = PROMPT_TEMPERATURE if temperature is None else temperature
    model, tok, dev = target.model, target.tokenizer, target.device
    prefix = torch.tensor([user_turn_prefix(tok)], dtype=torch.long)
    eos = sorted(target.eos_ids)
    if not eos:
        raise ParamError("--self-prompts needs a target with an end-of-turn token")
    seen = {p.strip() for p in exclude}
    out: list[str] = []
    torch.manual_seed(seed * 1_000_003 + 7919)
    tries = 0
    while len(out) < n:
        if tries > 8 + 4 * n // batch:
            raise ModelError(f"the target wrote only {len(out)} usable prompts of the {n} asked for")
        tries += 1
        ids = prefix.repeat(batch, 1).to(dev)
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                              top_p=1.0, top_k=0, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos[0]).cpu()
        for row in seqs[:, prefix.shape[1] :].tolist():
            cut = next((j for j, t in enumerate(row) if t in target.eos_ids), None)
            if cut is None:
                continue  # ran past max_tokens: an unfinished turn
            text = tok.decode(row[:cut], skip_special_tokens=True).strip()
            if len(text.split()) < 3 or text in seen:
                continue
            seen.add(text)
            out.append(text)
            if len(out) == n:
                break
        progress("writing prompts", len(out), n, {})
    return out


# --- stage 1: the target's answers, with the teacher's hidden states -----------------------------


@torch.no_grad()
def generate(target: LoadedModel, prompts: list[list[int]], cfg: TrainConfig, capture: tuple[int, ...] | None = None,
             progress: ProgressFn = _no_progress, temperature: float | None = None,
             stage: str = "answers", seed: int | None = None) -> tuple[list[Example], dict[int, Features]]:
    """The target's answers to ``prompts`` (batched, left-padded), each cut after its first EOS,
    at ``temperature`` (default ``cfg.temperature``; 0: greedy).

    While it generates, forward hooks record for every position but the last the output of
    the first ``n`` target layers (the draft's input, for each ``n`` in ``capture``) and the
    target's final normed hidden state (its exact logits, recomputed in training): no second
    teacher pass is needed."""
    model, dev = target.model, target.device
    capture = tuple(capture) if capture is not None else (cfg.capture,)
    _, _, norm, _ = draft_model._parts(model)
    eos = sorted(target.eos_ids)
    pad = eos[0] if eos else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    examples: list[Example | None] = [None] * len(prompts)
    per: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [None] * len(prompts) for n in capture}  # type: ignore[misc]
    temp = cfg.temperature if temperature is None else temperature
    gen = {"do_sample": temp > 0, "max_new_tokens": cfg.max_new_tokens, "pad_token_id": pad,
           "eos_token_id": eos or None}
    if temp > 0:
        gen.update(temperature=temp, top_p=1.0, top_k=0)
    calls: dict[Any, list[torch.Tensor]] = {n: [] for n in capture}
    calls["final"] = []

    def hook(key: Any) -> Callable[..., None]:
        def fn(mod: Any, args: Any, out: Any) -> None:
            calls[key].append(draft_model.hidden_of(out).float().cpu())
        return fn

    hooks = [norm.register_forward_hook(hook("final"))]
    for n in capture:
        hooks.append(draft_model.output_module(model, n).register_forward_hook(hook(n)))
    torch.manual_seed(cfg.seed if seed is None else seed)
    try:
        for b in range(0, len(order), cfg.gen_batch):
            idx = order[b : b + cfg.gen_batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            for v in calls.values():
                v.clear()
            seqs = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **gen).cpu()
            steps = {k: torch.cat(v, dim=1) for k, v in calls.items()}  # [B, width + fed answer tokens, H]
            for r, i in enumerate(idx):
                answer = seqs[r, width:].tolist()
                for j, t in enumerate(answer):
                    if t in target.eos_ids:
                        answer = answer[: j + 1]
                        break
                ex = Example(torch.tensor(prompts[i] + answer, dtype=torch.long), len(prompts[i]))
                examples[i] = ex
                lo, hi = width - len(prompts[i]), width + len(answer) - 1  # every position but the last
                for n in capture:
                    per[n][i] = (steps[n][r, lo:hi].clone(), steps["final"][r, lo:hi].clone())
            progress(stage, min(b + cfg.gen_batch, len(order)), len(order), {})
    finally:
        for hk in hooks:
            hk.remove()
    out = {n: Features([t for t, _ in per[n]], [f for _, f in per[n]]) for n in capture}
    return [e for e in examples if e is not None], out


@torch.no_grad()
def with_top1(target: LoadedModel, feats: Features) -> Features:
    """``feats`` plus the target's greedy next token at every position (full vocabulary)."""
    head = target.model.get_output_embeddings()
    top1 = [head(f.to(head.weight.device, head.weight.dtype)).argmax(-1).cpu() for f in feats.final]
    return Features(feats.trunk, feats.final, top1)


# --- stage 3: vocabulary ------------------------------------------------------------------------


def choose_vocab(target: LoadedModel, examples: list[Example], feats: Features, num_vocab: int,
                 max_positions: int = 8192) -> torch.Tensor:
    """Token ids of the reduced vocabulary, sorted."""
    head = target.model.get_output_embeddings()
    vocab_size = int(head.weight.shape[0])
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    every = max(1, sum(len(ex.ids) - ex.start for ex in examples) // max_positions)  # teacher mass on a sample
    with torch.no_grad():
        for ex, fin in zip(examples, feats.final):
            answer = ex.ids[ex.start :]
            counts += torch.bincount(answer, minlength=vocab_size).double()
            h = fin[ex.start - 1 : len(ex.ids) - 1 : every].to(head.weight.device, head.weight.dtype)
            mass += torch.softmax(head(h).float(), -1).sum(0).double().cpu()
    for e in target.eos_ids:
        if e < vocab_size:
            counts[e] += 1e9  # always proposable
    score = counts * 1e6 + mass  # emitted tokens first (by frequency), then by teacher probability
    k = min(num_vocab, vocab_size)
    return torch.sort(torch.topk(score, k).indices).values


# --- stage 4: training --------------------------------------------------------------------------


def _batch(feats: Features, examples: list[Example], idx: list[int], dev: torch.device, dt: torch.dtype):
    width = max(len(examples[i].ids) for i in idx)
    hid = feats.trunk[0].shape[-1]
    trunk = torch.zeros((len(idx), width, hid), dtype=dt)
    final = torch.zeros((len(idx), width, hid), dtype=dt)
    nxt = torch.zeros((len(idx), width), dtype=torch.long)  # the target's greedy next token (else the data's)
    mask = torch.zeros((len(idx), width), dtype=torch.bool)
    for r, i in enumerate(idx):
        ex, n = examples[i], len(examples[i].ids)
        trunk[r, : n - 1] = feats.trunk[i]  # features exist for every position but the last
        final[r, : n - 1] = feats.final[i]
        nxt[r, : n - 1] = feats.top1[i] if feats.top1 is not None else ex.ids[1:]
        mask[r, ex.start - 1 : n - 1] = True  # positions whose next token is an answer token
    pos = torch.arange(width)[None].expand(len(idx), -1)
    return trunk.to(dev), final.to(dev), nxt.to(dev), mask.to(dev), pos.to(dev)


def _forward(tail: torch.nn.Module, head: draft_model.ReducedHead, trunk, pos, mask) -> torch.Tensor:
    """Draft logits over the reduced vocabulary at the masked positions: [P, V']."""
    h = tail(inputs_embeds=trunk, position_ids=pos, use_cache=False).last_hidden_state
    return head.sub_logits(h[mask])


def _teacher_logits(head: draft_model.ReducedHead, final, mask) -> torch.Tensor:
    with torch.no_grad():
        return final[mask] @ head.rows.T + head.fixed_bias


def kl_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || draft) over positions, both over the reduced vocabulary."""
    t_logp = F.log_softmax(teacher_logits.float(), -1)
    d_logp = F.log_softmax(draft_logits.float(), -1)
    return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()


@torch.no_grad()
def heldout_metrics(draft: torch.nn.Module, feats: Features, examples: list[Example], batch: int = 8) -> dict[str, float]:
    """On held-out data: teacher-forced top-1 agreement with the target's greedy token (``feats.top1``;
    without it, the data's next token), the KL, and the share of answer tokens in the reduced vocabulary."""
    tail, head = draft_model.tail(draft), draft.lm_head
    dev, dt = head.rows.device, head.rows.dtype
    agree = total = 0
    kl_sum = 0.0
    ids_cpu = head.ids.cpu()
    for b in range(0, len(examples), batch):
        idx = list(range(b, min(b + batch, len(examples))))
        trunk, final, nxt, mask, pos = _batch(feats, examples, idx, dev, dt)
        logits = _forward(tail, head, trunk, pos, mask)
        guess = head.ids[logits.argmax(-1)]
        agree += int((guess == nxt[mask]).sum())
        total += int(mask.sum())
        kl_sum += float(kl_loss(logits, _teacher_logits(head, final, mask))) * int(mask.sum())
    covered = sum(int(torch.isin(ex.ids[ex.start :], ids_cpu).sum()) for ex in examples)
    return {"agreement": agree / max(total, 1), "kl": kl_sum / max(total, 1), "coverage": covered / max(total, 1)}


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _order(n: int, step: int, batch: int, seed: int) -> list[int]:
    """The examples of training step ``step``: epochs are seeded permutations."""
    per_epoch = max(1, n // batch)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return perm[k * batch : (k + 1) * batch] if n >= batch else perm


def _save_checkpoint(path: Path, draft, optim, step: int, history: list[dict[str, float]], key: str) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "step": step, "history": history, "optim": optim.state_dict(),
                "state": {n: p.detach().cpu() for n, p in draft_model.trainable_state(draft).items()}}, tmp)
    os.replace(tmp, path)


def train_draft(
    target: LoadedModel,
    train: tuple[list[Example], Features],
    heldout: tuple[list[Example], Features],
    vocab_ids: torch.Tensor,
    cfg: TrainConfig,
    checkpoint: Path | None = None,
    progress: ProgressFn = _no_progress,
) -> TrainResult:
    """Build a draft for ``target`` and train it; resumes from ``checkpoint`` if it matches ``cfg``."""
    model = target.model
    shape = cfg.shape(model.config.num_hidden_layers)
    if heldout[1].top1 is None:
        heldout = (heldout[0], with_top1(target, heldout[1]))
    torch.manual_seed(cfg.seed)
    features = cfg.kind == "features"
    if features:
        draft = FeatureDraft(model, shape.init_from, vocab_ids, cfg.fuse_layer)
        tail = draft
    else:
        draft = draft_model.build(model, shape, vocab_ids)
        tail = draft_model.tail(draft)
    head = draft.lm_head
    tail.train()
    params = draft_model.trainable_parameters(draft)
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    key = _config_key(cfg, vocab_ids)
    history: list[dict[str, float]] = []
    start = 0
    if checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if ck.get("key") == key:
            with torch.no_grad():
                for n, p in draft_model.trainable_state(draft).items():
                    p.copy_(ck["state"][n])
            optim.load_state_dict(ck["optim"])
            start, history = int(ck["step"]), list(ck["history"])
    examples, feats = train
    dev, dt = head.rows.device, head.rows.dtype
    evaluate = feature_heldout_metrics if features else heldout_metrics
    info = dict(history[-1]) if history else {}
    progress("training", start, cfg.steps, info)
    for step in range(start, cfg.steps):
        idx = _order(len(examples), step, cfg.batch_size, cfg.seed)
        if features:
            ids, true, final, _, mask, pos = _fbatch(feats, examples, idx, dev, dt, fused=cfg.fuse_layer is not None)
            noise = None
            if cfg.feature_noise:  # a generator per step, so a resumed run draws the same noise
                noise = (cfg.feature_noise, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
            loss, parts = feature_losses(draft, ids, true, final, mask, pos, chain=cfg.chain, noise=noise)
            info.update(parts)
        else:
            trunk, final, _, mask, pos = _batch(feats, examples, idx, dev, dt)
            loss = kl_loss(_forward(tail, head, trunk, pos, mask), _teacher_logits(head, final, mask))
        for g in optim.param_groups:
            g["lr"] = _lr_at(step, cfg)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        info["loss"] = float(loss.detach())
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            tail.eval()
            m = evaluate(draft, heldout[1], heldout[0])
            tail.train()
            info.update({"agreement": m["agreement"], "heldout_kl": m["kl"]})
            if "agreement_own" in m:
                info["agreement_own"] = m["agreement_own"]
            history.append({"step": done, "loss": info["loss"], **m})
            if checkpoint is not None:
                _save_checkpoint(checkpoint, draft, optim, done, history, key)
        progress("training", done, cfg.steps, dict(info))
    tail.eval()
    for p in params:
        p.requires_grad_(False)
    final_m = evaluate(draft, heldout[1], heldout[0])
    return TrainResult(draft.eval(), shape, history, final_m["agreement"], final_m["coverage"])


def _config_key(cfg: TrainConfig, vocab_ids: torch.Tensor) -> str:
    d = asdict(cfg)
    d.pop("eval_every")
    h = hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode())
    h.update(vocab_ids.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# --- the whole pipeline -------------------------------------------------------------------------


def work_dir(target: LoadedModel, cfg: TrainConfig, prompts: list[str], heldout: list[str]) -> Path:
    """Default cache folder for one (target, data settings) pair."""
    h = hashlib.sha256()
    h.update(draft_model.shared_hash(target.model, 0).encode())
    h.update(json.dumps([prompts, heldout, cfg.max_new_tokens, cfg.seed]).encode())
    return cache_dir() / "distill" / h.hexdigest()[:16]


def _pack(examples: list[Example], feats: Features) -> dict[str, Any]:
    """Plain tensors and lists, so the cache loads with torch's weights-only loader."""
    return {"ids": [e.ids for e in examples], "start": [e.start for e in examples], "trunk": feats.trunk, "final": feats.final}


def _unpack(d: dict[str, Any]) -> tuple[list[Example], Features]:
    return [Example(i, int(s)) for i, s in zip(d["ids"], d["start"])], Features(list(d["trunk"]), list(d["final"]))


def _cached(path: Path, make: Callable[[], Any]) -> Any:
    if path.is_file():
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a torn file from an interrupted run: rebuild it
            path.unlink(missing_ok=True)
    obj = make()
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return obj


def load_data(target: LoadedModel, cfg: TrainConfig, prompts: list[str], heldout: list[str], work: Path,
              progress: ProgressFn = _no_progress) -> tuple[tuple[list[Example], Features], tuple[list[Example], Features]]:
    """The target's greedy answers (training and held-out) and ``cfg.samples`` rounds of sampled
    training answers, with their hidden states; each stage is cached in ``work``."""
    train_ids = prompt_ids(target, prompts)

    def greedy() -> dict[str, Any]:
        tr, trf = generate(target, train_ids, cfg, progress=progress, temperature=0.0, stage="answers")
        he, hef = generate(target, prompt_ids(target, heldout), cfg, progress=progress, temperature=0.0, stage="held-out")
        return {"train": _pack(tr, trf[cfg.capture]), "heldout": _pack(he, hef[cfg.capture])}

    def sampled(i: int) -> Callable[[], dict[str, Any]]:
        def make() -> dict[str, Any]:
            tr, trf = generate(target, train_ids, cfg, progress=progress, temperature=cfg.temperature,
                               stage=f"sample {i + 1}/{cfg.samples}", seed=cfg.seed * 1_000_003 + i + 1)
            return _pack(tr, trf[cfg.capture])
        return make

    data = _cached(work / f"answers-{cfg.capture}.pt", greedy)
    (train_ex, train_f), (held_ex, held_f) = _unpack(data["train"]), _unpack(data["heldout"])
    for i in range(cfg.samples):  # one cache file per round of samples, so an interrupted run resumes between rounds
        ex, f = _unpack(_cached(work / f"sampled-{cfg.capture}-t{cfg.temperature:g}-{i}.pt", sampled(i)))
        train_ex, train_f = train_ex + ex, Features(train_f.trunk + f.trunk, train_f.final + f.final)
    if cfg.self_prompts:
        own = self_written_prompts(target, cfg, prompts, heldout, work, progress)

        def answers() -> dict[str, Any]:
            ex, f = generate(target, prompt_ids(target, own), cfg, progress=progress, temperature=0.0, stage="answers to own prompts")
            return _pack(ex, f[cfg.capture])

        ex, f = _unpack(_cached(work / f"self-answers-{cfg.capture}-{cfg.self_prompts}-s{cfg.seed}.pt", answers))
        train_ex, train_f = train_ex + ex, Features(train_f.trunk + f.trunk, train_f.final + f.final)
    return (train_ex, train_f), (held_ex, held_f)


def self_written_prompts(target: LoadedModel, cfg: TrainConfig, prompts: list[str], heldout: list[str], work: Path,
                         progress: ProgressFn = _no_progress) -> list[str]:
    """``cfg.self_prompts`` prompts the target writes itself (:func:`write_prompts`), cached in ``work``."""
    path = work / f"self-prompts-{cfg.self_prompts}-s{cfg.seed}.pt"
    made = _cached(path, lambda: {"prompts": write_prompts(target, cfg.self_prompts, cfg.seed, set(prompts) | set(heldout), progress)})
    return list(made["prompts"])


def run(
    target: LoadedModel,
    out: Path,
    cfg: TrainConfig,
    prompts: list[str] | None = None,
    heldout: list[str] | None = None,
    work: Path | None = None,
    fresh: bool = False,
    progress: ProgressFn = _no_progress,
) -> tuple[TrainResult, Path]:
    """Train a draft for ``target`` and save it in ``out``; every stage is cached in ``work``."""
    prompts = prompts if prompts is not None else load_prompts()
    heldout = heldout if heldout is not None else load_prompts(heldout=True)
    draft_model.check_shape(target.model, cfg.shape(target.model.config.num_hidden_layers))
    check_fuse_layer(target.model, cfg.fuse_layer)
    work = Path(work) if work is not None else work_dir(target, cfg, prompts, heldout)
    work.mkdir(parents=True, exist_ok=True)
    if fresh:
        for f in work.glob("*.pt"):
            f.unlink()
    t0 = time.perf_counter()
    (train_ex, train_f), (held_ex, held_f) = load_data(target, cfg, prompts, heldout, work, progress)
    vocab = choose_vocab(target, train_ex, train_f, cfg.num_vocab)
    result = train_draft(target, (train_ex, train_f), (held_ex, held_f), vocab, cfg, work / "checkpoint.pt", progress)
    n_answer = sum(len(e.ids) - e.start for e in train_ex)
    extra = {
        "name": Path(out).name,
        "training": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
                     "init_from": list(result.shape.init_from), "num_prompts": len(prompts) + cfg.self_prompts,
                     "num_answers": len(train_ex), "num_answer_tokens": n_answer, "train_s": round(time.perf_counter() - t0, 1)},
        "heldout": {"num_prompts": len(heldout), "teacher_forced_agreement": round(result.heldout_agreement, 4),
                    "vocab_coverage": round(result.vocab_coverage, 4)},
    }
    draft_model.save(result.draft, Path(out), target.name, target.model, extra)
    return result, work


# --- measuring a draft in real (incremental, cached) decoding ------------------------------------


@torch.inference_mode()
def measure(target: LoadedModel, draft: LoadedModel, prompts: list[str] | list[list[int]], max_new_tokens: int = 128,
            ks: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """Greedy decoding of each prompt by the target, with the draft fed the same tokens through
    its own KV cache: top-1 agreement as SD sees it, the greedy SD tokens per target forward
    implied for each k (``prompts``: texts, or token ids), and the draft / target cost of one cached single-token step, timed
    back to back in this process (a ratio, robust to a busy machine)."""
    matches: list[list[bool]] = []
    t_target = t_draft = 0.0
    steps = 0
    features = is_feature_draft(draft.model)
    all_ids = [p if isinstance(p, list) else prompt_ids(target, [p])[0] for p in prompts]
    for ids in all_ids:
        tc = kv.new_cache(target.model)
        x = torch.tensor(ids, device=target.device)
        tap = FeatureTap(target.model, draft.model.fuse_layer) if features else None
        try:
            tl = kv.forward(target.model, x, tc, last_only=True)[-1]
            if tap is not None:  # a feature draft reads the target's features: of every position before its token
                fs = FeatureState(draft.model, draft.device)
                fs.add_features(tap.take(), 0)
                seq = list(ids)
                dl = fs.catch_up(seq).logits[-1]
            else:
                dc = kv.new_cache(draft.model)
                dl = kv.forward(draft.model, x, dc, last_only=True)[-1]
            row = []
            for _ in range(max_new_tokens):
                tok = int(tl.argmax())
                row.append(int(dl.argmax()) == tok)
                if tok in target.eos_ids:
                    break
                nxt = torch.tensor([tok], device=target.device)
                a = time.perf_counter()
                tl = kv.forward(target.model, nxt, tc)[-1]
                b = time.perf_counter()
                if tap is not None:
                    seq.append(tok)
                    fs.add_features(tap.take(), len(seq) - 1)
                    b = time.perf_counter()
                    dl = fs.catch_up(seq).logits[-1]
                else:
                    dl = kv.forward(draft.model, nxt, dc)[-1]
                c = time.perf_counter()
                t_target += b - a
                t_draft += c - b
                steps += 1
        finally:
            if tap is not None:
                tap.close()
        matches.append(row)
    n = sum(len(r) for r in matches)
    out: dict[str, Any] = {
        "num_prompts": len(prompts), "num_tokens": n,
        "agreement": sum(map(sum, matches)) / max(n, 1),
        "draft_cost": t_draft / max(t_target, 1e-9),
        "target_step_ms": 1000 * t_target / max(steps, 1), "draft_step_ms": 1000 * t_draft / max(steps, 1),
    }
    if features:
        out.update(_sd_rounds(target, draft, all_ids, max_new_tokens, ks))
        return out
    for k in ks:
        tokens = rounds = 0
        for row in matches:
            i = 0
            while i < len(row):
                a = 0
                while a < k and i + a < len(row) and row[i + a]:
                    a += 1
                tokens += min(a + 1, len(row) - i)
                i += a + 1
                rounds += 1
        out[f"tokens_per_round_k{k}"] = tokens / max(rounds, 1)
        out[f"acceptance_k{k}"] = out["agreement"]  # the draft only ever reads the true prefix
    return out


def _sd_rounds(target: LoadedModel, draft: LoadedModel, all_ids: list[list[int]], max_new_tokens: int,
               ks: tuple[int, ...]) -> dict[str, float]:
    """Greedy SD for real with each k: tokens per target forward, and the acceptance rate of a
    draft token whose predecessors were accepted (accepted / (accepted + rejections)).  For a
    feature draft, the later tokens of a round are drafted on the draft's own features, so
    this is lower than the first-token agreement."""
    from .engine import Engine, EngineConfig
    from .events import Error, Round
    from .params import SamplingParams

    out: dict[str, float] = {}
    for k in ks:
        engine = Engine(EngineConfig(mode="sd", k=k), target, draft)
        accepted = rejected = tokens = rounds = 0
        for ids in all_ids:
            for ev in engine.stream(list(ids), SamplingParams(max_new_tokens=max_new_tokens)):
                if isinstance(ev, Round):
                    accepted += ev.accepted
                    rejected += ev.accepted < len(ev.drafted)
                    tokens += ev.emitted
                    rounds += 1
                elif isinstance(ev, Error):
                    raise ModelError(f"SD failed while measuring the draft: {ev.message}")
        out[f"tokens_per_round_k{k}"] = tokens / max(rounds, 1)
        out[f"acceptance_k{k}"] = accepted / max(accepted + rejected, 1)
    return out


# --- feature drafts (EAGLE-style, see feature_draft.py) ---------------------------------------------


def _fbatch(feats: Features, examples: list[Example], idx: list[int], dev: torch.device, dt: torch.dtype, fused: bool = False):
    """Inputs of a feature draft: tokens, the target's features at each position as
    :class:`FeatureTap` takes them ([final], or [mid | final] when ``fused``), the target's
    final feature at each position, its greedy next token, the answer-position mask and
    positions; all [B, W(, H or 2H)] with W = longest - 1."""
    width = max(len(examples[i].ids) for i in idx) - 1
    hid = feats.final[0].shape[-1]
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    true = torch.zeros((len(idx), width, 2 * hid if fused else hid), dtype=dt)
    final = torch.zeros((len(idx), width, hid), dtype=dt)
    nxt = torch.zeros((len(idx), width), dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.bool)
    for r, i in enumerate(idx):
        ex, n = examples[i], len(examples[i].ids)
        ids[r, : n - 1] = ex.ids[: n - 1]
        final[r, : n - 1] = feats.final[i]
        true[r, : n - 1] = torch.cat([feats.trunk[i], feats.final[i]], dim=-1) if fused else feats.final[i]
        nxt[r, : n - 1] = feats.top1[i] if feats.top1 is not None else ex.ids[1:]
        mask[r, ex.start - 1 : n - 1] = True
    pos = torch.arange(width)[None].expand(len(idx), -1)
    return ids.to(dev), true.to(dev), final.to(dev), nxt.to(dev), mask.to(dev), pos.to(dev)


def _shift_own(h: torch.Tensor) -> torch.Tensor:
    """Features as the next positions' inputs: position t reads h[t-1] (position 0 zeros)."""
    out = torch.zeros_like(h)
    out[:, 1:] = h[:, :-1]
    return out


def feature_losses(draft, ids, true, final, mask, pos, chain: bool,
                   noise: tuple[float, torch.Generator] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL to the target at every answer position, a smooth-L1 pull of the draft's hidden state
    towards the target's feature, and (``chain``) the KL once more with every input feature
    replaced by the draft's own from the first pass, as when it drafts several tokens in a row.
    ``true``: the target's features per position as :func:`_fbatch` gives them; ``noise``
    (amplitude, generator): uniform noise added to the input features (EAGLE's augmentation:
    the draft learns to read features that are a little off, like its own)."""
    head = draft.lm_head
    teacher = _teacher_logits(head, final, mask)
    f_in = _shift_own(draft.true_features(true))
    if noise is not None:
        amp, gen = noise
        f_in = f_in + (2 * torch.rand(f_in.shape, generator=gen) - 1).to(f_in) * amp
    out = draft(input_ids=ids, features=f_in, position_ids=pos, use_cache=False)
    h = out.hidden
    kl = kl_loss(head.sub_logits(h[mask]), teacher)
    reg = F.smooth_l1_loss(h[mask].float(), final[mask].float())
    loss = kl + reg
    info = {"kl": float(kl.detach()), "reg": float(reg.detach())}
    if chain:
        own = draft(input_ids=ids, features=_shift_own(h.detach()), position_ids=pos, use_cache=False).hidden
        kl2 = kl_loss(head.sub_logits(own[mask]), teacher)
        loss = loss + kl2
        info["kl_own"] = float(kl2.detach())
    return loss, info


@torch.no_grad()
def feature_heldout_metrics(draft, feats: Features, examples: list[Example], batch: int = 8) -> dict[str, float]:
    """Held-out top-1 agreement with the target's greedy token: ``agreement`` with the target's
    features as inputs (the first draft token of a round), ``agreement_own`` with the draft's own
    features as inputs (a lower bound for the later draft tokens), and the KL."""
    head = draft.lm_head
    dev, dt = head.rows.device, head.rows.dtype
    agree = agree_own = total = 0
    kl_sum = 0.0
    ids_cpu = head.ids.cpu()
    for b in range(0, len(examples), batch):
        idx = list(range(b, min(b + batch, len(examples))))
        ids, true, final, nxt, mask, pos = _fbatch(feats, examples, idx, dev, dt, fused=draft.fuse_layer is not None)
        f_in = _shift_own(draft.true_features(true))
        h = draft(input_ids=ids, features=f_in, position_ids=pos, use_cache=False).hidden
        logits = head.sub_logits(h[mask])
        agree += int((head.ids[logits.argmax(-1)] == nxt[mask]).sum())
        own = draft(input_ids=ids, features=_shift_own(h), position_ids=pos, use_cache=False).hidden
        agree_own += int((head.ids[head.sub_logits(own[mask]).argmax(-1)] == nxt[mask]).sum())
        total += int(mask.sum())
        kl_sum += float(kl_loss(logits, _teacher_logits(head, final, mask))) * int(mask.sum())
    covered = sum(int(torch.isin(ex.ids[ex.start :], ids_cpu).sum()) for ex in examples)
    n = max(total, 1)
    return {"agreement": agree / n, "agreement_own": agree_own / n, "kl": kl_sum / n, "coverage": covered / n}
