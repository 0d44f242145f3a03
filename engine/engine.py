"""The engine facade: load target (and draft), pick a decoder by mode, stream events."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from .config import EngineConfig
from .decode.ar import ARDecoder
from .drafts import gguf as gguf_drafts, shipped as drafts
from .drafts.drafter import is_feature_draft
from .drafts.shipped import check_draft_for_mode, default_draft
from . import processes
from .errors import NotCachedError, ParamError
from .events import Event
from .load import chat, models, pair, precision
from .params import SamplingParams
from .tp import load as tp_load


def _sd(e: "Engine") -> Any:
    from .decode.sd import SDDecoder

    return SDDecoder(e)


def _ssd(e: "Engine") -> Any:
    from .decode.ssd import SSDDecoder

    return SSDDecoder(e)


# mode -> factory(engine) -> decoder with .stream(prompt_ids, params, stop) and optional .close()
DECODERS: dict[str, Callable[["Engine"], Any]] = {"ar": lambda e: ARDecoder(e.target, e.config.compile), "sd": _sd, "ssd": _ssd}


class Engine:
    def __init__(self, config: EngineConfig, target: models.LoadedModel, draft: models.LoadedModel | None = None,
                 mode_reason: str | None = None) -> None:
        if config.mode == "auto":
            raise ParamError("mode 'auto' is resolved before loading: use Engine.load, or preflight.check(config).config")
        check_draft_for_mode(config.mode, draft)
        self.config = config
        self.target = target
        self.draft = draft
        self.loaded_mode = config.mode
        self.mode_reason = mode_reason  # why ``auto`` chose this mode (preflight, probe); shown while auto is in force
        # auto's choice for these models here, (mode, why), once known: ``reconfigure(mode="auto")`` goes back to it
        self.auto_choice: tuple[str, str] | None = (config.mode, mode_reason) if mode_reason is not None else None
        self.auto = self.auto_choice is not None  # the mode in force is auto's (not one the user switched to)
        self._decoder: Any = None
        self._decoder_key: tuple | None = None
        self.measurer: Any = None  # auto's background measurer process (engine/startup/probe.py), while it runs
        self.measure_later: tuple[EngineConfig, int] | None = None  # what it is to measure, and the key's lock, until loaded
        self.measure = "no"  # how auto gets a measurement it lacks (Engine.load's ``measure``), for /mode auto later
        if target.forwards.sharded is None and target.device.type == "cpu":  # auto builds its CPU graphs in the background
            target.forwards.source = lambda: _rebuild(target)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def load(cls, config: EngineConfig, progress: models.ProgressFn = models._no_progress, tqdm_class: Any = None,
             warn: Callable[[str], None] | None = None, measure: str = "no") -> "Engine":
        """Check what can be checked (:func:`preflight.check`: ``auto``, devices, draft against mode, sizes;
        ``warn`` hears its warnings before any download), then load the models.  ``measure``: how ``auto``
        gets a measurement this setup has none of (:func:`probe.settle`: "no", "background", "now")."""
        from .startup.preflight import check

        asked, pre = config, check(config)
        for w in pre.warnings:
            (warn or (lambda _m: None))(w)
        config, draft_name = pre.config, pre.draft
        tplace = models.parse_placement(config.target_device, config.dtype)
        if config.needs_draft and config.mode not in DECODERS:
            raise ParamError(f"mode '{config.mode}' is not available in this version")
        # target and draft together, before any download: offline, one message names every missing model
        pair_draft = draft_name if draft_name is not None and not drafts.is_derived(draft_name) else None
        missing = pair.check(config.target, pair_draft)
        try:
            return cls._load(config, asked, pre, tplace, draft_name, progress, tqdm_class, measure)
        except NotCachedError as e:  # no network: the hub could not be asked for the models that are missing
            if not missing:
                raise
            raise NotCachedError(pair.message(missing, config.target, pair_draft)) from e

    @classmethod
    def _load(cls, config: EngineConfig, asked: EngineConfig, pre: Any, tplace: Any, draft_name: str | None,
              progress: models.ProgressFn, tqdm_class: Any, measure: str) -> "Engine":
        dplace = None
        if draft_name is not None:
            if not drafts.is_derived(draft_name):
                dplace = models.parse_placement(config.draft_device, config.dtype, "--draft-device")
                # compare vocabularies before any weights are loaded
                tspec, dspec = models.resolve(config.target), models.resolve(draft_name)
                progress("checking tokenizers", None)
                ttok = models.load_tokenizer(models.tokenizer_folder(tspec, tqdm_class), config.trust_remote_code)
                dtok = models.load_tokenizer(models.tokenizer_folder(dspec, tqdm_class), config.trust_remote_code)
                models.check_same_vocab(config.target, ttok, draft_name, dtok)
        if config.mode == "ssd":
            processes.warm()  # the speculator's imports run on another core while the models load
        if tplace.ranks:  # tensor parallelism: the weights load in the rank processes
            rows = (1, config.k + 1)
            target = tp_load.load_sharded(config.target, tplace, config.compile, rows, config.trust_remote_code, progress, tqdm_class)
        else:
            target = precision.load_with_precision(config.target, tplace, config.dtype, config.trust_remote_code, progress, tqdm_class)
        draft = None
        try:
            if draft_name is not None:
                progress(f"preparing draft {draft_name}", None)
                if drafts.is_derived(draft_name):  # in the target's precision
                    draft = gguf_drafts.derive(draft_name, tp_load.draft_base(target, config.draft_device, progress))
                else:
                    assert dplace is not None
                    draft = precision.load_with_precision(draft_name, dplace, config.dtype, config.trust_remote_code, progress, tqdm_class)
        except BaseException:
            target.forwards.close()  # no rank outlives a load that failed
            raise
        engine = cls(config, target, draft, pre.reason if pre.auto else None)
        engine.measure = measure
        if pre.probe:  # auto with a draft: the mode that measured fastest here (engine/startup/probe.py)
            from .startup.probe import settle

            try:
                settle(engine, draft_name, pre.probe, progress, measure, source=asked)
            except BaseException:
                engine.close()
                raise
        engine.warm(progress)
        engine._start_measurer()  # after warm: the measurer does not compile AR's graph beside it
        return engine

    def _start_measurer(self) -> None:
        if self.measure_later is not None and self.measurer is None:
            from .startup.probe import start_measurer

            self.measurer, self.measure_later = start_measurer(self.measure_later), None

    def settle(self, mode: str, reason: str, decoder: Any = None) -> None:
        """Take ``auto``'s measured choice: ``mode``, why, and the probe's decoder for it (a started speculator)."""
        if self._decoder is not None and self._decoder is not decoder and hasattr(self._decoder, "close"):
            self._decoder.close()
        self.config = replace(self.config, mode=mode)
        self.loaded_mode, self.mode_reason = mode, reason
        self.auto_choice, self.auto = (mode, reason), True
        self._decoder, self._decoder_key = (decoder, (mode, self.config)) if decoder is not None else (None, None)

    def warm(self, progress: models.ProgressFn = models._no_progress) -> None:
        """On CPU, compile (the first time on this machine) or load the target's graphs for this mode
        now, behind the load's progress, so that the first reply does not wait for them."""
        cfg = self.config
        if cfg.compile not in ("on", "auto") or self.target.device.type != "cpu" or self.target.forwards.sharded is not None:
            return
        if cfg.mode == "sd" and self.draft is not None and is_feature_draft(self.draft.model):
            return  # SD's target runner then also returns hidden states: its own core, made at the first reply
        rows = (1,) if cfg.mode == "ar" else (cfg.k + 1,)
        core = getattr(self.target.forwards.runner("target", cfg.compile, rows), "core", None)
        if core is None:
            return
        where = contextlib.nullcontext()
        if cfg.mode == "ssd":  # the verifier's cores and threads: a graph is built for a thread count
            from .speculate.plan import plan
            from .threads import pinned

            p = plan(cfg, self.target.device, self.target.placement.cores)
            where = pinned(p.target_cores, p.target_threads)
        if core.compiler.background:  # packages on disk load now; a missing one builds while replies run eagerly
            with where:
                core.compiler.warm()
            said = self.target.forwards.status()
            if said:
                progress(said, None)
            return
        said = core.compiler.progress
        core.compiler.progress = lambda text: progress(text, None)
        try:
            with where:
                core.warm()
        finally:
            core.compiler.progress = said

    # -- use ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def prompt_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], tuple[str, ...]]:
        return chat.prompt_ids(self.tokenizer, messages)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling settings of a reply whose user set none (:mod:`gen_defaults`)."""
        from .load.gen_defaults import for_model

        return for_model(self.target.folder)[0]

    def describe(self) -> dict[str, Any]:
        """What is in use now, for a status panel: mode, k, fan-out, the models and where they run (for SSD,
        where its placement puts the speculator and pins the verifier), whether ``auto`` chose the mode and
        why (a later switch is its own reason), and ``settings``: mode, k and fan-out as set (k and fan-out
        apply once SD / SSD run, so a settings dialog in AR can show them)."""
        c = self.config
        uses_draft = c.mode != "ar" and self.draft is not None
        out: dict[str, Any] = {
            "mode": c.mode, "k": c.k if c.mode != "ar" else None, "fan_out": c.fan_out if c.mode == "ssd" else None,
            "auto": self.auto, "mode_reason": self.mode_reason if self.auto else None,
            "settings": {"mode": c.mode, "k": c.k, "fan_out": c.fan_out},
            "target": self.target.name, "target_device": precision.where(self.target),
            "draft": self.draft.name if uses_draft else None,
            "draft_device": precision.where(self.draft) if uses_draft else None,
            # what forwards each model (forward.LABELS): what ran last, else what will run
            "forward": self.target.forwards.label("target", c.compile),
            "draft_forward": self._draft_forward() if uses_draft else None,
            # what the linears compute in: "gguf Q4_1" (the GGUF's blocks) or the dtype ("float32")
            "precision": precision.of(self.target), "draft_precision": precision.of(self.draft) if uses_draft else None,
            # the last reply's path ("compiled" | "eager"), and a background compile under way ("... 40%")
            "path": self.target.forwards.path("target"), "compiling": self.target.forwards.status(),
        }
        if c.mode == "ssd":  # the speculator runs where the SSD decoder's plan puts it, not where the draft was loaded
            from .decode.ssd import plan

            p = plan(c, self.target.device, self.target.placement.cores)
            cores = f" (cores {','.join(map(str, p.draft_cores))})" if p.draft_cores else ""
            out["draft_device"] = (f"speculator on {p.draft_device}{cores}, {out['draft_precision']}"
                                   + (", shared with the target" if p.shared else ""))
            if p.target_cores and not self.target.placement.ranks:
                out["target_device"] = f"{self.target.placement.device} (cores {','.join(map(str, p.target_cores))}) {out['precision']}"
        return out

    def _draft_forward(self) -> str:
        reported = getattr(self._decoder, "speculator_forward", None) if self.config.mode == "ssd" else None
        if reported:  # the SSD speculator's draft, as its process reported
            return reported
        return self.draft.forwards.label("draft", self.config.compile)

    def reconfigure(self, **changes: Any) -> None:
        """Change mode / k / fan-out / ... between replies (models stay loaded; switching from AR
        to SD/SSD without a draft derives the default one from the target).  ``mode="auto"`` goes back
        to the mode ``auto`` chose for these models on this machine (:meth:`_auto`)."""
        if changes.get("mode") == "auto":
            self._auto(changes)
            return
        self._switch(**changes)
        if "mode" in changes:
            self.auto = False

    def _auto(self, changes: dict[str, Any]) -> None:
        """The mode auto chose at load; for an engine loaded with a mode named, the same resolution now:
        :func:`preflight.check`, then for a draft the probe's stored choice (AR, saying so, while none is stored)."""
        others = {k: v for k, v in changes.items() if k != "mode"}
        if self.auto_choice is None:
            from .startup.preflight import check

            asked = replace(self.config, **others, mode="auto")
            pre = check(asked)
            if pre.probe:
                from .startup.probe import settle

                self._switch(**others, mode=pre.config.mode)  # its draft (derived now if none is loaded)
                # sets auto_choice; the app and serve measure a setup with no record in the background
                settle(self, pre.draft, pre.probe, models._no_progress, self.measure, source=asked)
                self._start_measurer()
                return
            self.auto_choice = (pre.config.mode, pre.reason)
        mode, reason = self.auto_choice
        self._switch(**others, mode=mode)
        self.mode_reason, self.auto = reason, True

    def _switch(self, **changes: Any) -> None:
        new = replace(self.config, **changes)
        draft = self.draft
        if new.needs_draft and draft is None:
            # started in AR without --draft: the default draft is derived from the loaded target
            # (the shipped trained draft, or the int8 copy), so it can be made now
            name = new.draft or default_draft(new.target)
            if not drafts.is_derived(name):
                raise ParamError(f"mode '{new.mode}' needs the draft '{name}' loaded; restart with --mode {new.mode} --draft {name}")
            draft = gguf_drafts.derive(name, tp_load.draft_base(self.target, new.draft_device))
        check_draft_for_mode(new.mode, draft)
        self.draft = draft
        self.config = new

    def new_decoder(self, mode: str) -> Any:
        """A decoder of its own for ``mode`` (the mode probe times each mode with one)."""
        return DECODERS[mode](self)

    def decoder(self) -> Any:
        key = (self.config.mode, self.config)
        if self._decoder is None or self._decoder_key != key:
            if self._decoder is not None and hasattr(self._decoder, "close"):
                self._decoder.close()
            if self.config.mode not in DECODERS:
                raise ParamError(f"mode '{self.config.mode}' is not available in this version")
            self._decoder = DECODERS[self.config.mode](self)
            self._decoder_key = key
        return self._decoder

    def stream(self, prompt_ids: list[int], params: SamplingParams, stop: threading.Event | None = None) -> Iterator[Event]:
        return self.decoder().stream(prompt_ids, params, stop)

    def close(self) -> None:
        """Stop the speculator, any tensor-parallel ranks (a later reply starts them again) and auto's measurer."""
        if self.measure_later is not None and self.measure_later[1] >= 0:  # a load that did not finish
            os.close(self.measure_later[1])
            self.measure_later = None
        if self.measurer is not None:
            self.measurer.kill()  # a measurement cut short stores nothing
            self.measurer.wait()
            self.measurer = None
        if self._decoder is not None and hasattr(self._decoder, "close"):
            self._decoder.close()
        self._decoder = None
        self.target.forwards.close()
        if self.draft is not None:
            self.draft.forwards.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rebuild(target: models.LoadedModel) -> tuple[Callable, Any]:
    """(make, recipe): how a background compile process rebuilds ``target`` (as the SSD speculator does its draft)."""
    from .speculate.process import build_model, recipe_for

    return build_model, recipe_for(target, target, "cpu", target.placement.dtype)
