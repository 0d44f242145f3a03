"""One depth of the speculator's tree: B branch rows drawn at once, each penalized for its own prefix.

Every operation is batched over the rows: the penalties are index operations on the rows' seen ids,
done in place on the depth's logits and undone after the draw (:meth:`Penalties.applied`: a fresh
[B, V] copy per depth costs more than the draw on a CPU), and the draw and q' stay on the top-k
support (:func:`support.top_support`): q' for all B x k draws is [B, k, top_k], and only the served
branch's k rows are made dense (:func:`support.as_dense`).  q' is exactly the distribution each token
was drawn from, as :func:`sampling.draw_draft` defines it; ``lab/sampling_cost.py`` times this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.penalties import Penalties
from ..sampling.sampling import draw_draft
from ..sampling.support import Support
from ..params import SamplingParams


def draw_depth(logits: torch.Tensor, pen: Penalties, prefixes: Sequence[Sequence[int]], drawn: torch.Tensor | None,
               params: SamplingParams, saguaro_c: float, gen: torch.Generator, num_top: int = 0) -> tuple[torch.Tensor, torch.Tensor | Support | None]:
    """Tokens [B] for ``logits`` [B, V] (left as they were) and q' ([B, V] or its support; None under
    greedy).  Row b is penalized for the committed tokens, ``prefixes[b]`` and ``drawn[b]`` ([B, d] on
    the device); q' is Saguaro-reshaped over the top ``num_top`` when ``saguaro_c`` < 1."""
    p = params
    with pen.applied(logits, prefixes, drawn) as x:  # the draw's outputs are new tensors: none aliases x
        return draw_draft(x, p.temperature, p.top_k, p.top_p, gen, saguaro_c, num_top, dense=False)
