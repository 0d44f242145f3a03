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

Greedy runs also check that SD and SSD produced exactly AR's tokens.
"""


class BenchError(Exception):
    """A problem with the benchmark's own arguments or environment (printed as one line)."""
