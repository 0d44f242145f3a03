"""The GPU readiness check: real-shaped random models, eager vs compiled, and what SSD would reach.

    python -m lab.gpucheck --out DIR [--cpu-smoke] [--budget-s 450]   (or: .ci/gpu-check DIR)

No real weights can travel to a lent GPU machine, so the check builds a Llama-3.1-8B-shaped
target and a Llama-3.2-1B-shaped draft with random bf16 weights on the device (their
configs are below) and measures, for the transformers path (eager, ``DynamicCache``), the
core uncompiled and the core compiled (CUDA graphs):

* per-forward cost: target 1 row and k+1 rows (verify); draft 1 row, the SSD glue (k+1
  rows) and the B-row tree step;
* the channel round trip (the real :class:`~ssd_chat.engine.speculate.channel.Channel` to a process);
* SSD's verifier wait per round (:mod:`lab.gpucheck_rounds`) with a draft identical to
  the rig's oracle (every round a hit) and with a perturbed one (misses);
* from those, the tok/s AR, SD and SSD would reach at the paper's acceptance rates, next to
  the paper's own numbers (Llama-3.1-70B/3.2-1B on H100s: not the same pair or hardware);
* the target through the tensor-parallel code path with one rank (:mod:`lab.gpucheck_tp`),
  against the plain core; with two or more GPUs also TP=2 (NCCL) on the draft-shaped model; with
  one GPU it says TP=2 did not run.

``--cpu-smoke`` runs the same steps with tiny shapes on the CPU in seconds (a test runs it,
so this script cannot rot while no GPU is lent).  The report (``report.md``, ``report.json``)
is rewritten after every step, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}, tie_word_embeddings=False)
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}, tie_word_embeddings=True)
SMOKE_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
SMOKE_DRAFT = dict(SMOKE_TARGET, num_hidden_layers=1, tie_word_embeddings=True)
# Llama-3.1-70B/3.2-1B, batch 1, greedy, averaged over four datasets (the paper's Fig. 7) and its
# cache-hit rate at T=0 with geometric fan-out (Fig. 4); acceptance rates were not published.
PAPER = {"ar": 54.7, "sd": 161.8, "ssd": 255.8, "hit_rate": 0.861}
ALPHAS = (0.6, 0.7, 0.8)


def build(cfg: dict, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **cfg)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
    with torch.no_grad():  # transformers leaves norms at 1: give them spread, so agreement is not trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def perturb(model: torch.nn.Module, eps: float, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * (eps * float(p.float().std())))


def median_ms(f: Callable[[], Any], reps: int, dev: torch.device) -> float:
    f()
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        f()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 3)


class HFPath:
    """The transformers forward on a DynamicCache (the app's path today), version-tolerant."""

    def __init__(self, model: torch.nn.Module, prompt: list[int]) -> None:
        from transformers import DynamicCache

        self.model, self.dev = model, next(model.parameters()).device
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:
            self.cache = DynamicCache()
        import inspect

        # transformers 5 renamed past_key_values to cache
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.n = 0
        self(prompt)
        self.n = len(prompt)

    @torch.inference_mode()
    def __call__(self, ids: list[int], tree: bool = False) -> None:
        x = torch.tensor([ids], device=self.dev)
        kw: dict[str, Any] = {"position_ids": torch.arange(self.n, self.n + len(ids), device=self.dev)[None]}
        if tree:  # B rows at one depth: the prefix and itself
            dtype = self.model.get_input_embeddings().weight.dtype
            m = torch.cat([torch.ones(len(ids), self.n, dtype=torch.bool, device=self.dev),
                           torch.eye(len(ids), dtype=torch.bool, device=self.dev)], dim=1)
            kw = {"position_ids": torch.full((1, len(ids)), self.n, device=self.dev),
                  "attention_mask": torch.zeros(m.shape, dtype=dtype, device=self.dev).masked_fill(~m, torch.finfo(dtype).min)[None, None]}
        self.model(input_ids=x, use_cache=True, logits_to_keep=0, **{self.cache_kw: self.cache}, **kw)
        if self.n:
            self._crop(self.n)

    def _crop(self, keep: int) -> None:
        from ssd_chat.engine.model import runner as kv

        try:
            kv.truncate(self.cache, keep)  # transformers 5: crop takes the count to remove
        except (ValueError, TypeError):
            self.cache.crop(keep)  # transformers 4: the length to keep


def echo_peer(conn: Any) -> None:
    """The far end of the channel round trip: answers pings and spec requests like the speculator."""
    from ssd_chat.engine.speculate.channel import Close, Ping, Pong, Speculation, Spec

    while True:
        msg = conn.recv()
        if isinstance(msg, Close):
            return
        if isinstance(msg, Ping):
            conn.send(Pong(msg.req))
        elif isinstance(msg, Spec):
            conn.send(Speculation(msg.req, (1, 2, 3, 4), False, True, None, 0.0, ((0, (5, 6)),), 0.0, 0.0))


def channel_rtt(k: int, vocab: int, reps: int) -> dict[str, float]:
    from ssd_chat.engine.speculate.channel import Channel

    ctx = torch.multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=echo_peer, args=(child,), daemon=True)
    proc.start()
    try:
        ch = Channel(parent, torch.zeros(k, vocab).share_memory_(), proc.sentinel)
        ch.ping(timeout=60)  # the child's start (imports)
        pings = [ch.ping() for _ in range(reps)]
        reqs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ch.request(k, 7, 0.0)
            ch.reply(timeout=10)
            reqs.append(time.perf_counter() - t0)
        return {"ping_us": round(statistics.median(pings) * 1e6, 1), "request_us": round(statistics.median(reqs) * 1e6, 1)}
    finally:
        from ssd_chat.engine.speculate.channel import Close

        parent.send(Close())
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


def projections(f: dict[str, Any], rounds: dict[str, Any], rtt_s: float, k: int) -> list[dict[str, Any]]:
    """tok/s at acceptance alpha (i.i.d.): AR = 1/t1; SD = E/(k t_draft + t_verify); SSD = E/(t_verify + wait),
    wait = p_hit * hit wait + (1 - p_hit) * miss wait (measured), p_hit the paper's; E = (1 - a^(k+1))/(1 - a)."""
    out = []
    for path in ("core compiled", "core eager", "transformers"):
        t1, tv, td = (f.get(f"{m} {path} ms") for m in ("target 1 row", "target verify", "draft 1 row"))
        if None in (t1, tv, td):
            continue
        hit, miss = rounds.get("identical", {}).get("wait_hit_ms"), rounds.get("perturbed", {}).get("wait_miss_ms")
        for a in ALPHAS:
            e = (1 - a ** (k + 1)) / (1 - a)
            row = {"path": path, "alpha": a, "ar": round(1e3 / t1, 1), "sd": round(1e3 * e / (k * td + tv), 1)}
            if path == rounds.get("path") and hit is not None and miss is not None:
                p = PAPER["hit_rate"]
                row["ssd"] = round(1e3 * e / (tv + p * hit + (1 - p) * miss + 1e3 * rtt_s), 1)
            out.append(row)
    return out


def write(out: Path, report: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# GPU check ({report['mode']})", "", f"{report.get('env', {})}", ""]
    if report.get("forwards"):
        lines += ["## Per-forward cost (ms, median)", "", "| forward | " + " | ".join(report["paths"]) + " |",
                  "|---|" + "---|" * len(report["paths"])]
        for name in report["forward_names"]:
            lines.append(f"| {name} | " + " | ".join(str(report["forwards"].get(f"{name} {p} ms", "—")) for p in report["paths"]) + " |")
        lines += ["", f"compile seconds (first call of each shape): {report.get('compile_s', {})}", ""]
    for key in ("notices", "channel", "rounds", "tp"):
        if report.get(key):
            lines += [f"## {key}", "", "```", json.dumps(report[key], indent=1), "```", ""]
    if report.get("projection"):
        lines += ["## Projected tok/s (i.i.d. acceptance alpha, the paper's hit rate)", "",
                  f"paper (Llama-3.1-70B/3.2-1B, H100s): AR {PAPER['ar']}, SD {PAPER['sd']}, SSD {PAPER['ssd']} tok/s "
                  f"(SD/AR {PAPER['sd'] / PAPER['ar']:.2f}, SSD/AR {PAPER['ssd'] / PAPER['ar']:.2f}, SSD/SD {PAPER['ssd'] / PAPER['sd']:.2f})",
                  "", "| path | alpha | AR | SD | SSD | SD/AR | SSD/AR | SSD/SD |", "|---|---|---|---|---|---|---|---|"]
        for r in report["projection"]:
            ssd = r.get("ssd")
            ratios = [f"{r['sd'] / r['ar']:.2f}", f"{ssd / r['ar']:.2f}" if ssd else "—", f"{ssd / r['sd']:.2f}" if ssd else "—"]
            lines.append(f"| {r['path']} | {r['alpha']} | {r['ar']} | {r['sd']} | {ssd or '—'} | " + " | ".join(ratios) + " |")
    lines += ["", f"total {report.get('total_s')} s"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (what the test suite runs)")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fan", type=int, default=2, help="candidates per acceptance length (B = fan * (k + 1))")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--compile", choices=("on", "off"), default="on")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ssd_chat.engine.model.core import Core

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("gpucheck: no CUDA GPU visible to torch; use --cpu-smoke for the CPU rehearsal", file=sys.stderr)
        return 1
    dev = torch.device("cpu" if smoke else "cuda:0")
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        args.prompt_len, args.reps, args.rounds = min(args.prompt_len, 48), min(args.reps, 3), min(args.rounds, 6)
    k, fan = args.k, args.fan
    B = fan * (k + 1)
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    report: dict[str, Any] = {"mode": "cpu-smoke" if smoke else "gpu", "k": k, "fan": fan, "B": B, "notices": [],
                              "paths": ["transformers", "core eager"] + (["core compiled"] if args.compile == "on" else []),
                              "forward_names": ["target 1 row", "target verify", "draft 1 row", "draft glue", "draft tree"],
                              "forwards": {}, "compile_s": {}}
    report["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "threads": torch.get_num_threads()}

    def note(s: str) -> None:
        report["notices"].append(s)
        print(f"gpucheck: {s}", file=sys.stderr, flush=True)

    from .gpucheck_rounds import Worker, run_rounds

    t0 = time.perf_counter()
    target = build(SMOKE_TARGET if smoke else LLAMA_31_8B, dtype, dev, seed=1)
    draft = build(SMOKE_DRAFT if smoke else LLAMA_32_1B, dtype, dev, seed=2)
    oracle = build(SMOKE_DRAFT if smoke else LLAMA_32_1B, dtype, dev, seed=2)  # the draft's twin: decides hits
    note(f"built target and draft ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B and "
         f"{sum(p.numel() for p in draft.parameters()) / 1e9:.2f}B parameters) in {time.perf_counter() - t0:.1f} s")
    prompt = [(i * 7919) % (target.config.vocab_size - 1) + 1 for i in range(args.prompt_len)]
    worker = Worker(dev)
    compile_mode = args.compile
    rows_t, rows_d = (1, k + 1), (1, k + 1, B)
    cores: dict[str, Any] = {}
    try:
        cores["target eager"] = Core(target, "target", lookahead=0)
        cores["target compiled"] = Core(target, "target", compile=compile_mode, rows=rows_t, notify=note, progress=note)
        cores["draft eager"] = worker.run(lambda: Core(draft, "draft"))
        cores["draft compiled"] = worker.run(lambda: Core(draft, "draft", compile=compile_mode, rows=rows_d, notify=note, progress=note))
        f = report["forwards"]
        # per-forward costs; the draft's compiled core only ever runs in the worker thread
        for who, model in (("target", target), ("draft", draft)):
            hf = HFPath(model, prompt)
            kinds = [("1 row", 1, False), ("verify", k + 1, False)] if who == "target" else \
                [("1 row", 1, False), ("glue", k + 1, False), ("tree", B, True)]
            for path in report["paths"]:
                if left() < 60:
                    note(f"skipped {who} {path}: {left():.0f} s of the budget left")
                    continue
                core = cores.get(f"{who} {path.split()[-1]}") if path != "transformers" else None
                runner = worker.run if (who == "draft" and core is not None) else (lambda job: job())
                if core is not None:
                    runner(lambda: (core.reset(), core.append(prompt, logits="none")))
                for kind, rows, tree in kinds:
                    ids = [(r * 31 + 3) % 1000 + 1 for r in range(rows)]
                    if core is None:
                        call = (lambda ids=ids, tree=tree: hf(ids, tree))
                    elif tree:
                        L = len(prompt)
                        call = (lambda ids=ids, core=core, L=L: core.tree(ids, [L] * len(ids), [L + i for i in range(len(ids))],
                                                                         [[] for _ in ids], prefix=L))
                    else:
                        call = (lambda ids=ids, core=core, L=len(prompt): (core.append(ids), core.kv.truncate(L)))
                    name = f"{who} {kind if kind != 'verify' else 'verify'}"
                    if path == "core compiled":
                        t1 = time.perf_counter()
                        runner(lambda call=call: torch.inference_mode()(call)())
                        report["compile_s"][f"{name} ({rows} rows)"] = round(time.perf_counter() - t1, 1)
                    f[f"{name} {path} ms"] = runner(lambda call=call: median_ms(torch.inference_mode()(call), args.reps, dev))
                write(out, report)
        # the channel, then SSD rounds with an identical and a perturbed draft
        report["channel"] = channel_rtt(k, 1024 if smoke else 128256, 50 if not smoke else 5)
        write(out, report)
        comp_ok = compile_mode == "on" and not cores["draft compiled"].compiler.failed and not cores["target compiled"].compiler.failed \
            and all(f"{n} core compiled ms" in f for n in report["forward_names"])  # compiled above, not inside the rounds
        path = "core compiled" if comp_ok else "core eager"
        tcore, dcore = cores[f"target {path.split()[-1]}"], cores[f"draft {path.split()[-1]}"]
        ocore = Core(oracle, "oracle")
        report["rounds"] = {"path": path}
        for label in ("identical", "perturbed"):
            if left() < 30:
                note(f"skipped the {label}-draft rounds: {left():.0f} s of the budget left")
                continue
            if label == "perturbed":
                perturb(draft, 0.5 if not smoke else 2.0, seed=3)  # in place: CUDA graphs read the same tensors
                if dcore.device.type == "cpu":
                    dcore.compiler.forget()  # CPU packages bake the weights in
            st = run_rounds(tcore, dcore, ocore, worker, prompt, k, fan, args.rounds, budget_s=min(120.0, left() - 20))
            report["rounds"][label] = st.summary()
            write(out, report)
        report["projection"] = projections(f, report["rounds"], report["channel"]["request_us"] / 1e6, k)
        write(out, report)
        from . import gpucheck_tp

        try:  # TP=1 through the tensor-parallel code path (TP=2 needs a second GPU)
            gpucheck_tp.run(target, prompt, k, args.reps, dev, compile_mode, report, note, median_ms, left)
        except Exception as e:  # noqa: BLE001 - said in the report; the steps above stand
            note(f"the TP=1 step failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            report["failed"] = True
        pair = ["cpu", "cpu"] if smoke else ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else None
        try:  # TP=2 on the draft-shaped model (its twin, unperturbed): NCCL over two GPUs, gloo in the smoke run
            if pair is None:
                note("TP=2 not run: one GPU (NCCL takes one rank per GPU)")
            else:
                gpucheck_tp.run_multi(oracle, prompt, k, args.reps, pair, compile_mode, report, note, median_ms, left)
        except Exception as e:  # noqa: BLE001 - said in the report; the steps above stand
            note(f"the TP=2 step failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            report["failed"] = True
    except Exception as e:  # noqa: BLE001 - the report says what failed; partial results stay
        note(f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        report["failed"] = True
    finally:
        worker.close()
        report["total_s"] = round(time.perf_counter() - t_start, 1)
        write(out, report)
    print((out / "report.md").read_text())
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
