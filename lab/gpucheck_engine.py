"""The real decoders on a GPU: AR, SD and SSD (its speculator process) on random real-shaped models.

    python -m lab.gpucheck_engine --out DIR [--cpu-smoke] [--budget-s 240]

The GPU check's rig (:mod:`lab.gpucheck_rounds`) times forwards and rounds in one process;
this runs what a user runs: ``ARDecoder``, ``SDDecoder`` and ``SSDDecoder`` with the speculator
process and the channel, ``--compile on`` (CUDA graphs), on a Llama-3.1-8B-shaped target and a
Llama-3.2-1B-shaped draft with random bf16 weights, both on one GPU (the ``h200-8b-1b``
simulation profile's setup, so the two can be compared).

Random models agree on nothing, so both are built to compute one shared map: every layer's output
projections (``o_proj``, ``down_proj``) are zero, so the residual stream is the token's embedding,
and each head is the embedding table permuted, so both predict ``perm[token]``.  Every layer still
computes (the zeros cost what other weights cost), and the draft agrees with the target almost
always: this measures orchestration at GPU speed at acceptance near 1, not acceptance.
``--cpu-smoke`` runs the same on tiny shapes on the CPU (a test runs it).

The runs (:func:`plan_runs`, from the GPU count):

* ``shared``: AR, SD and SSD on ``cuda:0``, the speculator sharing the GPU (every machine);
* ``two-device``: SSD with the speculator on ``cuda:1`` against the shared run's SD and AR on
  ``cuda:0``: the paper's setup (2 or more GPUs);
* ``tp2``: AR, SD and SSD with the target tensor-parallel over ``cuda:0,cuda:1`` (NCCL) and the
  speculator on ``cuda:2`` (3 or more GPUs).

What a machine cannot run is listed under ``skipped`` in engine.json, with the reason.  The CPU
smoke runs all three on pinned cores (``cpu:0`` / ``cpu:1``, TP over two gloo ranks), so their
wiring is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def agreeing(cfg: dict, perm: torch.Tensor, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """A random Llama whose greedy next token is ``perm[token]`` (see the module docstring)."""
    from .gpucheck import build

    model = build(cfg, dtype, device, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        inv = torch.argsort(perm.to(emb.device))
        head = model.get_output_embeddings()
        if head.weight.data_ptr() == emb.data_ptr():  # tied: untie, the head must be a permutation
            head.weight = torch.nn.Parameter(emb[inv].clone())
            model.config.tie_word_embeddings = False
        else:
            head.weight.copy_(emb[inv])
        model.model.norm.weight.fill_(1.0)
    return model


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    modes: tuple[str, ...]
    target: str  # --target-device: one device, or the tensor-parallel ranks
    draft: str  # --draft-device: where the speculator (and SD's draft) runs
    what: str


def plan_runs(gpus: int, smoke: bool = False, cores: int = 2) -> tuple[list[Run], list[str]]:
    """The runs this machine can make, and one line per run it cannot, saying why (see the module
    docstring).  ``smoke``: the CPU rehearsal, on pinned cores where there are ``cores`` >= 2."""
    if smoke:
        runs = [Run("shared", ("ar", "sd", "ssd"), "cpu", "cpu", "AR, SD and SSD on the CPU")]
        if cores < 2:
            return runs, ["two-device and tp2 (CPU smoke): need 2 cores, this process may use 1"]
        return runs + [Run("two-device", ("ssd",), "cpu:0", "cpu:1", "SSD, the target on core 0, the speculator on core 1"),
                       Run("tp2", ("ar", "sd", "ssd"), "cpu:0,cpu:1", "cpu:1",
                           "AR, SD and SSD, the target over two gloo ranks (cores 0, 1), the speculator on core 1")], []
    if gpus < 1:
        return [], ["every run: no CUDA GPU"]
    runs = [Run("shared", ("ar", "sd", "ssd"), "cuda:0", "cuda:0", "AR, SD and SSD on cuda:0, the speculator sharing it")]
    skipped = []
    if gpus >= 2:
        runs.append(Run("two-device", ("ssd",), "cuda:0", "cuda:1", "SSD, the speculator on cuda:1 (the paper's setup)"))
    else:
        skipped.append("two-device (SSD with the speculator on cuda:1): needs 2 GPUs, this machine has 1")
    if gpus >= 3:
        runs.append(Run("tp2", ("ar", "sd", "ssd"), "cuda:0,cuda:1", "cuda:2",
                        "AR, SD and SSD, the target tensor-parallel over cuda:0,cuda:1 (NCCL), the speculator on cuda:2"))
    else:
        skipped.append(f"tp2 (the target over cuda:0,cuda:1, the speculator on cuda:2): needs 3 GPUs, this machine has {gpus}")
    return runs, skipped


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ssd_chat.bench.simulate import Tokens
    from ssd_chat.engine.load.devices import parse_placement
    from ssd_chat.engine.load.models import LoadedModel, ModelSpec
    from ssd_chat.engine.load.placement import cores_present
    from ssd_chat.engine.tp import load as tp_load
    from .gpucheck import LLAMA_31_8B, LLAMA_32_1B, SMOKE_DRAFT, SMOKE_TARGET

    smoke = args.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda:0")
    dtype = torch.float32 if smoke else torch.bfloat16
    tcfg, dcfg = (SMOKE_TARGET, SMOKE_DRAFT) if smoke else (LLAMA_31_8B, LLAMA_32_1B)
    vocab = tcfg["vocab_size"]
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    target = agreeing(tcfg, perm, dtype, dev, 1)
    draft = agreeing(dcfg, perm, dtype, dev, 2)
    gpus = 0 if smoke else torch.cuda.device_count()
    runs, skipped = plan_runs(gpus, smoke, len(cores_present()))
    report: dict[str, Any] = {"mode": "cpu-smoke" if smoke else "gpu", "k": args.k, "fan_out": args.fan_out, "gpus": gpus,
                              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                              "torch": torch.__version__, "build_s": round(time.perf_counter() - t0, 1),
                              "runs": {r.name: r.what for r in runs}, "planned": sum(len(r.modes) for r in runs),
                              "skipped": [], "modes": {}, "notices": []}
    for line in skipped:
        _skip(report, line)

    def loaded(m: torch.nn.Module, name: str) -> Any:
        return LoadedModel(name=name, spec=ModelSpec(name, "folder", name), model=m, tokenizer=Tokens(vocab),
                           placement=parse_placement(str(dev), str(dtype).removeprefix("torch.")))

    tl, dl = loaded(target, "target-8b-shape"), loaded(draft, "draft-1b-shape")
    # the speculator process loads the draft from a folder, as it does a user's model (a state dict of
    # gigabytes through shared memory would need a /dev/shm that large)
    folder = Path(tempfile.mkdtemp(prefix="ssd-chat-gpucheck-"))
    draft.save_pretrained(folder / "draft")
    dl.folder = folder / "draft"
    report["draft_saved_s"] = round(time.perf_counter() - t0 - report["build_s"], 1)
    prompts = [torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(args.prompts)]
    ar: dict[str, Any] = {}
    try:
        for r in runs:
            place = parse_placement(r.target, str(dtype).removeprefix("torch."))
            if place.ranks:  # the ranks read their shards from a folder, as from a user's model
                if time.perf_counter() - t0 > args.budget_s:
                    _skip(report, f"{r.name}: the budget ran out")
                    continue
                if not (folder / "target").exists():
                    target.save_pretrained(folder / "target")
                tgt = tp_load.start(folder / "target", place, "target-8b-shape", args.compile, (1, args.k + 1), Tokens(vocab))
            else:
                tgt = tl if place.cores is None else dataclasses.replace(tl, placement=place)
            try:
                _modes(args, r, tgt, dl, prompts, ar, report, t0)
            finally:
                if tgt.forwards.sharded is not None:
                    tgt.forwards.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    (Path(args.out) / "engine.json").write_text(json.dumps(report, indent=1))
    return report


def _skip(report: dict[str, Any], line: str) -> None:
    """A run or mode that did not run, and why: in the report and on stderr (.ci/gpu-check's summary)."""
    report["skipped"].append(line)
    print(f"gpucheck_engine: skipped {line}", file=sys.stderr, flush=True)


def _modes(args: argparse.Namespace, r: Run, tl: Any, dl: Any, prompts: list[list[int]], ar: dict[str, Any],
           report: dict[str, Any], t0: float) -> None:
    """One run's modes, each into ``report["modes"]`` (the shared run's by mode name, the others'
    as ``run/mode``); greedy SD/SSD are compared with this run's AR, else the shared run's."""
    from ssd_chat.engine.decode.ar import ARDecoder
    from ssd_chat.engine.decode.sd import SDDecoder
    from ssd_chat.engine.decode.ssd import SSDDecoder
    from ssd_chat.engine.engine import Engine, EngineConfig
    from ssd_chat.engine.events import Done, Error, Notice, Round
    from ssd_chat.engine.params import SamplingParams

    for mode in r.modes:
        key = mode if r.name == "shared" else f"{r.name}/{mode}"
        if time.perf_counter() - t0 > args.budget_s:
            _skip(report, f"{key} and the rest of its run: the budget ran out")
            break
        cfg = EngineConfig(mode=mode, k=args.k, fan_out=args.fan_out if mode == "ssd" else None, fallback="neural",
                           compile=args.compile, target_device=r.target, draft_device=r.draft)
        dec = ARDecoder(tl, args.compile) if mode == "ar" else (SDDecoder if mode == "sd" else SSDDecoder)(Engine(cfg, tl, dl))
        try:
            t1 = time.perf_counter()
            warm = list(dec.stream(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=args.k + 2)))  # compiles
            out: dict[str, Any] = {"target": tl.placement.label}
            if mode == "sd":
                out["draft"] = str(dl.device)  # SD's draft runs in this process, where it was loaded
            elif mode == "ssd":
                out["speculator"] = dec.plan.label  # where the decoder placed it: the check that it went there
            out.update(warm_s=round(time.perf_counter() - t1, 1), replies=[])
            report["notices"] += [f"{key}: {e.message}" for e in warm if isinstance(e, (Notice, Error))]
            ids = []
            for p in prompts:
                evs = list(dec.stream(p, SamplingParams(temperature=0.0, max_new_tokens=args.tokens)))
                done = evs[-1]
                if not isinstance(done, Done):
                    raise RuntimeError(done.message if isinstance(done, Error) else repr(done))
                rounds = [e for e in evs if isinstance(e, Round)]
                st = done.stats
                walls = [b.t_s - a.t_s for a, b in zip(rounds, rounds[1:])]
                out["replies"].append({
                    "tok_per_s": st.tok_per_s, "tokens_per_round": st.mean_accepted_length, "cache_hit_rate": st.cache_hit_rate,
                    "round_ms": round(1e3 * statistics.median(walls), 3) if walls else None,
                    "verify_ms": round(1e3 * statistics.median(r.verify_s for r in rounds), 3) if rounds else None,
                    "wait_ms": round(1e3 * statistics.median(r.wait_s or 0.0 for r in rounds), 3) if rounds else None,
                    "speculator_busy_ms": round(1e3 * statistics.median(r.speculator_busy_s for r in rounds if r.speculator_busy_s is not None), 3)
                    if any(r.speculator_busy_s is not None for r in rounds) else None})
                ids.append(done.token_ids)
            rates = [x["tok_per_s"] for x in out["replies"] if x["tok_per_s"]]
            out["tok_per_s"] = round(statistics.median(rates), 2) if rates else None
            if mode == "ar":
                ar[r.name] = ids
            else:
                out["greedy_equal_ar"] = ids == ar.get(r.name, ar.get("shared"))
            report["modes"][key] = out
        except Exception as e:  # noqa: BLE001 - said in the report; what ran stands
            report["modes"][key] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            close = getattr(dec, "close", None)
            if close:
                close()
        (Path(args.out) / "engine.json").write_text(json.dumps(report, indent=1))
        print(f"gpucheck_engine: {key}: {json.dumps(report['modes'][key])[:600]}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.gpucheck_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fan-out", default="uniform:2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--compile", choices=("on", "off"), default="on")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpucheck_engine: no CUDA GPU visible to torch; use --cpu-smoke", file=sys.stderr)
        return 1
    if args.cpu_smoke:
        args.tokens, args.compile = min(args.tokens, 24), "off"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rep = run(args)
    print(json.dumps(rep, indent=1))
    return 0 if all("failed" not in m for m in rep["modes"].values()) and len(rep["modes"]) == rep["planned"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
