"""Training a feature draft (EAGLE-style, ``engine/drafts/feature.py``): its inputs are the target's
features, the loss KL to the target plus a pull of the draft's hidden state towards them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import Example, Features
from .layers import kl_loss, teacher_logits


def make_batch(feats: Features, examples: list[Example], idx: list[int], dev: torch.device, dt: torch.dtype, fused: bool = False):
    """Inputs of a feature draft: tokens, the target's features at each position as
    ``engine.drafts.drafter.target_features`` gives them ([final], or [mid | final] when ``fused``), the target's
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


def shift_own(h: torch.Tensor) -> torch.Tensor:
    """Features as the next positions' inputs: position t reads h[t-1] (position 0 zeros)."""
    out = torch.zeros_like(h)
    out[:, 1:] = h[:, :-1]
    return out


def losses(draft, ids, true, final, mask, pos, chain: bool,
                   noise: tuple[float, torch.Generator] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL to the target at every answer position, a smooth-L1 pull of the draft's hidden state
    towards the target's feature, and (``chain``) the KL once more with every input feature
    replaced by the draft's own from the first pass, as when it drafts several tokens in a row.
    ``true``: the target's features per position as :func:`make_batch` gives them; ``noise``
    (amplitude, generator): uniform noise added to the input features (EAGLE's augmentation:
    the draft learns to read features that are a little off, like its own)."""
    head = draft.lm_head
    teacher = teacher_logits(head, final, mask)
    f_in = shift_own(draft.true_features(true))
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
        own = draft(input_ids=ids, features=shift_own(h.detach()), position_ids=pos, use_cache=False).hidden
        kl2 = kl_loss(head.sub_logits(own[mask]), teacher)
        loss = loss + kl2
        info["kl_own"] = float(kl2.detach())
    return loss, info


@torch.no_grad()
def heldout_metrics(draft, feats: Features, examples: list[Example], batch: int = 8) -> dict[str, float]:
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
        ids, true, final, nxt, mask, pos = make_batch(feats, examples, idx, dev, dt, fused=draft.fuse_layer is not None)
        f_in = shift_own(draft.true_features(true))
        h = draft(input_ids=ids, features=f_in, position_ids=pos, use_cache=False).hidden
        logits = head.sub_logits(h[mask])
        agree += int((head.ids[logits.argmax(-1)] == nxt[mask]).sum())
        own = draft(input_ids=ids, features=shift_own(h), position_ids=pos, use_cache=False).hidden
        agree_own += int((head.ids[head.sub_logits(own[mask]).argmax(-1)] == nxt[mask]).sum())
        total += int(mask.sum())
        kl_sum += float(kl_loss(logits, teacher_logits(head, final, mask))) * int(mask.sum())
    covered = sum(int(torch.isin(ex.ids[ex.start :], ids_cpu).sum()) for ex in examples)
    n = max(total, 1)
    return {"agreement": agree / n, "agreement_own": agree_own / n, "kl": kl_sum / n, "coverage": covered / n}
