"""Everything about an :class:`EngineConfig` that the arguments and this machine can settle before
any weight loads: which mode ``auto`` picks and why, the devices asked for, whether the draft suits
the mode, and models too large for this machine.  Loading a 135M model takes seconds and a 70B one
minutes to hours: a mistake found here costs the user nothing.

``auto`` loads for SSD when the machine has somewhere to put the speculator (a core set of its own
next to the target's, or a GPU of its own) and there is a draft for the target (one named with
``--draft``, or a trained one shipped for it); once loaded, :mod:`probe` keeps the mode that measured
fastest here (``Preflight.probe``: the modes it times).  Otherwise AR, with a reason that says what
would enable SSD.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelError, ParamError
from ..load import catalog, models

if TYPE_CHECKING:
    from ..config import EngineConfig


@dataclass(frozen=True, slots=True)
class Preflight:
    config: "EngineConfig"  # mode resolved: ar, sd or ssd
    draft: str | None  # the draft that will load (None in AR)
    reason: str  # one line: why this mode (for AR chosen by auto: what would enable SSD)
    auto: bool  # the mode was chosen by auto
    warnings: tuple[str, ...] = ()
    probe: tuple[str, ...] = ()  # auto with a draft: the modes to time once loaded (engine/startup/probe.py)


def draft_kind(name: str, target: str) -> str | None:
    """"layers", "features", "model" (a separate model) or "derived" (copy, int8, layers:N), from names and
    manifests only; a ModelError for a shipped alias that does not ship for ``target``."""
    from ..drafts import shipped as drafts
    from ..drafts.folder import is_draft_dir, read_manifest

    if name in drafts.SHIPPED:
        kinds = {kind for _, t, kind in drafts.shipped_drafts() if t == target}
        if drafts.SHIPPED[name] not in kinds:
            raise ModelError(
                f"no '{name}' draft ships for target '{target}'; drafts ship only for the packaged default model "
                f"({models.PACKAGED}); train one with `ssd-chat draft train --target {target} --out DIR` and pass --draft DIR")
        return drafts.SHIPPED[name]
    if is_draft_dir(name):
        return read_manifest(Path(name).expanduser()).get("kind", "layers")
    return "derived" if drafts.is_derived(name) else "model"


def _shipped_trained(target: str) -> bool:
    from ..drafts.shipped import SHIPPED, shipped_drafts

    return any(t == target and kind == SHIPPED["trained"] for _, t, kind in shipped_drafts())


def _speculator_place(config: "EngineConfig", tplace: models.Placement) -> tuple[bool, str]:
    """(whether SSD's speculator gets hardware of its own, a phrase saying where / why not)."""
    from ..speculate.plan import plan

    p = plan(config, tplace.device, tplace.cores)
    if not p.shared:
        cores = f" (core{'s' if len(p.draft_cores or ()) > 1 else ''} {','.join(map(str, p.draft_cores))})" if p.draft_cores else ""
        return True, f"speculator on {p.draft_device}{cores}"
    if tplace.device.type == "cuda":
        return False, ("this machine has one GPU, which the speculator would share with the target; "
                       "a second GPU (or --draft-device cpu) would enable SSD")
    if p.draft_device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if cores < 2:
            return False, ("this process has 1 CPU core, which the speculator would share with the target; "
                           "a second core (or a GPU) would enable SSD")
        return False, (f"--target-device {config.target_device} takes every CPU core, so the speculator would share them; "
                       "leaving it a core (e.g. --target-device cpu:0 --draft-device cpu:1) would enable SSD")
    return False, f"the speculator would share {p.draft_device} with the target; another device for --draft-device would enable SSD"


def check(config: "EngineConfig") -> Preflight:
    """Resolve ``auto`` and refuse what cannot work, before any weight loads (ParamError, DeviceError, ModelError)."""
    from ..drafts.shipped import default_draft

    tplace = models.parse_placement(config.target_device, config.dtype, "--target-device")
    tspec = models.resolve(config.target)
    if config.draft_device not in (None, "", "auto") and (config.mode != "ar" or config.draft):
        models.parse_placement(config.draft_device, config.dtype, "--draft-device")
    named = config.draft
    kind = draft_kind(named, config.target) if named else None
    warnings = _memory_warnings(tspec, tplace)
    if tplace.ranks and tplace.device.type == "cpu":
        from ..load.placement import CPU_TP_NOTE

        warnings.append(CPU_TP_NOTE)
    elif tplace.ranks:  # GPUs: the draft defaults to the first GPU the ranks leave; say what auto chose
        from ..load.placement import plan_target

        tp_plan = plan_target(config.target_device, config.draft_device)
        config = replace(config, draft_device=tp_plan.draft_device)
        if tp_plan.note:
            warnings.append(tp_plan.note)
    if config.mode == "auto":
        if named is None and not _shipped_trained(config.target):
            # the int8 copy (the default draft on the CPU) is not counted: drafting with it costs about as
            # much as verifying on the CPUs measured, and SSD lost to AR with it (docs/performance.md)
            int8 = (" other than its int8 copy (what --mode sd/ssd would use; on the CPUs measured it costs too much "
                    "of a target step for SSD to beat AR)") if tplace.device.type == "cpu" else ""
            mode, reason = "ar", (f"AR: no draft for {config.target}{int8}; SSD needs {'a cheaper one' if int8 else 'one'}: "
                                  "--draft MODEL (a small model with the same tokenizer) or a draft trained with `ssd-chat draft train`")
        elif kind == "features" and not tplace.ranks:
            mode, reason = "sd", f"SD: draft '{named}' reads the target's hidden states, which only SD provides"
        else:
            ok, where = _speculator_place(replace(config, mode="ssd"), tplace)
            draft = named or "trained"
            mode, reason = ("ssd", f"SSD: {where}, draft {draft}") if ok else ("ar", f"AR: {where}")
        config = replace(config, mode=mode)
        auto = True
        probe = ("ar", "sd", "ssd") if mode == "ssd" else ("ar", "sd") if mode == "sd" else ()
    else:
        auto, probe = False, ()
        reason = f"{config.mode.upper()}: set with --mode or in the settings"
    draft = (named or default_draft(config.target)) if config.needs_draft else None
    if draft is not None:
        kind = draft_kind(draft, config.target)
        if kind == "features" and tplace.ranks:
            raise ParamError(f"draft '{draft}' is a feature draft: it reads the target's hidden states, which a tensor-parallel "
                             "target does not return; use a model draft (e.g. --draft int8) or one device for the target")
        if config.mode == "ssd" and kind == "features":
            raise ParamError(
                f"draft '{draft}' is a feature draft: it reads the target's hidden states, which SSD's speculator does "
                "not have while it drafts ahead; use it with --mode sd, or use SSD with another draft (e.g. --draft int8)")
        if draft == "int8" and tplace.device.type != "cpu":
            raise ParamError("the 'int8' draft uses torch's dynamic quantization, which runs on CPU only; on a GPU "
                             "name a small model of the target's family as --draft")
        if kind == "model":
            dplace = models.parse_placement(config.draft_device, config.dtype, "--draft-device")
            warnings += _memory_warnings(models.resolve(draft), dplace)
    return Preflight(config, draft, reason, auto, tuple(warnings), probe)


def _memory_warnings(spec: models.ModelSpec, place: models.Placement) -> list[str]:
    if spec.kind != "hub":
        return []
    w = catalog.memory_warning(spec.name, spec.source, place.device, place.dtype, len(place.device_map or place.ranks or ()) or 1,
                               models.ALIASES)
    return [w] if w else []


def in_force(config: "EngineConfig") -> dict[str, object]:
    """The engine's values for the settings left unset (``None``): what ``ssd-chat config`` shows for them
    (the draft: None in AR, which loads none)."""
    from ..drafts.shipped import default_draft, label
    from ..fanout import DEFAULT_FAN_OUT, default_budget

    draft = (config.draft or default_draft(config.target)) if config.needs_draft else None
    return {
        "draft": draft, "k": config.k,
        "draft_label": label(draft, config.target) if draft else None,  # as the panel names it
        "fan_out": config.fan_out or DEFAULT_FAN_OUT, "budget": config.budget or default_budget(config.k),
        "saguaro_c": config.saguaro_c, "fallback": config.fallback, "compile": config.compile,
    }
