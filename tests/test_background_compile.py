"""``--compile auto`` on CPU builds missing graphs in the background (engine/model/background.py): a reply
whose shape is not compiled answers eagerly at once, says so before its first token, keeps its path to its
end, records it (``Stats.path``), and compile time enters no figure.  Tiny models; the build is a fake that
finishes when the test says so, except where a real build process is started and stopped."""

from __future__ import annotations

import time

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from ssd_chat.engine.cpu import quant
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done, Notice, Token
from ssd_chat.engine.model import aoti, background
from ssd_chat.engine.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeBuild:
    """background.Build's interface; ``finish()`` hands the packages over as a real build's watcher does."""

    made: list["FakeBuild"] = []

    def __init__(self, source, core_cls, name, mid_layer, width, jobs, on_built, on_failed):  # noqa: ARG002
        self.jobs, self.on_built, self.closed, self.done = list(jobs), on_built, False, 0
        FakeBuild.made.append(self)

    @property
    def running(self):
        return not self.closed and self.done < len(self.jobs)

    def current(self):
        r, t, _path = self.jobs[min(self.done, len(self.jobs) - 1)]
        return r, t, 0.4

    def finish(self):
        for r, t, path in self.jobs:
            self.on_built(r, t, path)
            self.done += 1

    def close(self):
        self.closed = True


class Graph:
    """A "package": the core's own graph for that row count, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.fixture
def auto_cpu(monkeypatch, tmp_path):
    """A tiny float target that ``auto`` compiles on CPU (as it does a Q4 GGUF one), with fake builds."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant, "int4_ready", lambda model: True)
    FakeBuild.made = []
    monkeypatch.setattr(background, "Build", FakeBuild)
    graphs: dict = {}
    monkeypatch.setattr(aoti, "load_package", lambda path: graphs[str(path)], raising=False)  # raising: the old code had none
    target = as_loaded(tiny_llama(head_scale=3.0, dtype=torch.float32), CharTokenizer(64), "t")
    return target, graphs


def started(eng: Engine) -> None:
    """Wait until the builds asked for have started (they start from a thread of their own)."""
    for core in eng.target.forwards._cores.values():
        for t in getattr(core.compiler, "_spawners", []):  # none on the old code, which compiled inline
            t.join()


def provide(eng: Engine, graphs: dict) -> list[Graph]:
    """The fake packages for every job of the builds started so far, each build finished in turn (a build
    starts once the one before it has finished)."""
    made: list[Graph] = []
    core = next(iter(eng.target.forwards._cores.values()))
    spawners = [t for c in eng.target.forwards._cores.values() for t in c.compiler._spawners]
    finished: set[int] = set()
    while any(t.is_alive() for t in spawners) or len(finished) < len(FakeBuild.made):
        for t in spawners:
            t.join(0.2)
        for b in list(FakeBuild.made):
            if id(b) in finished:
                continue
            for r, _t, path in b.jobs:
                graphs[str(path)] = g = Graph(core.graph_for(r))
                made.append(g)
            b.finish()
            finished.add(id(b))
    return made


def test_an_uncompiled_shape_answers_eagerly_with_the_notice_first(auto_cpu):
    target, graphs = auto_cpu
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:
        evs = list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0)))
        first = next(i for i, e in enumerate(evs) if isinstance(e, Token))
        notes = [e.message for e in evs[:first] if isinstance(e, Notice)]
        assert any("compiling t for 1 row in the background" in n for n in notes), notes
        started(eng)
        assert len(FakeBuild.made) == 1 and FakeBuild.made[0].running
        assert evs[-1].stats.path == "eager"
        assert eng.describe()["compiling"] == "compiling t for 1 row in the background, 40%"
        assert eng.describe()["forward"] == "core eager"


def test_the_status_names_the_shape_being_built_and_counts_those_after_it(auto_cpu):
    """A graph is built per thread count as well (bench: AR on 2 threads, SSD's verifier on 1): the status names
    the shape under way and says how many wait, rather than listing rows the running build is not making."""
    target, _graphs = auto_cpu
    threads = torch.get_num_threads()
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0)))
            core = next(iter(eng.target.forwards._cores.values()))
            deadline = time.monotonic() + 10
            while not FakeBuild.made and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sorted(core.compiler._building) == [(1, 1), (1, 2)] and len(FakeBuild.made) == 1  # one at a time
            assert eng.describe()["compiling"] == "compiling t for 1 row in the background, 40%, then 1 more shape"
        finally:
            torch.set_num_threads(threads)


def test_the_path_switches_only_between_replies(auto_cpu):
    target, graphs = auto_cpu
    params = SamplingParams(max_new_tokens=12, temperature=0)
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:
        eager = list(eng.stream([1, 2, 3], params))[-1]
        made: list[Graph] = []
        evs = []
        for ev in eng.stream([1, 2, 3], params):
            evs.append(ev)
            if isinstance(ev, Token) and not made:  # the build finishes inside this reply
                made = provide(eng, graphs)
        assert made and all(g.calls == 0 for g in made)  # not taken inside the reply
        assert evs[-1].stats.path == "eager" and evs[-1].token_ids == eager.token_ids
        nxt = list(eng.stream([1, 2, 3], params))[-1]
        assert nxt.stats.path == "compiled" and sum(g.calls for g in made) > 0
        assert eng.describe()["forward"] == "core compiled" and eng.describe()["compiling"] is None
    assert len(FakeBuild.made) == 1  # one build for the shape, however many replies asked


def test_sd_equals_ar_on_each_path(auto_cpu):
    target, graphs = auto_cpu
    params = SamplingParams(max_new_tokens=16, temperature=0)
    draft = as_loaded(tiny_llama(head_scale=3.0, dtype=torch.float32, seed=1), CharTokenizer(64), "d")
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as ar, \
            Engine(EngineConfig(mode="sd", k=2, compile="auto"), target, draft) as sd:
        a, s = list(ar.stream([4, 5, 6], params))[-1], list(sd.stream([4, 5, 6], params))[-1]
        assert a.stats.path == s.stats.path == "eager" and a.token_ids == s.token_ids
        provide(ar, graphs)
        assert len(FakeBuild.made) == 2  # AR's 1 row, SD's 3 rows: one after the other
        a, s = list(ar.stream([4, 5, 6], params))[-1], list(sd.stream([4, 5, 6], params))[-1]
        assert a.stats.path == s.stats.path == "compiled" and a.token_ids == s.token_ids


def test_compile_time_enters_no_figure(auto_cpu, monkeypatch):
    """A build that takes seconds to start (on the old code: to compile, inline) is not in TTFT or tok/s."""
    target, graphs = auto_cpu
    slow = 3.0

    class SlowBuild(FakeBuild):
        def __init__(self, *a):
            super().__init__(*a)
            time.sleep(slow)

    def inline(core, rows, example, progress, *a, **kw):  # what the old code did: compile before the reply
        progress(f"compiling {core.name} for {rows} rows (once)")
        time.sleep(slow)
        return core.graph_for(rows)

    monkeypatch.setattr(background, "Build", SlowBuild)
    monkeypatch.setattr(aoti, "load_or_build", inline)
    eng = Engine(EngineConfig(mode="ar", compile="auto"), target)  # not Engine.load: no warm-up before the reply
    with eng:
        t0 = time.perf_counter()
        done = list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=6, temperature=0)))[-1]
        started(eng)
        wall = time.perf_counter() - t0
    assert isinstance(done, Done)
    assert wall >= slow  # the slow start did happen, during this test
    assert done.stats.ttft_s < slow and done.stats.elapsed_s < slow and done.stats.prefill_s < slow


def test_closing_during_a_real_background_build_leaves_no_process(monkeypatch, tmp_path):
    """Ctrl-C in ask / the app closing: Engine.close stops the build process and removes its temporary
    files; no package appears half-written."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant, "int4_ready", lambda model: True)
    target = as_loaded(tiny_llama(dtype=torch.float32), CharTokenizer(64), "t")
    eng = Engine(EngineConfig(mode="ar", compile="auto"), target)
    list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0)))
    core = next(iter(target.forwards._cores.values()))
    for t in core.compiler._spawners:
        t.join()
    (build,) = core.compiler._builds
    deadline = time.monotonic() + 120
    while not build.proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = build.proc.pid
    assert build.proc.is_alive()
    eng.close()
    assert not build.proc.is_alive()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
    aoti_dir = tmp_path / "aoti"
    assert not list(aoti_dir.glob("*.tmp.pt2")) if aoti_dir.exists() else True
    assert not list(aoti_dir.glob("*.pt2")) if aoti_dir.exists() else True


@pytest.mark.slow
def test_a_real_background_build_is_taken_by_the_next_reply(monkeypatch, tmp_path):
    """The build process rebuilds the model from its recipe, writes the package, the watcher loads it, and the
    next reply runs compiled, with the eager reply's greedy tokens (a tiny float32 model)."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant, "int4_ready", lambda model: True)
    target = as_loaded(tiny_llama(head_scale=3.0, dtype=torch.float32), CharTokenizer(64), "t")
    params = SamplingParams(max_new_tokens=12, temperature=0)
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:
        first = list(eng.stream([1, 2, 3], params))[-1]
        assert first.stats.path == "eager"
        eng.target.forwards.wait_for_builds()
        core = next(iter(target.forwards._cores.values()))
        assert core.compiler._bg_failed is None and list(core.compiler._ready) == [(1, torch.get_num_threads())]
        assert [p.name for p in (tmp_path / "aoti").glob("*.pt2")] and not list((tmp_path / "aoti").glob("*.tmp.pt2"))
        second = list(eng.stream([1, 2, 3], params))[-1]
    assert second.stats.path == "compiled" and second.token_ids == first.token_ids


def test_a_package_on_disk_makes_its_first_call_at_load(auto_cpu):
    """A package's first call costs about a second (lazy loads, numba's head kernel): ``warm`` makes it behind
    the load line, so the first reply's TTFT is a warm one (``ask`` once spent 1.07 s on it, now 0.26)."""
    target, graphs = auto_cpu
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:
        list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0)))
        made = provide(eng, graphs)  # the background build of the 1-row shape, "on disk" from now on
    with Engine(EngineConfig(mode="ar", compile="auto"), target) as eng:  # a second start: the package is here
        core = next(iter(eng.target.forwards._cores.values()), None)
        before = sum(g.calls for g in made)
        eng.warm()
        assert sum(g.calls for g in made) == before + 1  # one call per row shape, before any reply
        assert list(eng.stream([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0)))[-1].stats.path == "compiled"
        assert core is None or core.compiler.path == "compiled"


def test_a_package_another_process_is_building_is_waited_for_not_built_again(tmp_path):
    """A first start's app and its mode probe's measurer want the same packages at once: the second waits for the
    first's build (minutes of CPU on a small machine) and takes its package."""
    import subprocess
    import sys

    path = tmp_path / "aoti" / "m-1rows-00000000000000000000.pt2"
    path.parent.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                              "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('building', flush=True)\n"
                              "time.sleep(1.5); open(sys.argv[2], 'wb').write(b'package')",
                              str(path.with_suffix(".lock")), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "building"
        said: list[str] = []
        core = type("Core", (), {"name": "m"})()  # no graph: it must not build
        assert aoti.load_or_build(core, 1, (), said.append, path, load=False) is None
        assert said == ["waiting for another ssd-chat compiling m for 1 row"] and path.read_bytes() == b"package"
    finally:
        other.kill()
        other.wait()
