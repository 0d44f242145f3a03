"""``auto``'s measurement in a process of its own: what the app and ``serve`` start, at the lowest priority,
when this setup has no record yet (``python -m ssd_chat.chat.measure PARENT_PID CONFIG_JSON``), and what
``ssd-chat config measure`` runs in the foreground.  Either stores a record (engine/startup/probe_store.py)
that every later start reads; the key's lock keeps a second measurer from starting."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any


def measure_now(values: dict[str, Any]) -> tuple[str | None, str, Any]:
    """Measure ``values``' setup now, as ``auto`` would run it, with the load line on a terminal; returns
    :func:`probe.in_config`'s (mode, why, record), or without loading when ``auto`` has nothing to measure
    here (no draft, no room for the speculator).  SSDChatError when another process is measuring it."""
    from .settings import engine_config
    from ..engine import probe_in_config as in_config, probe_listed as listed, probe_key_fields as key_fields
    from ..engine import probe_measuring as measuring, SSDChatError, preflight as check
    from .loading import load_engine

    values = {**values, "mode": "auto"}
    pre = check(engine_config(values))
    if pre.probe and measuring(key_fields(pre.config, pre.draft)):  # said before minutes of loading, not after
        raise SSDChatError(f"another ssd-chat is measuring {listed(pre.probe)} for this setup now; "
                           "`ssd-chat config` shows its result when it is done")
    if pre.probe:
        load_engine(values, measure="now").close()
    return in_config(pre)


def main(argv: list[str]) -> int:
    parent, config = int(argv[0]), json.loads(argv[1])
    from ..engine import processes

    processes.die_with_parent()
    if os.getppid() != parent:  # it died before PR_SET_PDEATHSIG took hold
        return 0
    with contextlib.suppress(OSError):
        os.nice(19)  # before torch starts its threads, which inherit it: the user's replies come first
    from ..engine import Engine, EngineConfig, SSDChatError
    from .loading import quiet_libraries

    quiet_libraries()
    try:
        with Engine.load(EngineConfig(**config), measure="now"):
            pass
    except SSDChatError as e:  # another process measures it, or the setup cannot load: nothing to store
        print(f"ssd-chat: measure: {e}", file=sys.stderr)  # seen with SSD_CHAT_DEBUG
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
