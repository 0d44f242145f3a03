"""Training a layers draft (shared first target layers + trained layers): the trunk's output is
the draft's input, and the loss is KL(target || draft) over the reduced vocabulary."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import ReducedHead, hidden_of, output_module, layer_parts as parts, shallow
from .spec import Example, Features


def tail(draft: nn.Module) -> nn.Module:
    """The draft's own layers + norm as a model that takes the shared trunk's output as
    ``inputs_embeds`` (used by training; no cache)."""
    shape = draft.ssd_shape
    inner = draft.model
    t = shallow(inner)
    t.layers = nn.ModuleList(list(inner.layers)[shape.num_shared :])
    cfg = copy.deepcopy(inner.config)
    cfg.num_hidden_layers = len(t.layers)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) == shape.num_layers:
        cfg.layer_types = types[shape.num_shared :]
    t.config = cfg
    return t


def trunk_output(target: nn.Module, ids: torch.Tensor, num_shared: int, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over ``ids`` [B, T] once; return (output of layer num_shared-1 (the
    embedding when 0), the target's final normed hidden state), both [B, T, H]."""
    _, _, norm, _ = parts(target)
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


def make_batch(feats: Features, examples: list[Example], idx: list[int], dev: torch.device, dt: torch.dtype):
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


def forward(tail: torch.nn.Module, head: ReducedHead, trunk, pos, mask) -> torch.Tensor:
    """Draft logits over the reduced vocabulary at the masked positions: [P, V']."""
    h = tail(inputs_embeds=trunk, position_ids=pos, use_cache=False).last_hidden_state
    return head.sub_logits(h[mask])


def teacher_logits(head: ReducedHead, final, mask) -> torch.Tensor:
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
    body, head = tail(draft), draft.lm_head
    dev, dt = head.rows.device, head.rows.dtype
    agree = total = 0
    kl_sum = 0.0
    ids_cpu = head.ids.cpu()
    for b in range(0, len(examples), batch):
        idx = list(range(b, min(b + batch, len(examples))))
        trunk, final, nxt, mask, pos = make_batch(feats, examples, idx, dev, dt)
        logits = forward(body, head, trunk, pos, mask)
        guess = head.ids[logits.argmax(-1)]
        agree += int((guess == nxt[mask]).sum())
        total += int(mask.sum())
        kl_sum += float(kl_loss(logits, teacher_logits(head, final, mask))) * int(mask.sum())
    covered = sum(int(torch.isin(ex.ids[ex.start :], ids_cpu).sum()) for ex in examples)
    return {"agreement": agree / max(total, 1), "kl": kl_sum / max(total, 1), "coverage": covered / max(total, 1)}
