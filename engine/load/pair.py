"""The target and the draft checked together before anything loads: when hub models are missing and cannot be
downloaded now, one message names every download with the total size, what hardware the pair needs, and
the placement ssd-chat would give it (naming only the first missing model would send the user back for the
draft after a 141 GB download of the target)."""

from __future__ import annotations

from ..errors import NotCachedError
from . import catalog, models, store
from .pull import offline

GPU_GB = 80.0  # the usual data-centre GPU (A100/H100 80 GB) when this machine has none to size against
# weights on at most half of each GPU: the rest holds the KV cache, SSD's cached outcomes and compiled graphs
WEIGHT_SHARE = 0.5


def cached(repo_id: str) -> bool:
    """The repo has a snapshot with a config.json in the hub cache (what an offline load needs first)."""
    repo = store.hub_repos().get(repo_id)
    return repo is not None and any((repo / "snapshots").glob("*/config.json"))


def absent(names: list[str]) -> list[tuple[str, str]]:
    """(name, hub id) of each hub model among ``names`` that is not in the local cache."""
    out = []
    for name in names:
        spec = models.resolve(name)
        if spec.kind == "hub" and not cached(spec.source) and (name, spec.source) not in out:
            out.append((name, spec.source))
    return out


def placement(target_gb: float, per_gpu: float) -> tuple[int, str]:
    """(GPUs in all, the options) for a target of ``target_gb`` with the speculator on a GPU of its own:
    tensor parallelism over a power of two of GPUs (a model's kv heads split evenly) until the weights
    take at most WEIGHT_SHARE of each."""
    n = 1
    while target_gb / n > WEIGHT_SHARE * per_gpu and n < 8:
        n *= 2
    tdev = "cuda:0" if n == 1 else f"cuda:0-{n - 1}"
    return n + 1, f"--target-device {tdev} --draft-device cuda:{n}"


def hardware(target_repo: str, draft_repo: str | None) -> str:
    """What the pair needs and where ssd-chat would put it (empty when the target's size is unknown)."""
    t = catalog.KNOWN.get(target_repo)
    if t is None:
        return ""
    d = catalog.KNOWN.get(draft_repo) if draft_repo else None
    gpus = catalog.gpu_gb()
    per = min(gpus) if gpus else GPU_GB
    tgb, dgb = t.download_gb, (d.download_gb if d else 0.0)
    total, options = placement(tgb, per)
    more = f", more than one {catalog.gb(per)} GPU holds" if tgb > 0.9 * per else ""
    ranks = total - 1
    where = (f"the target tensor-parallel over {ranks} GPUs of {catalog.gb(per)} (about {catalog.gb(tgb / ranks)} of weights "
             f"each)" if ranks > 1 else f"the target on one GPU of {catalog.gb(per)}")
    ram = catalog.ram_gb() or 0.0
    here = catalog.describe_machine() + ("" if gpus or tgb + dgb <= 0.9 * ram else ", so it needs GPUs")
    need = (f"the pair needs about {catalog.gb(tgb + dgb)} of GPU memory in bfloat16 ({catalog.gb(tgb)} of GPU memory "
            f"for the target{more})") if d else f"it needs about {catalog.gb(tgb)} of GPU memory in bfloat16{more}"
    return (f"{need}: ssd-chat would run it with `{options}`: {where}, the speculator on cuda:{ranks}, "
            f"{total} GPUs in all; {here}")


def message(missing: list[tuple[str, str]], target: str, draft: str | None) -> str:
    """One line: every missing download with its size and the total, the licence gates, the hardware."""
    hf = catalog.hf_command()
    them = " and ".join(f"{n} ({r})" if n != r else r for n, r in missing)
    verb = "is" if len(missing) == 1 else "are"
    sizes = [catalog.KNOWN[r].download_gb if r in catalog.KNOWN else None for _, r in missing]
    cmds = []
    for (_, repo), size in zip(missing, sizes):
        cmd = f"{hf} download {repo}" + (' --exclude "original/*"' if repo.startswith("meta-llama/") else "")
        cmds.append(f"`{cmd}`" + (f" (about {catalog.gb(size)})" if size is not None else ""))
    total = (f", about {catalog.gb(sum(sizes))} in all" if None not in sizes else "") if len(missing) > 1 else ""
    pull = " ".join(n for n, _ in missing)
    parts = [f"{them} {verb} not in the local Hugging Face cache ({store.hub_cache()}) and cannot be downloaded now "
             f"(offline mode or no network); get {'them' if len(missing) > 1 else 'it'}{total}: {' and '.join(cmds)} "
             f"(or `ssd-chat models pull {pull}`)"]
    known_gated = [r for _, r in missing if r in catalog.KNOWN and catalog.KNOWN[r].gated]
    if known_gated:
        pages = " and at ".join(f"https://huggingface.co/{r}" for r in known_gated)
        parts.append(f"{'gated repositories' if len(known_gated) > 1 else 'a gated repository'}: accept its licence at "
                     f"{pages} and set HF_TOKEN (or run `{hf} auth login`) first")
    elif any(r not in catalog.KNOWN for _, r in missing):
        parts.append("if a repository is gated, accept its licence on the hub and set HF_TOKEN first")
    target_repo = models.resolve(target).source
    draft_repo = None
    if draft:
        dspec = models.resolve(draft)
        draft_repo = dspec.source if dspec.kind == "hub" else None
    hw = hardware(target_repo, draft_repo)
    if hw:
        parts.append(hw)
    parts.append(catalog.LOCAL)
    return "; ".join(parts)


def check(target: str, draft: str | None) -> list[tuple[str, str]]:
    """The hub models of the pair that are missing; offline, a NotCachedError naming all of them at once."""
    missing = absent([target] + ([draft] if draft else []))
    if missing and offline():
        raise NotCachedError(message(missing, target, draft))
    return missing
