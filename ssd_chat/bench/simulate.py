"""``ssd-chat bench --simulate PROFILE``: AR, SD and SSD on simulated GPU hardware.

The decoders, the speculator process, the channel and the cache are the real ones; the models are
small random Llamas whose forwards are padded to the profile's latency model (:mod:`engine.model.simulate`).
The draft is the target with calibrated noise on its weights, so that its greedy agreement with the
target (the per-token acceptance) is the one asked for.  Every figure this produces is a simulation,
and says so.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

VOCAB, HIDDEN, LAYERS = 128, 64, 2  # small enough that a forward computes well inside a modelled step
LABEL = "SIMULATED"


class Tokens:
    """Token i is one letter; enough for the decoders' text (the figures do not depend on it)."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def decode(self, ids: Any, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:  # noqa: ARG002
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(0x100 + i): i for i in range(self.vocab_size)}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:  # noqa: ARG002
        return {"input_ids": [(ord(c) - ord("a")) % self.vocab_size for c in text]}


def build_target(seed: int) -> torch.nn.Module:
    """A random Llama (float64: a verify's rows equal one-row steps) with an untied, sharpened head, so
    that its greedy text varies instead of repeating (a repeating target makes every draft right)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def perturbed(model: torch.nn.Module, eps: float, seed: int) -> torch.nn.Module:
    """A copy with Gaussian noise of ``eps`` times each weight's spread."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * eps * p.std())
    return out


@torch.inference_mode()
def agreement(target: torch.nn.Module, draft: torch.nn.Module, seqs: list[list[int]], starts: list[int]) -> float:
    """How often the draft's argmax equals the target's along ``seqs`` (teacher-forced), from ``starts``."""
    same = total = 0
    for seq, s in zip(seqs, starts):
        x = torch.tensor([seq])
        a = target(input_ids=x).logits[0, s - 1 : -1].argmax(-1)
        b = draft(input_ids=x).logits[0, s - 1 : -1].argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / max(1, total)


def calibrate(target: torch.nn.Module, alpha: float, seqs: list[list[int]], starts: list[int], seed: int) -> tuple[torch.nn.Module, float, float]:
    """The noise scale whose draft agrees with the target at rate ``alpha`` (bisection in log scale):
    (draft, eps, the agreement it measured)."""
    lo, hi = -4.0, 1.0  # log10 eps: 1e-4 agrees almost always, 10 almost never
    best: tuple[float, float] | None = None
    for _ in range(14):
        mid = (lo + hi) / 2
        got = agreement(target, perturbed(target, 10 ** mid, seed), seqs, starts)
        if best is None or abs(got - alpha) < abs(best[1] - alpha):
            best = (10 ** mid, got)
        lo, hi = (mid, hi) if got > alpha else (lo, mid)
    eps, got = best  # type: ignore[misc]
    return perturbed(target, eps, seed), eps, got


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in range(n)]


def _loaded(model: torch.nn.Module, name: str) -> Any:
    from ..engine import LoadedModel, ModelSpec, Placement

    return LoadedModel(name=name, spec=ModelSpec(name, "folder", name), model=model, tokenizer=Tokens(VOCAB),
                       placement=Placement(torch.device("cpu"), torch.float64))


def _decode(decoder: Any, prompt_list: list[list[int]], max_new: int) -> list[tuple[Any, list[Any]]]:
    """(Done, the reply's Round events) per prompt, greedy, EOS ignored."""
    from ..engine import Done, Error, Round, SamplingParams

    out = []
    for p in prompt_list:
        evs = list(decoder.stream(p, SamplingParams(temperature=0.0, max_new_tokens=max_new)))
        if not isinstance(evs[-1], Done):
            raise RuntimeError(evs[-1].message if isinstance(evs[-1], Error) else f"the reply ended with {evs[-1]!r}")
        out.append((evs[-1], [e for e in evs if isinstance(e, Round)]))
    return out


def _rate(replies: list[tuple[Any, list[Any]]]) -> float:
    """Pooled decode tok/s: tokens after the first over the time they took."""
    toks = secs = 0.0
    for done, _ in replies:
        st = done.stats
        if st.tok_per_s:
            toks += st.new_tokens - 1
            secs += (st.new_tokens - 1) / st.tok_per_s
    return toks / secs if secs else 0.0


def _ms(xs: list[float]) -> float | None:
    return round(1e3 * statistics.fmean(xs), 3) if xs else None


def overheads(prof: Any, k: int, rounds: list[list[Any]], ssd: bool) -> dict[str, Any]:
    """Per round, in ms: what is not a modelled forward (see docs/performance.md, "Simulated GPUs")."""
    tv = prof.target.ms(k + 1) / 1e3
    spec = (k + 1) * prof.draft.ms(1) / 1e3  # the speculator's glue and k tree depths
    inherent = (spec if prof.shared_device else max(0.0, spec - tv)) if ssd else 0.0
    walls, crit, sv, py, wait, busy, fb = [], [], [], [], [], [], []
    for reply in rounds:
        for prev, r in zip(reply, reply[1:]):  # the first round includes the prompt's prefill
            wall = r.t_s - prev.t_s
            walls.append(wall)
            w = r.wait_s or 0.0  # SSD: the wait for the drafts, a miss's fallback included
            drafting = r.draft_s if ssd else k * prof.draft.ms(1) / 1e3  # SSD: the fallback on a miss
            crit.append(wall - tv - inherent - drafting)
            sv.append(r.verify_s - tv)
            py.append(wall - r.verify_s - (w if ssd else r.draft_s))
            if ssd:
                wait.append(w - r.draft_s - inherent)
                fb.append(r.draft_s)
                if r.speculator_busy_s is not None:
                    busy.append(r.speculator_busy_s - spec)
            else:
                fb.append(r.draft_s - k * prof.draft.ms(1) / 1e3)
    out = {"rounds": len(walls), "round_ms": _ms(walls), "critical_path_overhead_ms": _ms(crit),
           "sampling_and_verify_ms": _ms(sv), "verifier_python_ms": _ms(py)}
    if ssd:
        out.update({"wait_beyond_model_ms": _ms(wait), "speculator_python_ms": _ms(busy), "fallback_ms": _ms(fb),
                    "inherent_wait_ms": round(inherent * 1e3, 3)})
    else:
        out["drafting_beyond_model_ms"] = _ms(fb)
    return out


def _harness_ms(pad: Any) -> float:
    """What one padded forward adds beyond its modelled time when it computes nothing (this machine's
    wake-up after a wait, the bookkeeping): part of every overhead figure, not of the decoders."""
    extra = []
    for _ in range(12):
        t0 = time.perf_counter()
        with pad.forward("harness", 1):
            pass
        extra.append(time.perf_counter() - t0 - pad.profile.draft.ms(1) / 1e3)
    pad.tallies.pop("harness", None)
    return round(1e3 * statistics.median(extra[2:]), 3)


def race(profile: str, alphas: list[float], n_prompts: int, max_new: int, seed: int,
         say: Callable[[str], None]) -> dict[str, Any]:
    """The whole simulated race: AR once, then SD and SSD at each acceptance."""
    from ..engine import simulate, ARDecoder, Engine, EngineConfig, SDDecoder, SSDDecoder

    prof = simulate.load_profile(profile)
    k = prof.k
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the models are tiny: one thread is fastest (and leaves a core to the speculator)
    work = tempfile.TemporaryDirectory(prefix="ssd-chat-sim-")
    pad = simulate.activate(profile, os.path.join(work.name, "device.lock"), os.path.join(work.name, "tallies"))
    os.mkdir(os.path.join(work.name, "tallies"))
    try:
        harness = _harness_ms(pad)
        target_m = build_target(seed)
        target = _loaded(target_m, "sim-target")
        plist = prompts(n_prompts, seed)
        say(f"{LABEL} {prof.name}: AR, {n_prompts} prompts x {max_new} tokens")
        ar = _decode(ARDecoder(target), plist, max_new)
        ar_ids = [d.token_ids for d, _ in ar]
        ar_rate = _rate(ar)
        seqs = [p + list(ids) for p, ids in zip(plist, ar_ids)]
        starts = [len(p) for p in plist]
        rows = []
        for alpha in alphas:
            draft_m, eps, agreed = calibrate(target_m, alpha, seqs, starts, seed + 1)
            draft = _loaded(draft_m, "sim-draft")
            row: dict[str, Any] = {"acceptance_asked": alpha, "noise_eps": round(eps, 6), "agreement_calibrated": round(agreed, 4)}
            for mode, make in (("sd", SDDecoder), ("ssd", SSDDecoder)):
                say(f"{LABEL} {prof.name}: {mode.upper()} at acceptance {alpha}")
                # a miss falls back to k draft steps (the paper's JIT backup), as the bound assumes
                cfg = EngineConfig(mode=mode, k=k, fan_out=prof.fan_out if mode == "ssd" else None, fallback="neural", compile="off")
                dec = make(Engine(cfg, target, draft))
                try:
                    got = _decode(dec, plist, max_new)
                finally:
                    close = getattr(dec, "close", None)
                    if close:
                        close()
                stats = [d.stats for d, _ in got]
                row[mode] = {
                    "tok_per_s": round(_rate(got), 2),
                    "greedy_equal_ar": [d.token_ids for d, _ in got] == ar_ids,
                    "acceptance": round(statistics.fmean(s.acceptance_rate or 0.0 for s in stats), 4),
                    "mean_accepted_length": round(statistics.fmean(s.mean_accepted_length or 0.0 for s in stats), 3),
                    "overhead": overheads(prof, k, [r for _, r in got], mode == "ssd"),
                }
                if mode == "ssd":
                    row[mode]["cache_hit_rate"] = round(statistics.fmean(s.cache_hit_rate or 0.0 for s in stats), 4)
            hit = row["ssd"]["cache_hit_rate"]
            b_sd = simulate.bounds(prof, row["sd"]["mean_accepted_length"], k, hit)
            b = simulate.bounds(prof, row["ssd"]["mean_accepted_length"], k, hit)
            row["bound"] = {"ar": round(b["ar"], 2), "sd": round(b_sd["sd"], 2), "ssd": round(b["ssd"], 2),
                            "ssd_all_hits": round(b["ssd_all_hits"], 2)}
            row["ratios"] = {"sd_over_ar": round(row["sd"]["tok_per_s"] / ar_rate, 3),
                             "ssd_over_ar": round(row["ssd"]["tok_per_s"] / ar_rate, 3),
                             "ssd_over_sd": round(row["ssd"]["tok_per_s"] / row["sd"]["tok_per_s"], 3),
                             "ssd_over_sd_bound": round(b["ssd"] / b_sd["sd"], 3)}
            rows.append(row)
        tallies = {"verifier": {role: t.as_dict() for role, t in pad.tallies.items()},
                   "speculators": simulate.child_tallies(os.path.join(work.name, "tallies"))}
    finally:
        simulate.deactivate()
        torch.set_num_threads(threads)
        work.cleanup()
    paper = prof.paper
    return {
        "kind": "simulation", "simulated": True, "label": f"{LABEL}: {prof.title}; not a GPU measurement",
        "profile": prof.describe(), "k": k, "fan_out": prof.fan_out, "prompts": n_prompts, "max_new_tokens": max_new,
        "seed": seed, "models": f"random Llama, {LAYERS} layers, hidden {HIDDEN}, vocabulary {VOCAB}, float64; the draft is the "
                                "target with calibrated weight noise",
        "ar": {"tok_per_s": round(ar_rate, 2), "bound": round(1e3 / prof.target.ms(1), 2),
               "overhead_ms_per_token": round(1e3 / ar_rate - prof.target.ms(1), 3) if ar_rate else None},
        "paper": None if not paper else {**paper, "sd_over_ar": round(paper["sd"] / paper["ar"], 3),
                                         "ssd_over_ar": round(paper["ssd"] / paper["ar"], 3),
                                         "ssd_over_sd": round(paper["ssd"] / paper["sd"], 3)},
        "rows": rows, "padding": tallies, "harness_ms_per_forward": harness, "total_s": round(time.perf_counter() - t_start, 1),
    }


def command(profile: str, acceptance: str, n_prompts: int, max_new: int, seed: int, json_file: Any, plot_file: Any,
            markdown_file: Any, console: Any, err: Any, quiet: bool, dry_run: bool = False) -> int:
    """``bench --simulate``: the exit status (0, 1 on a failure, 2 on bad usage, 3 when greedy SD/SSD differ from AR)."""
    from ..engine import simulate
    from ..chat.terminal import fail
    from . import sim_render
    from .report import write_files

    try:
        simulate.load_profile(profile)
        alphas = [float(a) for a in acceptance.split(",") if a.strip()]
        if not alphas or not all(0.0 < a < 1.0 for a in alphas):
            raise ValueError(acceptance)
    except simulate.ProfileError as e:
        raise fail(str(e), 2) from None
    except ValueError:
        raise fail(f"--acceptance takes a comma list of numbers in (0, 1), got '{acceptance}'", 2) from None
    if dry_run:
        sim_render.print_plan(simulate.load_profile(profile), alphas, n_prompts, max_new, console)
        return 0
    say = (lambda s: None) if quiet else (lambda s: err.print(f"[dim]{s}…[/]", highlight=False))
    try:
        report = race(profile, alphas, n_prompts, max_new, seed, say)
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        raise fail(f"the simulated race failed: {type(e).__name__}: {e}") from None
    sim_render.print_report(report, console)
    write_files(report, console, json_file, plot_file, markdown_file, sim_render.plot, sim_render.markdown)
    exact = all(r[m]["greedy_equal_ar"] for r in report["rows"] for m in ("sd", "ssd"))
    if not exact:
        err.print("[bold red]ssd-chat: error: a greedy SD/SSD reply differs from AR's in the simulated race[/]")
    return 0 if exact else 3
