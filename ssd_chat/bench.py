"""``ssd-chat bench``: AR, SD and SSD raced on the same prompts, models, settings and hardware.

One invocation loads the models once, warms every configuration up, then runs the
prompts with the modes interleaved (the order rotates from prompt to prompt), so
that drift of the machine hits every mode alike.  Two hardware protocols:

* ``paper``: AR and SD run on the target's device; SSD adds one device for the draft.
  On CPU: the app process (target, and SD's draft) is pinned to the target's cores
  (core 0 on a two-core machine), the SSD speculator to the remaining core.
* ``equal``: every mode gets the same total hardware: on CPU, AR and SD get all the
  cores SSD uses (target + draft cores); on GPUs, the target is sharded over the
  target GPUs plus the draft's GPU.  SSD's placement is the paper one in both
  protocols, so its runs are shared between them.

Greedy runs also check that SD and SSD produced exactly AR's tokens.  The numbers
and their presentation are in :mod:`ssd_chat.bench_report`.
"""

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

FAMILIES = ("code", "instructions", "math", "chat")
PROTOCOLS = ("paper", "equal")
DEFAULT_MAX_NEW = 128
# --preset gpu: (target, draft) alias pairs tried in order; the first whose models are in the local HF cache wins
GPU_PAIRS = (("llama-3-8b", "llama-3-1b"), ("qwen3-8b", "qwen3-0.6b"), ("smollm2-1.7b", "smollm2-135m"),
             ("qwen3-1.7b", "qwen3-0.6b"), ("llama-3-3b", "llama-3-1b"), ("smollm2-360m", "smollm2-135m"))


class BenchError(Exception):
    """A problem with the benchmark's own arguments or environment (printed as one line)."""


# --- prompts --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    id: str
    family: str
    text: str


def _read_jsonl(text: str, source: str, default_family: str) -> list[BenchPrompt]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{source} line {n} is not valid JSON: {e.msg}") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise BenchError(f"{source} line {n}: expected an object with a non-empty \"prompt\" string (or a JSON string)")
        pid = str(obj.get("id") or f"{default_family}-{len(out) + 1:02d}")
        if any(p.id == pid for p in out):  # ids key the comparison with AR: keep them unique
            pid = f"{pid}-line{n}"
        out.append(BenchPrompt(pid, str(obj.get("family") or default_family), obj["prompt"]))
    return out


def load_prompts(spec: str, limit: int | None = None) -> tuple[list[BenchPrompt], str]:
    """Prompts for ``--prompts``: ``all``, families (``code,math``), or a ``.jsonl`` / ``.txt`` file.

    Families are interleaved (code-01, instructions-01, math-01, chat-01, code-02, …);
    ``limit`` keeps the first N of each family (of a file: its first N prompts)."""
    spec = (spec or "all").strip()
    if limit is not None and limit < 1:
        raise BenchError("--limit must be at least 1")
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names and all(n in FAMILIES or n == "all" for n in names):
        fams = list(FAMILIES) if "all" in names else list(dict.fromkeys(names))
        per_family = []
        for f in fams:
            text = files("ssd_chat.assets").joinpath("prompts", f"{f}.jsonl").read_text(encoding="utf-8")
            ps = _read_jsonl(text, f"prompts/{f}.jsonl", f)
            per_family.append(ps[:limit] if limit else ps)
        interleaved = [p for group in _zip_longest(per_family) for p in group]
        return interleaved, ",".join(fams)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BenchError(f"--prompts '{spec}' is neither a prompt set ({', '.join(('all',) + FAMILIES)}) nor an existing file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read prompts from '{path}': {e}") from None
    if path.suffix.lower() == ".jsonl":
        ps = _read_jsonl(text, str(path), path.stem)
    else:  # one prompt per line
        ps = [BenchPrompt(f"{path.stem}-{i + 1:02d}", path.stem, line.strip()) for i, line in
              enumerate(ln for ln in text.splitlines() if ln.strip())]
    if not ps:
        raise BenchError(f"'{path}' holds no prompts")
    return (ps[:limit] if limit else ps), str(path)


def _zip_longest(groups: list[list[BenchPrompt]]) -> Iterator[list[BenchPrompt]]:
    for i in range(max((len(g) for g in groups), default=0)):
        yield [g[i] for g in groups if i < len(g)]


# --- hardware plans -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one mode runs under one protocol.  ``cores``/``threads``: the app process (CPU only)."""

    protocol: str
    mode: str
    target_device: str
    draft_device: str
    cores: tuple[int, ...] | None
    threads: int | None
    note: str = ""

    @property
    def slot(self) -> tuple:
        """Plans with the same slot are the same configuration (run once, reported under both protocols)."""
        return (self.mode, self.target_device, self.draft_device, self.cores, self.threads)

    @property
    def slot_id(self) -> str:
        return "|".join(map(str, self.slot))

    def describe(self) -> str:
        if self.cores is not None:
            where = f"target on core{'s' if len(self.cores) > 1 else ''} {_cores(self.cores)} ({self.threads} thread{'s' if self.threads != 1 else ''})"
        else:
            where = f"target on {self.target_device}"
        if self.mode == "sd":
            where += ", draft in-process" if self.cores is not None else f", draft on {self.draft_device}"
        elif self.mode == "ssd":
            where += f", speculator on {self.draft_device}"
        return where


def _cores(cs: tuple[int, ...]) -> str:
    return f"{cs[0]}-{cs[-1]}" if len(cs) > 2 and cs == tuple(range(cs[0], cs[-1] + 1)) else ",".join(map(str, cs))


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu_cores: tuple[int, ...]
    num_gpus: int

    @classmethod
    def detect(cls) -> "Hardware":
        import torch

        cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(range(os.cpu_count() or 1))
        return cls(cores, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _cpu_cores_of(device: str) -> tuple[int, ...] | None:
    d = device.strip().lower()
    if d.startswith("cpu:"):
        lo, _, hi = d[4:].partition("-")
        return tuple(range(int(lo), int(hi or lo) + 1))
    return None


def make_plans(protocols: tuple[str, ...], modes: tuple[str, ...], target_device: str, draft_device: str,
               hw: Hardware) -> tuple[list[Plan], list[str]]:
    """Plans for every (protocol, mode) and notes for the report."""
    notes: list[str] = []
    td, dd = (target_device or "auto").strip().lower(), (draft_device or "auto").strip().lower()
    on_gpu = td.startswith("cuda") or (td == "auto" and hw.num_gpus > 0)
    plans: list[Plan] = []
    if not on_gpu:
        if td not in ("auto", "cpu") and not td.startswith("cpu"):
            raise BenchError(f"--target-device {target_device}: the benchmark runs on cpu[:N] or cuda[:N]")
        avail = hw.cpu_cores
        t_cores = _cpu_cores_of(td) or (avail[:-1] if len(avail) >= 2 else avail)
        d_cores = _cpu_cores_of(dd) or (tuple(c for c in avail if c not in t_cores)[-1:] or t_cores[-1:])
        for c in (*t_cores, *d_cores):
            if c not in avail:
                raise BenchError(f"CPU core {c} is not available to this process (available: {_cores(avail)})")
        if set(t_cores) & set(d_cores):
            notes.append(f"only {len(avail)} CPU core(s): the SSD speculator shares core(s) {_cores(d_cores)} with the target, so SSD cannot overlap drafting with verification")
        all_cores = tuple(sorted(set(t_cores) | set(d_cores)))
        spec_dev = f"cpu:{d_cores[0]}" if len(d_cores) == 1 else f"cpu:{d_cores[0]}-{d_cores[-1]}"
        for proto in protocols:
            for mode in modes:
                if mode == "ssd":
                    plans.append(Plan(proto, mode, "cpu", spec_dev, t_cores, len(t_cores)))
                elif proto == "paper":
                    plans.append(Plan(proto, mode, "cpu", "cpu", t_cores, len(t_cores)))
                else:
                    plans.append(Plan(proto, mode, "cpu", "cpu", all_cores, len(all_cores)))
        return plans, notes
    if hw.num_gpus == 0:
        raise BenchError("a CUDA device was requested but no NVIDIA GPU is visible to torch (torch.cuda.is_available() is False)")
    t_list = [d.strip() for d in td.split(",")] if td != "auto" else ["cuda:0"]
    t_list = [d if ":" in d else "cuda:0" for d in t_list]
    used = {int(d.split(":")[1]) for d in t_list}
    if dd != "auto":
        d_dev = dd if ":" in dd else "cuda:0"
    else:
        free = [i for i in range(hw.num_gpus) if i not in used]
        d_dev = f"cuda:{free[-1]}" if free else t_list[0]
    if d_dev in t_list:
        notes.append(f"{hw.num_gpus} GPU(s) and none free for the draft: the SSD speculator shares {d_dev} with the target, "
                     "so its drafting competes with verification (the paper gives the draft its own GPU)")
    equal_target = ",".join(t_list + ([d_dev] if d_dev not in t_list else []))
    for proto in protocols:
        for mode in modes:
            if mode == "ssd":
                plans.append(Plan(proto, mode, ",".join(t_list), d_dev, None, None))
            elif proto == "paper":
                plans.append(Plan(proto, mode, ",".join(t_list), t_list[0], None, None))
            else:
                plans.append(Plan(proto, mode, equal_target, t_list[0], None, None))
    return plans, notes


# --- pinning --------------------------------------------------------------------------------


class Pinning:
    """Pin every thread of this process to some cores and set torch's thread count; restore on exit."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._threads0 = torch.get_num_threads()
        self._cores0 = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_setaffinity") else None
        self.enforced = self._cores0 is not None and os.path.isdir("/proc/self/task")

    def apply(self, cores: tuple[int, ...] | None, threads: int | None) -> None:
        if threads is not None:
            self._torch.set_num_threads(threads)
            from ssd_chat.engine import fastlinear

            fastlinear.prepare()  # few-row choices timed for this thread count (during the warm-up)
        if cores is not None and self.enforced:
            self._set_all(cores)

    def _set_all(self, cores: tuple[int, ...]) -> None:
        # os.sched_setaffinity(0, ...) moves only the calling thread; torch's worker threads need it too
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # the thread ended meanwhile
                pass

    def restore(self) -> None:
        self._torch.set_num_threads(self._threads0)
        if self._cores0 is not None and self.enforced:
            self._set_all(self._cores0)


def descendants_cpu_s() -> float | None:
    """CPU seconds used so far by this process's descendants (Linux; None elsewhere)."""
    if not os.path.isdir("/proc"):
        return None
    me = os.getpid()
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])  # utime + stime
    total = 0
    for pid in ticks:
        p = parent.get(pid)
        while p and p != me and p in parent:
            p = parent[p]
        if p == me and pid != me:
            total += ticks[pid]
    return total / os.sysconf("SC_CLK_TCK")


# --- running --------------------------------------------------------------------------------


@dataclass
class BenchSettings:
    modes: tuple[str, ...]
    protocols: tuple[str, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW
    repeats: int = 1
    warmup_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = True


@dataclass
class BenchRun:
    """Everything measured in one bench invocation."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    channel_rtt_ms: float | None = None


def _unavailable(exc: BaseException, mode: str) -> str:
    if isinstance(exc, ImportError):
        return f"the {mode.upper()} decoder is not available in this build ({exc})"
    return f"{type(exc).__name__}: {exc}"


def run_bench(
    base_config: Any,
    models_for: Callable[[Plan], tuple[Any, Any]],
    prompts: list[BenchPrompt],
    plans: list[Plan],
    settings: BenchSettings,
    encode: Callable[[Any, BenchPrompt], tuple[list[int], tuple[str, ...]]] | None = None,
    progress: Callable[[str], None] = lambda s: None,
) -> BenchRun:
    """Warm up, then run every prompt under every distinct plan, interleaved.

    ``models_for(plan) -> (target, draft)`` gives loaded models (shared between plans);
    ``encode(engine, prompt) -> (ids, extra_stop)`` defaults to the chat template."""
    from .engine import Engine, SamplingParams
    from .engine.chat import messages_for
    from .engine.events import Done, Error, Notice, Round, Token

    encode = encode or (lambda eng, p: eng.prompt_ids(messages_for(p.text)))
    out = BenchRun()
    slots: dict[tuple, Plan] = {}
    for p in plans:
        slots.setdefault(p.slot, p)
    engines: dict[tuple, Any] = {}
    pin = Pinning()
    try:
        # one Engine per distinct placement, sharing the loaded models; building its decoder
        # here makes a missing decoder (ImportError) a clear message before anything is timed
        for key, plan in list(slots.items()):
            if plan.mode in out.skipped:
                del slots[key]
                continue
            target, draft = models_for(plan)
            cfg = replace(base_config, mode=plan.mode, target_device=plan.target_device, draft_device=plan.draft_device)
            eng = None
            try:  # unpinned: the SSD decoder checks its --draft-device cores against this process's affinity
                eng = Engine(cfg, target, draft if plan.mode != "ar" else None)  # refuses a draft the mode cannot use
                eng.decoder()
            except Exception as e:  # noqa: BLE001 - any failure to build a decoder skips that mode, loudly
                out.skipped[plan.mode] = _unavailable(e, plan.mode)
                if eng is not None:
                    eng.close()
                del slots[key]
                continue
            engines[key] = eng
        if not engines:
            raise BenchError("no mode could run: " + "; ".join(f"{m}: {w}" for m, w in out.skipped.items()))
        encoded = {p.id: encode(next(iter(engines.values())), p) for p in prompts}
        keys = list(engines)

        def one(key: tuple, prompt: BenchPrompt, repeat: int, max_new: int, order: int) -> dict[str, Any]:
            plan, eng = slots[key], engines[key]
            ids, extra_stop = encoded[prompt.id]
            seed = settings.seed if settings.seed is not None else 1234 + repeat
            params = SamplingParams(settings.temperature, settings.top_p, settings.top_k, seed, max_new,
                                    tuple(extra_stop), settings.ignore_eos)
            pin.apply(plan.cores, plan.threads)
            bg0 = descendants_cpu_s() if plan.mode != "ssd" else None
            rec: dict[str, Any] = {
                "run_id": f"{plan.slot_id}|{prompt.id}|{repeat}", "slot": plan.slot_id, "mode": plan.mode, "prompt_id": prompt.id, "family": prompt.family, "repeat": repeat, "order": order,
                "prompt_tokens": len(ids), "new_tokens": 0, "tok_per_s": None, "ttft_s": None, "elapsed_s": 0.0,
                "prefill_s": None, "rounds": 0, "drafted": 0, "accepted": 0, "ssd_rounds": 0, "hits": 0,
                "draft_s": 0.0, "verify_s": 0.0, "wait_s": 0.0, "wait_on_hit_s": 0.0, "verify_on_hit_s": 0.0,
                "speculator_busy_s": 0.0, "fallback_rounds": 0, "reason": None, "error": None, "background_cpu_s": None,
                "notices": [],
            }
            t0 = time.perf_counter()
            token_ids: list[int] = []
            for ev in eng.stream(ids, params):
                if isinstance(ev, Token):
                    token_ids.append(ev.id)
                elif isinstance(ev, Round):
                    rec["rounds"] += 1
                    rec["drafted"] += len(ev.drafted)
                    rec["accepted"] += ev.accepted
                    rec["draft_s"] += ev.draft_s
                    rec["verify_s"] += ev.verify_s
                    rec["wait_s"] += ev.wait_s or 0.0
                    rec["speculator_busy_s"] += ev.speculator_busy_s or 0.0
                    rec["fallback_rounds"] += ev.fallback is not None
                    if ev.cache_hit is not None:
                        rec["ssd_rounds"] += 1
                        if ev.cache_hit:
                            rec["hits"] += 1
                            rec["wait_on_hit_s"] += ev.wait_s or 0.0
                            rec["verify_on_hit_s"] += ev.verify_s
                elif isinstance(ev, Done):
                    s = ev.stats
                    token_ids = list(ev.token_ids)
                    rec.update(new_tokens=s.new_tokens, tok_per_s=s.tok_per_s, ttft_s=s.ttft_s, prefill_s=s.prefill_s,
                               reason=ev.reason)
                elif isinstance(ev, Notice):
                    rec["notices"].append(f"{ev.level}: {ev.message}")
                elif isinstance(ev, Error):
                    rec["error"] = ev.message
                    token_ids = list(ev.token_ids)
            rec["elapsed_s"] = time.perf_counter() - t0
            if bg0 is not None:
                bg1 = descendants_cpu_s()
                rec["background_cpu_s"] = None if bg1 is None else bg1 - bg0
            out.tokens[rec["run_id"]] = tuple(token_ids)
            return rec

        # warm-up: every configuration once, on the first prompt, not recorded
        for key in keys:
            rec = one(key, prompts[0], -1, min(settings.warmup_tokens, settings.max_new_tokens), 0)
            if rec["error"]:
                raise BenchError(f"{slots[key].mode} failed during warm-up: {rec['error']}")
        total = len(prompts) * settings.repeats * len(keys)
        done = 0
        for pi, prompt in enumerate(prompts):
            for repeat in range(settings.repeats):
                shift = (pi * settings.repeats + repeat) % len(keys)
                for order, key in enumerate(keys[shift:] + keys[:shift]):
                    rec = one(key, prompt, repeat, settings.max_new_tokens, order)
                    out.runs.append(rec)
                    done += 1
                    plan = slots[key]
                    progress(f"[{done}/{total}] {plan.mode:<3} {_cores(plan.cores) if plan.cores else plan.target_device:<5} {prompt.id:<16} "
                             + (f"error: {rec['error']}" if rec["error"] else
                                f"{rec['tok_per_s'] or 0:6.1f} tok/s" + (f", accepted length {1 + rec['accepted'] / rec['rounds']:.2f}" if rec["rounds"] else "")))
        out.channel_rtt_ms = _channel_rtt_ms(engines)
    finally:
        for eng in engines.values():
            try:
                eng.close()
            except Exception:  # noqa: BLE001 - closing is best effort; never mask the real error
                pass
        pin.restore()
    return out


def _channel_rtt_ms(engines: dict[tuple, Any]) -> float | None:
    """The SSD verifier ⇄ speculator round trip, if the SSD decoder can measure it (``ping()``, seconds)."""
    for eng in engines.values():
        dec = getattr(eng, "_decoder", None)
        if eng.config.mode == "ssd" and dec is not None:
            ping = getattr(dec, "ping", None) or getattr(getattr(dec, "channel", None), "ping", None)
            if callable(ping):
                try:
                    samples = sorted(float(ping()) for _ in range(200))
                except Exception:  # noqa: BLE001
                    return None
                return samples[len(samples) // 2] * 1e3
    return None


# --- the report -----------------------------------------------------------------------------


def machine_info(hw: Hardware) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(hw.num_gpus)]
    summary = f"{len(hw.cpu_cores)} × {cpu}" + (f", {len(gpus)} × {gpus[0]}" if gpus else "")
    return {"cpu": cpu, "cpu_cores": list(hw.cpu_cores), "gpus": gpus, "summary": summary,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def busy_note(machine: dict[str, Any], hw: Hardware) -> str | None:
    """A warning when other work is running: timings on a busy CPU are noise."""
    load = (machine.get("loadavg_start") or [0.0])[0]
    if hw.num_gpus == 0 and load > 0.5 * len(hw.cpu_cores):
        return (f"the machine is busy (load average {load:.1f} on {len(hw.cpu_cores)} cores before the run): "
                "other processes compete for the cores this benchmark pins, so its timings are noisy")
    return None


def build_report(result: BenchRun, plans: list[Plan], settings: BenchSettings, prompts: list[BenchPrompt],
                 prompt_source: str, models: dict[str, Any], base: dict[str, Any], machine: dict[str, Any],
                 notes: list[str], decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    from . import bench_report as br

    by_slot: dict[str, list[dict[str, Any]]] = {}
    for r in result.runs:
        by_slot.setdefault(r["slot"], []).append(r)
    protocols: dict[str, Any] = {}
    placements: dict[str, Any] = {}
    placements_text: dict[str, str] = {}
    for proto in settings.protocols:
        runs_by_mode = {}
        pp = [p for p in plans if p.protocol == proto and p.mode not in result.skipped]
        for p in pp:
            runs_by_mode[p.mode] = by_slot.get(p.slot_id, [])
        protocols[proto] = br.summarize_protocol(proto, runs_by_mode, settings.temperature == 0, result.tokens, decode,
                                                 result.channel_rtt_ms)
        placements[proto] = {p.mode: {**{k: v for k, v in asdict(p).items() if k not in ("protocol", "mode")}, "slot": p.slot_id,
                                      "description": p.describe()} for p in pp}
        placements_text[proto] = "; ".join(f"{p.mode.upper()}: {p.describe()}" for p in pp)
    br.with_equal_bound(protocols)
    shared = {p.slot_id for p in plans if p.protocol == "paper"} & {p.slot_id for p in plans if p.protocol == "equal"}
    if shared:
        modes = sorted({p.mode for p in plans if p.slot_id in shared})
        notes = [*notes, f"{', '.join(m.upper() for m in modes)} has the same placement under both protocols: its runs are measured once and reported under both"]
    if hasattr(os, "getloadavg"):
        machine = {**machine, "loadavg_end": list(os.getloadavg())}
    fams: dict[str, int] = {}
    for p in prompts:
        fams[p.family] = fams.get(p.family, 0) + 1
    return {
        "schema": br.SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["ssd-chat", *sys.argv[1:]]) if sys.argv and "ssd-chat" in Path(sys.argv[0]).name else None,
        "machine": machine,
        "models": models,
        "settings": {
            "k": base.get("k"), "max_new_tokens": settings.max_new_tokens, "ignore_eos": settings.ignore_eos,
            "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k, "seed": settings.seed,
            "repeats": settings.repeats, "warmup_tokens": settings.warmup_tokens, "modes": list(settings.modes),
            "fan_out": base.get("fan_out"), "budget": base.get("budget"), "saguaro_c": base.get("saguaro_c"),
            "fallback": base.get("fallback"), "pinning_enforced": Pinning().enforced,
            "prompts": {"source": prompt_source, "count": len(prompts), "families": fams},
        },
        "notes": notes,
        "skipped_modes": result.skipped,
        "placements": placements,
        "placements_text": placements_text,
        "protocols": protocols,
        "runs": result.runs,
    }


# --- the command ----------------------------------------------------------------------------


def _parse_list(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(s.strip().lower() for s in value.split(",") if s.strip()))
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise typer.BadParameter(f"unknown {what} {', '.join(bad) or repr(value)} (use a comma list of {', '.join(allowed)})")
    return items


def gpu_preset(values: dict[str, Any], given: set[str], hw: Hardware) -> tuple[dict[str, Any], list[str]]:
    """Defaults for ``--preset gpu``: a (target, draft) pair from the local HF cache, bf16, the draft on its own GPU."""
    notes: list[str] = []
    if hw.num_gpus == 0:
        raise BenchError("--preset gpu needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False); "
                         "run the CPU benchmark without --preset")
    out = dict(values)
    if "target" not in given:
        from .engine.models import local_status

        local = {r["alias"] for r in local_status() if r["local"]}
        pair = next(((t, d) for t, d in GPU_PAIRS if t in local and d in local), None)
        if pair is None:
            raise BenchError("--preset gpu found no (target, draft) pair in the local Hugging Face cache; tried "
                             + ", ".join(f"{t} + {d}" for t, d in GPU_PAIRS) + ". Download one (e.g. `hf download HuggingFaceTB/SmolLM2-1.7B-Instruct` "
                             "and HuggingFaceTB/SmolLM2-135M-Instruct) or pass --target and --draft")
        out["target"], out["draft"] = pair
    out.setdefault("dtype", "bfloat16") if "dtype" not in given else None
    if "dtype" not in given:
        out["dtype"] = "bfloat16"
    if hw.num_gpus == 1:
        notes.append("one GPU: the SSD speculator shares it with the target; the paper's protocol gives the draft its own GPU")
    elif "target_device" not in given:
        # the draft gets the last GPU; the target shards over the others only if one GPU is not enough
        out["target_device"] = "cuda:0"
        out["draft_device"] = f"cuda:{hw.num_gpus - 1}"
    return out, notes


def make_bench_command() -> Callable[..., None]:
    """The ``bench`` command, built when ``ssd_chat.cli`` registers it (it needs the shared option aliases
    defined there; building it lazily keeps ``import ssd_chat.bench`` free of an import cycle)."""
    from . import cli
    from .cli import (Budget, Draft, DraftDevice, Dtype, Fallback, FanOut, K, SaguaroC, Seed, Target, TargetDevice,
                      Temperature, TopK, TopP, TrustRemote)

    def bench_command(
        ctx: typer.Context,
        modes: Annotated[str, typer.Option("--modes", help="Comma list of modes to race: ar, sd, ssd.")] = "ar,sd,ssd",
        prompts: Annotated[str, typer.Option("--prompts", help="Prompt set: all, or families (code,instructions,math,chat), or a .jsonl ({\"prompt\": ...} per line) / .txt (one per line) file.")] = "all",
        limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="At most N prompts per family (of a file: its first N).", show_default=False)] = None,
        max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help=f"New tokens per reply (default {DEFAULT_MAX_NEW}).", show_default=False)] = None,
        json_file: Annotated[Optional[Path], typer.Option("--json", help="Write the full report (summaries, ratios, every run) as JSON.", show_default=False, dir_okay=False)] = None,
        plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot of the results.", show_default=False, dir_okay=False)] = None,
        markdown_file: Annotated[Optional[Path], typer.Option("--markdown", help="Write the summary as Markdown tables (for a README).", show_default=False, dir_okay=False)] = None,
        protocol: Annotated[str, typer.Option("--protocol", help="paper (SSD adds a device for the draft), equal (every mode gets the same hardware) or both.")] = "both",
        repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per prompt and configuration.")] = 1,
        stop_at_eos: Annotated[bool, typer.Option("--stop-at-eos", help="End replies at EOS (default: ignore EOS and generate exactly --max-new-tokens, as the paper does).")] = False,
        preset: Annotated[Optional[str], typer.Option("--preset", help="gpu: a target/draft pair from the local HF cache, bf16, the draft on its own GPU.", show_default=False)] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (models, placements, prompts) and exit without loading anything.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-run progress lines on stderr.")] = False,
        against: Annotated[Optional[tuple[str, str]], typer.Option("--against", metavar="llama.cpp PATH", help="Also time llama.cpp's llama-bench (PATH: the binary or its build folder) on the same GGUF, cores and token count, and report the ratios.", show_default=False)] = None,
        target: Target = None, draft: Draft = None, k: K = None,
        temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, seed: Seed = None,
        target_device: TargetDevice = None, draft_device: DraftDevice = None, dtype: Dtype = None,
        fan_out: FanOut = None, budget: Budget = None, saguaro_c: SaguaroC = None, fallback: Fallback = None,
        trust_remote_code: TrustRemote = None,
    ) -> None:
        """Race AR, SD and SSD on the same prompts, models and hardware; report tok/s, TTFT, acceptance and ratios.

        Exit status: 0 on success, 2 on bad usage, 1 on a failure, 3 when a greedy SD/SSD reply differs from AR's.
        """
        from rich.console import Console

        from . import llamacpp
        from .engine.errors import ModelError

        local = {"target": target, "draft": draft, "k": k, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                 "seed": seed, "target_device": target_device, "draft_device": draft_device, "dtype": dtype,
                 "fan_out": fan_out, "budget": budget, "saguaro_c": saguaro_c, "fallback": fallback,
                 "trust_remote_code": trust_remote_code}
        merged = cli._merge(ctx, local)
        given = {k_ for k_, v in merged.items() if v is not None}
        mode_list = _parse_list(modes, ("ar", "sd", "ssd"), "mode")
        protos = PROTOCOLS if protocol.strip().lower() == "both" else _parse_list(protocol, PROTOCOLS, "protocol")
        if preset is not None and preset.strip().lower() != "gpu":
            raise typer.BadParameter(f"unknown preset '{preset}' (the only preset is gpu)", param_hint="--preset")
        max_new = max_new_tokens or merged.get("max_new_tokens") or DEFAULT_MAX_NEW
        console = Console() if sys.stdout.isatty() else Console(width=120)  # a log or a pipe: room for the tables
        err = Console(stderr=True)
        try:
            prompt_list, prompt_source = load_prompts(prompts, limit)
            from .config import ConfigError

            try:
                values = cli.settings(merged)
            except ConfigError as e:
                raise BenchError(str(e)) from None
            hw = Hardware.detect()
            notes: list[str] = []
            if preset is not None:
                values, notes = gpu_preset(values, given, hw)
            plans, more = make_plans(protos, mode_list, values.get("target_device") or "auto", values.get("draft_device") or "auto", hw)
            notes += more
            if against is not None:
                from .engine.models import resolve

                llama_exe = llamacpp.check_against(against[0], against[1], resolve(values["target"]))
        except (BenchError, llamacpp.LlamaCppError, ModelError) as e:
            raise cli.fail(str(e)) from None
        settings = BenchSettings(
            modes=mode_list, protocols=protos, max_new_tokens=max_new, repeats=repeats,
            temperature=float(values.get("temperature") or 0.0), top_p=float(values.get("top_p") or 1.0),
            top_k=int(values.get("top_k") or 0), seed=values.get("seed"), ignore_eos=not stop_at_eos,
        )
        if dry_run:
            console.print(f"target {values['target']}, draft {values.get('draft') or '(default for the target)'}, dtype {values.get('dtype') or 'auto'}, "
                          f"{len(prompt_list)} prompts from {prompt_source}, {max_new} new tokens, {repeats} repeat(s)")
            for proto in protos:
                console.print(f"protocol {proto}: " + "; ".join(f"{p.mode.upper()}: {p.describe()}" for p in plans if p.protocol == proto))
            for n in notes:
                console.print(f"note: {n}")
            raise typer.Exit(0)
        from .engine.errors import SSDChatError

        pool = None
        try:
            cli.quiet_libraries()
            machine = machine_info(hw)  # before the run: its load average says how quiet the machine was
            busy = busy_note(machine, hw)
            if busy:
                notes.append(busy)
                err.print(f"[yellow]note[/]: {busy}")
            pool = ModelPool(values, plans, progress=None if quiet else (lambda s: err.print(f"[dim]{s}…[/]")))
            base_cfg = pool.base_config
            result = run_bench(base_cfg, pool.models_for, prompt_list, plans, settings,
                               progress=(lambda s: None) if quiet else (lambda s: err.print(s, highlight=False)))
        except (BenchError, SSDChatError) as e:
            raise cli.fail(str(e)) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None
        models = pool.describe()
        report = build_report(result, plans, settings, prompt_list, prompt_source, models,
                              {"k": base_cfg.k, "fan_out": base_cfg.fan_out, "budget": base_cfg.budget, "saguaro_c": base_cfg.saguaro_c,
                               "fallback": base_cfg.fallback}, machine, notes, pool.decode)
        from . import bench_report as br

        versus, versus_error = [], None
        if against is not None:  # after ssd-chat's runs, on the cores each protocol gave AR
            try:
                versus = llamacpp.against(llama_exe, resolve(values["target"]).source, plans, report, max_new,
                                          None if quiet else (lambda s: err.print(f"[dim]{s}…[/]")))
            except llamacpp.LlamaCppError as e:  # ssd-chat's own results are still reported
                versus_error = str(e)
        br.render(report, console)
        for line in versus:
            console.print(line, highlight=False)
        for n in notes:
            console.print(f"note: {n}")
        if json_file is not None:
            br.write_json(report, json_file)
            console.print(f"JSON written to {json_file}")
        if plot_file is not None:
            br.plot(report, plot_file)
            console.print(f"plot written to {plot_file}")
        if markdown_file is not None:
            markdown_file.parent.mkdir(parents=True, exist_ok=True)
            markdown_file.write_text(br.markdown(report))
            console.print(f"Markdown written to {markdown_file}")
        failed = sum(m["failed"] for p in report["protocols"].values() for m in p["modes"].values())
        mismatched = any(p["exactness"]["checked"] and not p["exactness"].get("all_identical", True) for p in report["protocols"].values())
        if mismatched:
            err.print("[bold red]ssd-chat: error: greedy SD/SSD output differs from AR (see GREEDY MISMATCH above)[/]")
        if failed:
            err.print(f"[bold red]ssd-chat: error: {failed} run(s) failed (see the JSON for the messages)[/]")
        if versus_error:
            err.print(f"ssd-chat: error: {versus_error}", markup=False, highlight=False)
        raise typer.Exit(1 if failed or versus_error else 3 if mismatched else 0)

    return bench_command


class ModelPool:
    """Loads each model once per device (on CPU: once) and hands them to the plans."""

    def __init__(self, values: dict[str, Any], plans: list[Plan], progress: Callable[[str], None] | None = None) -> None:
        from . import cli
        from .engine import Engine
        from .engine.engine import default_draft

        self.values = values
        self._progress = progress or (lambda s: None)
        needs_draft = any(p.mode != "ar" for p in plans)
        first = next((p for p in plans if p.mode != "ar"), plans[0])
        cfg = cli.engine_config({**values, "mode": first.mode if needs_draft else "ar",
                                 "target_device": first.target_device, "draft_device": first.draft_device})
        self.base_config = cfg
        self.draft_name = (cfg.draft or default_draft(cfg.target)) if needs_draft else None

        def progress(stage: str, frac: float | None) -> None:  # noqa: ARG001
            self._progress(stage)

        engine = Engine.load(cfg, progress=progress)  # checks target/draft tokenizers, loads both
        self._targets = {self._key(first.target_device): engine.target}
        self._drafts = {(self._key(first.target_device), self._key(first.draft_device)): engine.draft}
        self._first = engine

    @staticmethod
    def _key(device: str) -> str:
        d = device.strip().lower()
        return "cpu" if d.startswith("cpu") or d == "auto" and not _cuda() else d

    def models_for(self, plan: Plan) -> tuple[Any, Any]:
        from .engine import drafts, models, precision

        tk = self._key(plan.target_device)
        if tk not in self._targets:
            self._progress(f"loading {self.values['target']} on {plan.target_device}")
            self._targets[tk] = precision.load(self.values["target"], models.parse_placement(plan.target_device, self.values.get("dtype") or "auto"),
                                            bool(self.values.get("trust_remote_code")))
        target = self._targets[tk]
        if plan.mode == "ar" or self.draft_name is None:
            return target, None
        dk = (tk, self._key(plan.draft_device))
        if dk not in self._drafts:
            if drafts.is_derived(self.draft_name):
                self._drafts[dk] = precision.derive(self.draft_name, target)
            else:
                self._progress(f"loading {self.draft_name} on {plan.draft_device}")
                self._drafts[dk] = precision.load(self.draft_name, models.parse_placement(plan.draft_device, self.values.get("dtype") or "auto"),
                                               bool(self.values.get("trust_remote_code")))
        return target, self._drafts[dk]

    def decode(self, ids: list[int]) -> str:
        return self._first.target.tokenizer.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        t = self._first.target
        from .engine import precision

        out: dict[str, Any] = {"target": {"name": t.name, "params": t.num_params, "dtype": str(t.placement.dtype).removeprefix("torch."),
                                          "precision": precision.of(t)}}
        d = self._first.draft
        if d is not None:
            out["draft"] = {"name": d.name, "params": d.num_params, "precision": precision.of(d)}
        return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
