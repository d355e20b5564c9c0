"""One running request: stop strings in streamed text, and its own random key."""

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from distributed.request import GenerationRequest
from distributed.scheduler import RequestHandle
from distributed.sequence import Sequence, StopStrings


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["END"])
    assert s.feed("abcE") == ("abc", False)
    assert s.feed("N") == ("", False)
    assert s.feed("x") == ("ENx", False)
    assert s.feed("yyEND and more") == ("yy", True)
    assert StopStrings([]).feed("abc") == ("abc", False)


def draws(tokenizer, seed, disturb):
    request = GenerationRequest([1, 2, 3], temperature=1.0, top_p=0.9, seed=seed)
    seq = Sequence(RequestHandle(request), tokenizer, slot=5)
    logprobs = mx.log(mx.softmax(mx.arange(50, dtype=mx.float32)[None] / 10, axis=-1))
    out = []
    for i in range(12):
        if disturb:
            mx.random.seed(i)  # other requests drawing from the global state meanwhile
            mx.random.uniform()
        out.append(seq.sample(logprobs).item())
    return out


def test_a_seeded_request_draws_from_its_own_key(hf_checkpoint):
    tokenizer = load_tokenizer(hf_checkpoint)
    assert draws(tokenizer, 3, disturb=False) == draws(tokenizer, 3, disturb=True)
    assert draws(tokenizer, 3, disturb=False) != draws(tokenizer, 4, disturb=False)
