"""One-device mlx-lm on the same weights: the reference the pipeline must equal."""

from functools import lru_cache
from pathlib import Path
from typing import List, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from distributed.shard.config import model_args, read_config

EOS = (256, 258)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 40 ids: longer than the window (16)


@lru_cache(maxsize=None)
def mlx_lm_model(path: Path):
    config = read_config(path)
    # HF-layout configs carry rope_parameters, which mlx-lm's ModelArgs ignores.
    model, _ = load_model(Path(path), model_config={"rope_theta": model_args(config).rope_theta})
    return model


def mlx_lm_logprobs(path: Path, prompt: List[int]) -> mx.array:
    return _logprobs(Path(path), tuple(prompt))


@lru_cache(maxsize=64)
def _logprobs(path: Path, prompt: Tuple[int, ...]) -> mx.array:
    """Once per worker for each (checkpoint, prompt): parametrized tests compare many splits with
    one reference (the callers only read it)."""
    logits = mlx_lm_model(path)(mx.array(prompt)[None])[0]
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def mlx_lm_greedy(path: Path, prompt: List[int], max_tokens: int, prefill_step_size: int,
                  logits_processors=None, kv_bits=None, kv_group_size=64) -> Tuple[List[int], List[float]]:
    """Greedy tokens and their logprobs from mlx-lm's generate_step, stopping at EOS
    (with `logits_processors`, the logprobs are the processed ones). `kv_bits`: the
    full-attention layers' caches quantized from the first token (KVCache.to_quantized),
    the sliding ones whole. Without logits processors the result is kept for the worker's other
    tests that ask the same (the splits and steps of one test share a reference)."""
    if logits_processors is None:
        tokens, logprobs = _greedy(Path(path), tuple(prompt), max_tokens, prefill_step_size, kv_bits, kv_group_size)
        return list(tokens), list(logprobs)
    return _greedy_run(path, prompt, max_tokens, prefill_step_size, logits_processors, kv_bits, kv_group_size)


@lru_cache(maxsize=256)
def _greedy(path: Path, prompt: Tuple[int, ...], max_tokens: int, prefill_step_size: int, kv_bits, kv_group_size):
    tokens, logprobs = _greedy_run(path, list(prompt), max_tokens, prefill_step_size, None, kv_bits, kv_group_size)
    return tuple(tokens), tuple(logprobs)


def _greedy_run(path, prompt, max_tokens, prefill_step_size, logits_processors, kv_bits, kv_group_size):
    model = mlx_lm_model(path)
    cache = [c.to_quantized(kv_group_size, kv_bits) if kv_bits and type(c) is KVCache else c
             for c in model.make_cache()]
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                                   prefill_step_size=prefill_step_size, logits_processors=logits_processors):
        if token in EOS:
            break
        tokens.append(token)
        logprobs.append(lp[token].item())
    return tokens, logprobs


def mlx_lm_masked_greedy(path: Path, prompt: List[int], grammar: str, max_tokens: int) -> List[int]:
    """Greedy tokens of mlx-lm's generate_step with llguidance's own mask as a logits
    processor (constrained decoding's reference), up to EOS."""
    import llguidance
    import llguidance.hf
    import numpy as np
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    vocab = mlx_lm_model(path).args.vocab_size
    ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(ll, grammar)
    fed = []

    def mask(history, logits):
        for token in history.tolist()[len(prompt) + len(fed):]:
            assert matcher.consume_token(token)
            fed.append(token)
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    tokens = []
    for token, _ in generate_step(mx.array(prompt), mlx_lm_model(path), max_tokens=max_tokens,
                                  prefill_step_size=16, logits_processors=[mask]):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    return tokens
