"""What we know about the hub models behind the aliases, and about this machine, before any download.

Sizes are the published bf16 safetensors checkpoints (parameters from each model card; the
download is 2 bytes per parameter).  They let a user hear, before a 141 GB download starts,
how to fetch a model and whether it can run here at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Known:
    params_b: float  # billions of parameters in the checkpoint
    gated: bool = False  # the hub asks for a licence to be accepted first

    @property
    def download_gb(self) -> float:
        return 2.0 * self.params_b  # bf16 safetensors


KNOWN: dict[str, Known] = {
    "meta-llama/Llama-3.1-70B-Instruct": Known(70.6, gated=True),
    "meta-llama/Llama-3.1-8B-Instruct": Known(8.03, gated=True),
    "meta-llama/Llama-3.2-3B-Instruct": Known(3.21, gated=True),
    "meta-llama/Llama-3.2-1B-Instruct": Known(1.24, gated=True),
    "Qwen/Qwen3-32B": Known(32.8),
    "Qwen/Qwen3-8B": Known(8.19),
    "Qwen/Qwen3-1.7B": Known(2.03),
    "Qwen/Qwen3-0.6B": Known(0.75),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": Known(1.71),
    "HuggingFaceTB/SmolLM2-360M-Instruct": Known(0.362),
    "HuggingFaceTB/SmolLM2-135M-Instruct": Known(0.135),
}

_BYTES = {torch.float32: 4, torch.float64: 8}  # everything else we load is 2 bytes per weight


def gb(v: float) -> str:
    return f"{v:.0f} GB" if v >= 10 else f"{v:.1f} GB"


def ram_gb() -> float | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def gpu_gb() -> list[float]:
    """Memory of each CUDA GPU, in GB (empty without one)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 1e9 for i in range(torch.cuda.device_count())]


def describe_machine() -> str:
    gpus = gpu_gb()
    ram = ram_gb()
    ram_s = f"{gb(ram)} of RAM" if ram else "unknown RAM"
    if not gpus:
        return f"this machine has no CUDA GPU and {ram_s}"
    return f"this machine has {len(gpus)} CUDA GPU(s) with {' + '.join(gb(g) for g in gpus)} and {ram_s}"


def hf_command() -> str:
    """The hub CLI as the user can run it: ``hf`` when it is on PATH, else the one installed next to this
    Python (``.venv/bin/hf``: installed with huggingface-hub, but a venv that is not activated is not on PATH)."""
    import shutil
    import sys
    from pathlib import Path

    if shutil.which("hf"):
        return "hf"
    here = Path(sys.executable).parent / "hf"
    if not here.is_file():
        return "hf"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


LOCAL = "a local model folder or a .gguf file works as well (give its path instead)"


def fetch_hint(repo_id: str) -> str:
    """How to get ``repo_id`` into the local cache, what it costs, and whether it fits here (one line)."""
    k = KNOWN.get(repo_id)
    hf = hf_command()
    cmd = f"{hf} download {repo_id}" + (' --exclude "original/*"' if repo_id.startswith("meta-llama/") else "")
    parts = [f"get it with `{cmd}`"]
    if k is not None:
        parts[0] += f" (about {gb(k.download_gb)})"
    if k is None or k.gated:
        gate = (f"a gated repository: accept its licence at https://huggingface.co/{repo_id} and set HF_TOKEN "
                f"(or run `{hf} auth login`) first")
        parts.append(gate if k is not None else "if the repository is gated, accept its licence on the hub and set HF_TOKEN first")
    if k is not None:
        parts.append(f"running it needs about {gb(2 * k.params_b)} of GPU memory in bfloat16 "
                     f"({gb(4 * k.params_b)} of RAM in float32 on CPU); {describe_machine()}")
    parts.append(LOCAL)
    return "; ".join(parts)


GGUF_4BIT = 0.6  # bytes per parameter of a 4-bit GGUF (Q4_K_M: about 4.8 bits a weight)


def fits_instead(repo_id: str, device: torch.device, dtype: torch.dtype, have: float, aliases: dict[str, str]) -> list[str]:
    """What would fit in ``have`` GB where a known model will not: bfloat16, a 4-bit GGUF (CPU: this engine
    computes in a GGUF's own blocks there), or the largest smaller sibling among ``aliases`` (alias -> hub id)."""
    k = KNOWN[repo_id]
    room = 0.9 * have
    out = []
    if dtype != torch.bfloat16 and 2 * k.params_b <= room:
        out.append(f"`--dtype bfloat16` (about {gb(2 * k.params_b)})")
    if device.type == "cpu" and GGUF_4BIT * k.params_b <= room:
        out.append(f"a 4-bit GGUF of it (about {gb(GGUF_4BIT * k.params_b)}; give the .gguf file as the model)")
    family = next((a.rsplit("-", 1)[0] for a, h in aliases.items() if h == repo_id), None)
    size = _BYTES.get(dtype, 2)
    siblings = sorted(((KNOWN[h].params_b, a) for a, h in aliases.items()
                       if h in KNOWN and a.rsplit("-", 1)[0] == family and KNOWN[h].params_b < k.params_b), reverse=True)
    for nbytes, dt in ((size, dtype), (2, torch.bfloat16)):  # in the dtype asked for, else in bfloat16
        fit = next(((p, a) for p, a in siblings if nbytes * p <= room), None)
        if fit is not None:
            flag = "" if dt == dtype else " with --dtype bfloat16"
            out.append(f"the smaller {fit[1]}{flag} (about {gb(nbytes * fit[0])} in {str(dt).removeprefix('torch.')})")
            break
    return out


def memory_warning(name: str, repo_id: str, device: torch.device, dtype: torch.dtype, devices: int = 1,
                   aliases: dict[str, str] | None = None) -> str | None:
    """A warning when a known model cannot fit where it is about to load (weights alone), else None;
    it says what would fit instead (:func:`fits_instead`)."""
    k = KNOWN.get(repo_id)
    if k is None:
        return None
    need = k.params_b * _BYTES.get(dtype, 2)
    if device.type == "cuda":
        gpus = gpu_gb()
        have = sum(gpus[device.index or 0:][:devices])
        where = f"GPU memory in {str(dtype).removeprefix('torch.')}"
    elif device.type == "cpu":
        have = ram_gb() or 0.0
        if not have:
            return None
        where = f"RAM in {str(dtype).removeprefix('torch.')} on CPU" + (
            f" ({gb(2 * k.params_b)} of GPU memory in bfloat16)" if dtype != torch.bfloat16 else "")
    else:
        return None
    if need <= 0.9 * have:  # the rest is for activations and the KV cache
        return None
    instead = fits_instead(repo_id, device, dtype, have, aliases or {})
    return (f"'{name}' ({repo_id}, {k.params_b:g}B parameters) will not fit here: it needs about {gb(need)} of {where}; "
            f"{describe_machine()}. The download alone is about {gb(k.download_gb)}. "
            + (f"What fits: {'; or '.join(instead)}" if instead else "Nothing smaller of its family fits here either"))
