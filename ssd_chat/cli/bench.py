"""The ``ssd-chat bench`` command: options, the plan, the race, and the report in the forms asked for."""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..bench import BenchError
from ..bench.machine import busy_note, machine_info
from ..bench.prompts import load_prompts
from ..bench.protocols import PROTOCOLS, Hardware, gpu_preset, make_plans
from ..bench.render import sampling_text
from ..bench.report import build_report, write_files
from ..bench.runner import DEFAULT_MAX_NEW, BenchSettings, ModelPool, run_bench
from .options import engine_options, fail, settings


def _parse_list(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(s.strip().lower() for s in value.split(",") if s.strip()))
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise typer.BadParameter(f"unknown {what} {', '.join(bad) or repr(value)} (use a comma list of {', '.join(allowed)})")
    return items


# --modes and --max-new-tokens are its own
@engine_options(exclude=("mode", "max_new_tokens", "system"))
def bench_command(
    modes: Annotated[str, typer.Option("--modes", help="Comma list of modes to race: ar, sd, ssd.")] = "ar,sd,ssd",
    prompts: Annotated[str, typer.Option("--prompts", help="Prompt set: all, or families (code,instructions,math,chat), or a .jsonl ({\"prompt\": ...} per line) / .txt (one per line) file.")] = "all",
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="At most N prompts per family (of a file: its first N).", show_default=False)] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help=f"New tokens per reply (default {DEFAULT_MAX_NEW}).", show_default=False)] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Write the full report (summaries, ratios, every run) as JSON.", show_default=False, dir_okay=False)] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot of the results.", show_default=False, dir_okay=False)] = None,
    markdown_file: Annotated[Optional[Path], typer.Option("--markdown", help="Write the summary as Markdown tables (for a document).", show_default=False, dir_okay=False)] = None,
    protocol: Annotated[str, typer.Option("--protocol", help="paper (SSD adds a device for the draft), equal (every mode gets the same hardware) or both.")] = "both",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per prompt and configuration.")] = 1,
    stop_at_eos: Annotated[bool, typer.Option("--stop-at-eos", help="End replies at EOS (default: ignore EOS and generate exactly --max-new-tokens, as the paper does).")] = False,
    preset: Annotated[Optional[str], typer.Option("--preset", help="gpu: a target/draft pair from the local HF cache, bf16, the draft on its own GPU.", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (models, placements, prompts) and an estimate of how long the run takes (the models load and each configuration decodes a few tokens), then exit without running the bench.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-run progress lines on stderr.")] = False,
    simulate: Annotated[Optional[str], typer.Option("--simulate", metavar="PROFILE", help="Race on simulated GPU hardware: the real decoders and speculator on small models, every forward padded to PROFILE's latency (h100-70b-1b, h200-8b-1b, rtx4090-8b-1b, or a .json file). Its figures are a simulation, never a GPU measurement.", show_default=False)] = None,
    acceptance: Annotated[str, typer.Option("--acceptance", help="With --simulate: the per-token acceptances to sweep (the draft is calibrated to each).")] = "0.5,0.6,0.7,0.8,0.9",
    against: Annotated[Optional[tuple[str, str]], typer.Option("--against", metavar="llama.cpp PATH", help="Also time llama.cpp's llama-bench (PATH: the binary or its build folder) on the same GGUF, cores and token count, and report the ratios.", show_default=False)] = None,
    *, given: dict[str, Any],
) -> None:
    """Race AR, SD and SSD on the same prompts, models and hardware; report tok/s, TTFT, acceptance and ratios.

    Exit status: 0 on success, 2 on bad usage, 1 on a failure, 3 when a greedy SD/SSD reply differs from AR's.
    """
    from rich.console import Console

    from ..bench import llamacpp
    from ..engine import ModelError, resolve_model as resolve

    named = set(given)  # the options given (and the app's, before the subcommand)
    mode_list = _parse_list(modes, ("ar", "sd", "ssd"), "mode")
    protos = PROTOCOLS if protocol.strip().lower() == "both" else _parse_list(protocol, PROTOCOLS, "protocol")
    if preset is not None and preset.strip().lower() != "gpu":
        raise typer.BadParameter(f"unknown preset '{preset}' (the only preset is gpu)", param_hint="--preset")
    max_new = max_new_tokens or given.get("max_new_tokens") or DEFAULT_MAX_NEW
    console = Console() if sys.stdout.isatty() else Console(width=120)  # a log or a pipe: room for the tables
    err = Console(stderr=True)
    if simulate is not None:
        from ..bench.simulate import command as simulated

        models = sorted(named & {"target", "draft", "target_device", "draft_device", "dtype", "compile"})
        if models or preset or against:
            raise fail(f"--simulate runs its own small models on simulated hardware; {', '.join(models) or 'preset/against'} does not apply", 2)
        raise typer.Exit(simulated(simulate, acceptance, limit or 4, max_new_tokens or 128, given.get("seed") or 0,
                                   json_file, plot_file, markdown_file, console, err, quiet, dry_run))
    try:
        prompt_list, prompt_source = load_prompts(prompts, limit)
        from ..chat.settings import ConfigError

        try:
            values = settings(given)
        except ConfigError as e:
            raise BenchError(str(e)) from None
        hw = Hardware.detect()
        notes: list[str] = []
        if preset is not None:
            values, notes = gpu_preset(values, named, hw)
        plans, more = make_plans(protos, mode_list, values.get("target_device") or "auto", values.get("draft_device") or "auto", hw)
        notes += more
        if against is not None:
            llama_exe = llamacpp.check_against(against[0], against[1], resolve(values["target"]))
    except (BenchError, llamacpp.LlamaCppError, ModelError) as e:
        raise fail(str(e)) from None
    race = BenchSettings(
        modes=mode_list, protocols=protos, max_new_tokens=max_new, repeats=repeats,
        sampling=replace(values["sampling"], ignore_eos=not stop_at_eos),
    )
    if dry_run:
        console.print(f"target {values['target']}, draft {values.get('draft') or '(default for the target)'}, dtype {values.get('dtype') or 'auto'}, "
                      f"{len(prompt_list)} prompts from {prompt_source}, {max_new} new tokens, {repeats} repeat(s), "
                      f"{sampling_text(asdict(race.sampling))}")
        for proto in protos:
            console.print(f"protocol {proto}: " + "; ".join(f"{p.mode.upper()}: {p.describe()}" for p in plans if p.protocol == proto))
        for n in notes:
            console.print(f"note: {n}")
        raise typer.Exit(_estimate(values, plans, prompt_list, race, console, err, quiet, against is not None))
    from ..chat.loading import quiet_libraries
    from ..engine import SSDChatError

    pool = None
    try:
        quiet_libraries()
        machine = machine_info(hw)  # before the run: its load average says how quiet the machine was
        busy = busy_note(machine, hw)
        if busy:
            notes.append(busy)
            err.print(f"[yellow]note[/]: {busy}")
        pool = ModelPool(values, plans, progress=None if quiet else (lambda s: err.print(f"[dim]{s}…[/]")))
        base_cfg = pool.base_config
        result = run_bench(base_cfg, pool.models_for, prompt_list, plans, race,
                           progress=(lambda s: None) if quiet else (lambda s: err.print(s, highlight=False)))
    except (BenchError, SSDChatError) as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    models = pool.describe()
    report = build_report(result, plans, race, prompt_list, prompt_source, models,
                          {"k": base_cfg.k, "fan_out": base_cfg.fan_out, "budget": base_cfg.budget, "saguaro_c": base_cfg.saguaro_c,
                           "fallback": base_cfg.fallback, "compile": base_cfg.compile}, machine, notes, pool.decode)
    from ..bench.plot import plot
    from ..bench.render import markdown, render

    versus, versus_error = [], None
    if against is not None:  # after ssd-chat's runs, on the cores each protocol gave AR
        try:
            versus = llamacpp.against(llama_exe, resolve(values["target"]).source, plans, report, max_new,
                                      None if quiet else (lambda s: err.print(f"[dim]{s}…[/]")))
        except llamacpp.LlamaCppError as e:  # ssd-chat's own results are still reported
            versus_error = str(e)
    render(report, console)
    for line in versus:
        console.print(line, highlight=False)
    for n in notes:
        console.print(f"note: {n}")
    write_files(report, console, json_file, plot_file, markdown_file, plot, markdown)
    failed = sum(m["failed"] for p in report["protocols"].values() for m in p["modes"].values())
    mismatched = any(p["exactness"]["checked"] and not p["exactness"].get("all_identical", True) for p in report["protocols"].values())
    if mismatched:
        err.print("[bold red]ssd-chat: error: greedy SD/SSD output differs from AR (see GREEDY MISMATCH above)[/]")
    if failed:
        err.print(f"[bold red]ssd-chat: error: {failed} run(s) failed (see the JSON for the messages)[/]")
    if versus_error:
        err.print(f"ssd-chat: error: {versus_error}", markup=False, highlight=False)
    raise typer.Exit(1 if failed or versus_error else 3 if mismatched else 0)


def _estimate(values: dict, plans: list, prompt_list: list, race: BenchSettings, console, err, quiet: bool, against: bool) -> int:
    """The dry run's estimate: load the models, probe each configuration briefly, print how long the race would take."""
    import time

    from ..bench.estimate import probe, render
    from ..chat.loading import quiet_libraries
    from ..engine import SSDChatError

    say = (lambda s: None) if quiet else (lambda s: err.print(f"[dim]{s}…[/]"))
    try:
        quiet_libraries()
        say("estimating: loading the models, then a short probe of each configuration")
        t0 = time.perf_counter()
        pool = ModelPool(values, plans, progress=None if quiet else say)
        est = probe(pool.base_config, pool.models_for, prompt_list, plans, race, load_s=time.perf_counter() - t0)
    except (BenchError, SSDChatError) as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    for line in render(est):
        console.print(line, highlight=False, markup=False)
    if against:
        console.print("(llama.cpp's runs for --against are not in the estimate)", highlight=False)
    return 0
