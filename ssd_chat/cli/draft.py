"""``ssd-chat draft``: train a draft for a target by distillation, and measure one.

    ssd-chat draft train --target smollm2-135m-gguf --out my-draft
    ssd-chat --mode sd --draft my-draft ask "Hi!"
    ssd-chat draft eval --draft my-draft
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .options import fail

draft_app = typer.Typer(name="draft", help="Train a small fast draft for a target (distillation), or measure one.",
                        no_args_is_help=True, add_completion=False, context_settings={"help_option_names": ["-h", "--help"]},
                        pretty_exceptions_enable=False)

TargetOpt = Annotated[Optional[str], typer.Option("--target", "-t", help="Target model (alias, hub id, folder, .gguf). Default: the configured target (smollm2-135m-gguf).", show_default=False)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch CPU threads (default: torch's choice).", show_default=False)]


def _target_name(ctx: typer.Context, target: str | None) -> str:
    if target:
        return target
    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    if obj.get("target"):
        return str(obj["target"])
    from ..engine import DEFAULT_TARGET

    return DEFAULT_TARGET


def _load_target(name: str, device: str, dtype: str, threads: int | None) -> Any:
    from ..chat.loading import quiet_libraries
    from ..engine import load_model, parse_placement

    if threads:
        import torch

        torch.set_num_threads(threads)
    quiet_libraries()
    return load_model(name, parse_placement(device, dtype))


def _init_from(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a comma-separated list of layer numbers", param_hint="--init-from") from None


@draft_app.command("train")
def train(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the draft to (manifest + its own weights).")],
    target: TargetOpt = None,
    kind: Annotated[str, typer.Option("--kind", help="features: one layer over the target's own hidden states (EAGLE-style, SD only); layers: shared first layers + trained layers (SD and SSD).")] = "layers",
    chain: Annotated[bool, typer.Option("--chain/--no-chain", help="--kind features: also train on the draft's own hidden states, as when it drafts several tokens in a row (about 1.5x the training time).")] = False,
    fuse_layer: Annotated[Optional[int], typer.Option("--fuse-layer", min=0, help="--kind features: also read the output of the target's first N layers, fused with its final hidden state (EAGLE-3-style; e.g. 15 of 30).", show_default=False)] = None,
    feature_noise: Annotated[float, typer.Option("--feature-noise", min=0.0, help="--kind features: amplitude of the uniform noise added to the input features in training (EAGLE's augmentation; 0: none).")] = 0.0,
    layers: Annotated[int, typer.Option("--layers", min=0, help="Target layers shared (frozen) at the bottom of the draft (--kind layers).")] = 2,
    init_from: Annotated[Optional[str], typer.Option("--init-from", help="Target layers copied as the draft's new trained layers, e.g. '29' or '2,29' (default: the target's last two layers; with --kind features its last layer).", show_default=False)] = None,
    vocab: Annotated[int, typer.Option("--vocab", min=2, help="Size of the draft's reduced vocabulary (tokens the target emits most).")] = 8192,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 480,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Answers per step.")] = 16,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="Peak learning rate (AdamW, warm-up then cosine).")] = 3e-3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest target answer generated per training prompt.")] = 128,
    gen_batch: Annotated[int, typer.Option("--gen-batch", min=1, help="Prompts the target answers at once.")] = 128,
    samples: Annotated[int, typer.Option("--samples", min=0, help="Sampled answers per training prompt, besides the greedy one (more varied contexts; each round is cached).")] = 5,
    self_prompts: Annotated[int, typer.Option("--self-prompts", min=0, help="Extra training prompts the target writes itself (user turns sampled under its chat template; cached), each answered greedily: more distinct contexts than the packaged set.")] = 0,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Temperature of the sampled training answers.")] = 0.8,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Training prompts, JSON lines with a \"prompt\" field (default: the packaged set).", show_default=False)] = None,
    heldout: Annotated[Optional[Path], typer.Option("--heldout", help="Held-out prompts for the agreement shown while training (default: the packaged set).", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for initialisation, batch order and sampled answers.")] = 0,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="Steps between held-out evaluations and checkpoints.")] = 25,
    work: Annotated[Optional[Path], typer.Option("--work", help="Cache for answers, teacher states and the checkpoint (default: under the ssd-chat cache dir). A rerun resumes from it.", show_default=False)] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Ignore cached answers and checkpoint; start over.")] = False,
    device: Annotated[str, typer.Option("--device", help="Where the target runs and the draft trains (auto, cpu, cuda:N).")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Target dtype (auto: fp32 on CPU, bf16 on GPU).")] = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Train a draft for TARGET by distillation and save it in OUT.

    The draft shares the target's embedding and first --layers layers (rebuilt from the
    target when loaded, never saved), adds trained layers and a head over a reduced
    vocabulary.  Use it with --draft OUT.  Rerunning the same command resumes.
    """
    from .. import train as training
    from ..engine import SSDChatError

    name = _target_name(ctx, target)
    try:
        cfg = training.TrainConfig(
            kind=kind, chain=chain, num_shared=layers, init_from=_init_from(init_from), num_vocab=vocab, steps=steps, batch_size=batch_size,
            lr=lr, max_new_tokens=max_new_tokens, gen_batch=gen_batch, temperature=temperature, samples=samples, self_prompts=self_prompts, eval_every=eval_every, seed=seed,
            fuse_layer=fuse_layer, feature_noise=feature_noise,
        )
        train_prompts = training.load_prompts(prompts)
        held_prompts = training.load_prompts(heldout, heldout=True)
        tgt = _load_target(name, device, dtype, threads)
        with _Progress() as bar:
            result, work_path = training.run(tgt, out, cfg, train_prompts, held_prompts, work, fresh, bar.update)
    except SSDChatError as e:
        raise fail(e) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted; rerun the same command to resume", err=True)
        raise typer.Exit(130) from None
    typer.echo(
        f"draft saved to {out}  (held-out teacher-forced agreement {result.heldout_agreement:.1%}, "
        f"reduced vocabulary covers {result.vocab_coverage:.1%} of held-out answer tokens)\n"
        f"use it with: ssd-chat --target {name} --mode sd --draft {out}\n"
        f"measure it with: ssd-chat draft eval --target {name} --draft {out}\n"
        f"training cache: {work_path}"
    )


@draft_app.command("eval")
def evaluate(
    ctx: typer.Context,
    draft: Annotated[str, typer.Option("--draft", "-d", help="The draft: a trained draft folder, or copy, int8, layers:N.")],
    target: TargetOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts, JSON lines (default: the packaged held-out set).", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Greedy tokens per prompt.")] = 128,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N prompts.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers as one JSON object.")] = False,
    threads: ThreadsOpt = None,
) -> None:
    """Greedy agreement of DRAFT with the target in real (cached, token by token) decoding,
    and the cost of a draft step relative to a target step timed back to back."""
    from .. import train as training
    from ..engine import derive_draft, is_derived, ParamError, SSDChatError

    name = _target_name(ctx, target)
    try:
        texts = training.load_prompts(prompts, heldout=True)[:limit]
        tgt = _load_target(name, "cpu", "float32", threads)
        if not is_derived(draft):
            raise ParamError(f"'{draft}' is not a derived or trained draft (use copy, int8, layers:N or a draft folder)")
        d = derive_draft(draft, tgt)
        stats = training.measure(tgt, d, texts, max_new_tokens)
    except SSDChatError as e:
        raise fail(e) from None
    if json_out:
        typer.echo(json.dumps({"target": name, "draft": draft, **stats}))
        return
    typer.echo(
        f"{draft} on {name}: {stats['num_prompts']} prompts, {stats['num_tokens']} greedy tokens\n"
        f"  agreement (incremental, greedy top-1; a feature draft: the first token of a round): {stats['agreement']:.1%}\n"
        f"  draft step / target step: {stats['draft_cost']:.1%} ({stats['draft_step_ms']:.1f} ms / {stats['target_step_ms']:.1f} ms, timed back to back)\n"
        f"  greedy SD tokens per target forward: k=2 {stats['tokens_per_round_k2']:.2f}, k=4 {stats['tokens_per_round_k4']:.2f}\n"
        f"  acceptance of a draft token after accepted ones: k=2 {stats['acceptance_k2']:.1%}, k=4 {stats['acceptance_k4']:.1%}"
    )


class _Progress:
    """A rich progress bar per stage, with the latest loss and held-out agreement (stderr)."""

    def __enter__(self) -> "_Progress":
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=Console(stderr=True), disable=not sys.stderr.isatty(),
        )
        self._progress.__enter__()
        self._tasks: dict[str, Any] = {}
        return self

    def update(self, stage: str, done: int, total: int, info: dict[str, float]) -> None:
        text = "  ".join(
            f"{label} {info[key]:{fmt}}" for key, label, fmt in (("loss", "loss", ".4f"), ("agreement", "held-out agreement", ".1%"), ("agreement_own", "on own features", ".1%")) if key in info
        )
        new = stage not in self._tasks
        if new:
            self._tasks[stage] = self._progress.add_task(stage, total=total, completed=done, info=text)
        self._progress.update(self._tasks[stage], completed=done, total=total, info=text)
        if sys.stderr.isatty():
            return
        if stage == "training":  # a log (not a terminal): one line per held-out evaluation ...
            if "agreement" in info and done % 25 == 0:
                sys.stderr.write(f"step {done}/{total}  {text}\n")
        elif new or done >= total:  # ... and where each data stage starts and ends
            sys.stderr.write(f"{stage}: {done}/{total}\n")

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)
