"""Training drafts by distillation from their target (``ssd-chat draft train`` / ``draft eval``).

Pipeline, every stage cached in a work folder so an interrupted run resumes:

1. **data** (:mod:`.data`): the target answers each training prompt (under its chat template,
   as the app will prompt it) once greedily and ``samples`` more times by sampling at
   ``temperature``, in padded batches.  Sampled answers multiply the on-policy contexts the
   draft learns from (with greedy answers alone a draft over-fits).  Forward hooks record the
   hidden states the draft reads (the shared trunk's output, or the target's features) and
   the target's final hidden state, from which its exact logits are recomputed in training.
2. **vocabulary**: the tokens the target emits in its answers (most frequent first), topped
   up with the tokens of highest total teacher probability, up to ``num_vocab``.
3. **training** (:mod:`.loop`, :mod:`.layers`, :mod:`.features`): KL(target || draft) over the
   reduced vocabulary at every answer position, AdamW with warm-up and cosine decay; held-out
   top-1 agreement is reported as training goes.  The batch order is a function of (seed,
   step), so a resumed run continues exactly where it stopped.
4. **the folder** (:mod:`.folder`), which the engine loads (``engine/drafts/folder.py``).

This package imports the engine; the engine never imports it.
"""

from __future__ import annotations

from .spec import Example, Features, ProgressFn, TrainConfig, TrainResult
from .data import choose_vocab, generate, load_data, with_top1, work_dir
from .features import heldout_metrics as feature_heldout_metrics
from .features import losses as feature_losses
from .features import shift_own
from .folder import save
from .layers import heldout_metrics, kl_loss, tail, trunk_output
from .loop import run, train_draft
from .measure import measure
from .prompts import PROMPT_TEMPERATURE, load_prompts, prompt_ids, user_turn_prefix, write_prompts

__all__ = [
    "Example", "Features", "PROMPT_TEMPERATURE", "ProgressFn", "TrainConfig", "TrainResult", "choose_vocab",
    "feature_heldout_metrics", "feature_losses", "generate", "heldout_metrics", "kl_loss", "load_data", "load_prompts",
    "measure", "prompt_ids", "run", "save", "shift_own", "tail", "train_draft", "trunk_output", "user_turn_prefix",
    "with_top1", "work_dir", "write_prompts",
]
