"""The training data: the target's answers to the prompts (greedy and sampled) with its hidden
states (:func:`generate`), the draft's reduced vocabulary, and the work folder that caches every stage,
so an interrupted run resumes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine import cache_dir, shared_hash, hidden_of, output_module, layer_parts as parts, LoadedModel
from .spec import Example, Features, ProgressFn, TrainConfig, _no_progress
from .prompts import prompt_ids, write_prompts


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
    _, _, norm, _ = parts(model)
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
    calls: dict[Any, list[torch.Tensor]] = {n: [] for n in (*capture, "final")}

    def hook(key: Any) -> Callable[..., None]:
        def fn(mod: Any, args: Any, out: Any) -> None:
            calls[key].append(hidden_of(out).float().cpu())
        return fn

    hooks = [norm.register_forward_hook(hook("final"))]
    hooks += [output_module(model, n).register_forward_hook(hook(n)) for n in capture]
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
                answer = answer[: next((j + 1 for j, t in enumerate(answer) if t in target.eos_ids), len(answer))]
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


# --- the work folder ---------------------------------------------------------------------------


def work_dir(target: LoadedModel, cfg: TrainConfig, prompts: list[str], heldout: list[str]) -> Path:
    """Default cache folder for one (target, data settings) pair."""
    h = hashlib.sha256()
    h.update(shared_hash(target.model, 0).encode())
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

    def sampled(i: int) -> dict[str, Any]:
        tr, trf = generate(target, train_ids, cfg, progress=progress, temperature=cfg.temperature,
                           stage=f"sample {i + 1}/{cfg.samples}", seed=cfg.seed * 1_000_003 + i + 1)
        return _pack(tr, trf[cfg.capture])

    data = _cached(work / f"answers-{cfg.capture}.pt", greedy)
    (train_ex, train_f), (held_ex, held_f) = _unpack(data["train"]), _unpack(data["heldout"])
    for i in range(cfg.samples):  # one cache file per round of samples, so an interrupted run resumes between rounds
        ex, f = _unpack(_cached(work / f"sampled-{cfg.capture}-t{cfg.temperature:g}-{i}.pt", lambda: sampled(i)))
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
