from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.events import Done, Token
from ssd_chat.engine.params import SamplingParams


def test_tiny_ar_runs(tiny_target):
    evs = list(ARDecoder(tiny_target).stream([1, 2, 3], SamplingParams(max_new_tokens=8)))
    assert isinstance(evs[-1], Done) and evs[-1].reason == "length"
    assert len([e for e in evs if isinstance(e, Token)]) == 8
