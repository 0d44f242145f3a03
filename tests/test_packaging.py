"""What the wheel ships: the code, the demo script, the prompt sets, the shipped drafts, the recorded
session and the simulation's hardware profiles; not measurements (bench reports and plots live in docs/results/)
nor the scripts that take them (lab/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

SOURCES = ("pyproject.toml", "README.md", "ssd_chat", "engine", "tui", "assets", "lab")  # lab/: to show it stays out


def test_the_wheel_ships_code_and_assets_not_measurements(repo_root, tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:  # a copy: building writes build/ and *.egg-info next to the sources
        path = repo_root / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    names = zipfile.ZipFile(next(out.glob("*.whl"))).namelist()
    # one module of every installed package, the package's own folder and nothing else at the top
    for want in ("ssd_chat/cli/__init__.py", "ssd_chat/bench/runner.py", "ssd_chat/engine/engine.py", "ssd_chat/tui/app.py",
                 "ssd_chat/train/loop.py", "ssd_chat/tui/widgets/__init__.py", "ssd_chat/assets/__init__.py",
                 "ssd_chat/tui/app.tcss", "ssd_chat/assets/demo/01_hello.txt", "ssd_chat/assets/prompts/chat.jsonl",
                 "ssd_chat/assets/drafts/smollm2-135m-instruct/draft.safetensors",
                 "ssd_chat/assets/recordings/ssd_smollm2_cpu.jsonl", "ssd_chat/assets/distill_prompts.jsonl",
                 "ssd_chat/assets/profiles/h100-70b-1b.json"):
        assert want in names, want
    data = [n for n in names if n.startswith("ssd_chat/assets/")]
    inputs = ("/drafts/", "/profiles/")  # a draft's config, bench --simulate's latency models
    assert not [n for n in data if n.endswith((".json", ".png", ".md")) and not any(i in n for i in inputs)], data
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"ssd_chat"}
    assert not [n for n in names if "/lab/" in n or "gpucheck" in n or "cpu_perf" in n or n.endswith("_bench.py")], names
