"""The training loop and the whole pipeline (``ssd-chat draft train``): data, vocabulary,
training with AdamW (warm-up, cosine decay), held-out agreement as it goes, checkpoints so a
rerun resumes exactly where it stopped, and the draft folder at the end."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..engine import build_draft as build, check_draft_shape as check_shape, trainable_state, FeatureDraft, check_fuse_layer
from ..engine import LoadedModel
from . import features as features_
from . import layers
from .spec import Example, Features, ProgressFn, TrainConfig, TrainResult, _no_progress
from .data import choose_vocab, load_data, with_top1, work_dir
from .folder import save
from .prompts import load_prompts


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
                "state": {n: p.detach().cpu() for n, p in trainable_state(draft).items()}}, tmp)
    os.replace(tmp, path)


def train_draft(target: LoadedModel, train: tuple[list[Example], Features], heldout: tuple[list[Example], Features],
                vocab_ids: torch.Tensor, cfg: TrainConfig, checkpoint: Path | None = None,
                progress: ProgressFn = _no_progress) -> TrainResult:
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
        draft = build(model, shape, vocab_ids)
        tail = layers.tail(draft)
    head = draft.lm_head
    tail.train()
    params = list(trainable_state(draft).values())
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    key = _config_key(cfg, vocab_ids)
    history: list[dict[str, float]] = []
    start = 0
    if checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if ck.get("key") == key:
            with torch.no_grad():
                for n, p in trainable_state(draft).items():
                    p.copy_(ck["state"][n])
            optim.load_state_dict(ck["optim"])
            start, history = int(ck["step"]), list(ck["history"])
    examples, feats = train
    dev, dt = head.rows.device, head.rows.dtype
    evaluate = features_.heldout_metrics if features else layers.heldout_metrics
    info = dict(history[-1]) if history else {}
    progress("training", start, cfg.steps, info)
    for step in range(start, cfg.steps):
        idx = _order(len(examples), step, cfg.batch_size, cfg.seed)
        if features:
            ids, true, final, _, mask, pos = features_.make_batch(feats, examples, idx, dev, dt, fused=cfg.fuse_layer is not None)
            # a generator per step, so a resumed run draws the same noise
            noise = (cfg.feature_noise, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)) if cfg.feature_noise else None
            loss, parts = features_.losses(draft, ids, true, final, mask, pos, chain=cfg.chain, noise=noise)
            info.update(parts)
        else:
            trunk, final, _, mask, pos = layers.make_batch(feats, examples, idx, dev, dt)
            loss = layers.kl_loss(layers.forward(tail, head, trunk, pos, mask), layers.teacher_logits(head, final, mask))
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


def run(target: LoadedModel, out: Path, cfg: TrainConfig, prompts: list[str] | None = None, heldout: list[str] | None = None,
        work: Path | None = None, fresh: bool = False, progress: ProgressFn = _no_progress) -> tuple[TrainResult, Path]:
    """Train a draft for ``target`` and save it in ``out``; every stage is cached in ``work``."""
    prompts = prompts if prompts is not None else load_prompts()
    heldout = heldout if heldout is not None else load_prompts(heldout=True)
    check_shape(target.model, cfg.shape(target.model.config.num_hidden_layers))
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
    save(result.draft, Path(out), target.name, target.model, extra)
    return result, work
