"""A tensor-parallel target: its config and tokenizer in this process, its weights split over ranks.

:func:`load_sharded` loads rank 0's shard in this process and ranks 1..N-1 in worker processes,
each reading only its part of the safetensors.  The :class:`models.LoadedModel` it returns holds a
weightless (``meta``) copy of the model for what the decoders read without running it (config,
vocabulary, parameter count); its handle runs it on the :class:`Sharded` it holds, so AR, SD and
SSD's verifier need no tensor-parallel code of their own.  If a rank dies or hangs, the reply ends
with one error line and every rank is closed; the next reply starts them again.

A draft derived from the target (``trained``, ``int8``, ``layers:N``, ``copy``) needs the whole
target's weights, which no rank has: :func:`draft_base` loads them once more, on the draft's
device.  For a large target, name a small model of its family as the draft instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..load import models
from ..load.devices import Placement, parse_placement
from ..model import runner as kv
from . import shard as tp_shard


class Sharded:
    """The :class:`tp.TPCore` behind a tensor-parallel target; started again after its ranks were lost."""

    fault: dict[int, str] | None = None  # test hook for the first start: {rank: "exit:N"} (tp.TPCore)

    def __init__(self, folder: str, placement: Placement, name: str, compile: str, rows: tuple[int, ...],
                 config: Any, progress: Callable[[str], None] | None = None) -> None:
        self.folder, self.placement, self.name, self.config = folder, placement, name, config
        # the core has no transformers path; "auto" is CUDA graphs on GPUs, eager on CPU (tp.TPCore)
        self.compile = "off" if compile == "transformers" else compile
        self.rows = rows
        self.base: models.LoadedModel | None = None  # the whole target, for derived drafts (draft_base)
        self._core = self._start(progress, self.fault)

    def _start(self, progress: Callable[[str], None] | None, fault: dict[int, str] | None = None) -> Any:
        from .core import TPCore

        p = self.placement
        return TPCore(self.folder, p.ranks or (), self.name, dtype=p.dtype, cores=p.rank_cores, compile=self.compile,
                      rows=self.rows, progress=progress, config=self.config, fault=fault)

    @property
    def world(self) -> int:
        return len(self.placement.ranks or ())

    def core(self, say: Callable[[str], None]) -> Any:
        """The running core; after a failure (its ranks closed), a new one."""
        if self._core.closed:
            self._core = self._start(None)
            say(f"started the {self.world} tensor-parallel ranks of {self.name} again (pid {', '.join(map(str, self._core.pids))})")
        return self._core

    @property
    def label(self) -> str:
        """What forwards the target: "core eager, 2 tensor-parallel ranks" (``auto`` as the core resolved it)."""
        return kv.tp_label("core compiled" if self._core.compile == "on" else "core eager", self.world)

    @property
    def pids(self) -> list[int]:
        """The rank processes (1..N-1) running now."""
        return [] if self._core.closed else self._core.pids

    def close(self) -> None:
        self._core.close()


def load_sharded(name: str, placement: Placement, compile: str, rows: tuple[int, ...], trust_remote_code: bool = False,
                 progress: models.ProgressFn = models._no_progress, tqdm_class: Any = None) -> models.LoadedModel:
    """Fetch ``name``, read its config and tokenizer here, and start its ranks (each loads its shard)."""
    t0 = time.perf_counter()
    spec = models.resolve(name)
    progress(f"fetching {name}", None)
    folder = models.model_folder(spec, progress, tqdm_class)  # a GGUF: its float32 safetensors copy
    progress(f"loading {name}", None)
    tokenizer = models.load_tokenizer(folder, trust_remote_code)
    lm = start(folder, placement, name, compile, rows, tokenizer, spec, progress)
    lm.load_s = time.perf_counter() - t0
    return lm


def start(folder: Any, placement: Placement, name: str, compile: str, rows: tuple[int, ...], tokenizer: Any,
          spec: models.ModelSpec | None = None, progress: models.ProgressFn = models._no_progress) -> models.LoadedModel:
    """The loaded target for the model folder ``folder`` (config.json + safetensors) split over
    ``placement.ranks``: a weightless copy here, run on the ranks this starts."""
    config = tp_shard.load_config(folder)
    skeleton = _skeleton(config, folder, placement.dtype)
    progress(f"starting {len(placement.ranks or ())} tensor-parallel ranks for {name}", None)
    sharded = Sharded(str(folder), placement, name, compile, rows, config, lambda line: progress(line, None))
    lm = models.LoadedModel(name=name, spec=spec or models.ModelSpec(name, "folder", str(folder)), model=skeleton,
                            tokenizer=tokenizer, placement=placement, folder=Path(folder),
                            eos_ids=models.eos_ids_of(skeleton, tokenizer))
    lm.forwards.sharded = sharded
    return lm


def _skeleton(config: Any, folder: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The model's modules with no weights (on ``meta``), and its generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        pass  # none in the folder: the one made from the config
    return model.eval()


def draft_base(target: models.LoadedModel, draft_device: str | None = "auto",
               progress: models.ProgressFn = models._no_progress) -> models.LoadedModel:
    """What a derived draft is made from: the target itself, or for a tensor-parallel target its whole
    weights loaded once more on the draft's device (the draft's own GPU, else the CPU)."""
    tp = target.forwards.sharded  # the ranks behind it, None if it runs in this process only
    if tp is None:
        return target
    if tp.base is None:
        from ..load.placement import plan_target

        plan = plan_target(",".join(tp.placement.ranks or ()) if tp.placement.device.type == "cuda" else "cpu", draft_device)
        where = "cpu" if plan.draft_device == "auto" else plan.draft_device
        progress(f"loading all of {target.name} on {where} for the derived draft", None)
        tp.base = models.load_model(target.name, parse_placement(where, str(tp.placement.dtype).removeprefix("torch."),
                                                           "--draft-device"), progress=progress)
    return tp.base
