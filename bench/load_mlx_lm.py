"""bench_load.py's baseline, run as a child process: mlx-lm on one device, measured as
load_measure.py says, and printed as one JSON object on stdout.

    python bench/load_mlx_lm.py SPEC.json

batch: the loop of mlx_lm.generate.batch_generate (a BatchGenerator with completion_batch_size
and prefill_batch_size = the stream count, so that it batches them all, and EOS as the stop
token), timed per step here to get each stream's first token; aggregate = generated tokens /
wall time of the whole call. alone and first_token: generate_step (alone stops at EOS and
drops it, as batch_generate and the runner do).
"""

import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import load_mlx_lm  # noqa: E402
from load_measure import measure  # noqa: E402


class MlxLm:
    def __init__(self, model_path: str, prefill_step_size: int):
        self.model, tokenizer = load_mlx_lm(model_path)
        self.eos = set(tokenizer.eos_token_ids)
        self.pss = prefill_step_size

    def batch(self, prompts: list, max_tokens: int) -> dict:
        from mlx_lm.generate import BatchGenerator

        n = len(prompts)
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in self.eos], completion_batch_size=n,
                             prefill_batch_size=n, prefill_step_size=self.pss)
        start = time.perf_counter()
        uids = gen.insert(prompts, max_tokens if isinstance(max_tokens, list) else [max_tokens] * n)
        tokens, first = {u: [] for u in uids}, {}
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
        wall = time.perf_counter() - start
        gen.close()
        count = sum(len(t) for t in tokens.values())
        return {"streams": n, "wall_s": wall, "tokens": count, "aggregate_tps": count / wall,
                "ttfts_s": [first[u] - start if u in first else None for u in uids],
                "token_ids": [tokens[u] for u in uids]}

    def _generate(self, prompt: list, max_tokens: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        return generate_step(mx.array(prompt, dtype=mx.uint32), self.model, max_tokens=max_tokens,
                             prefill_step_size=self.pss)

    def alone(self, prompt: list, max_tokens: int) -> list:
        out = []
        for token, _ in self._generate(prompt, max_tokens):
            if int(token) in self.eos:
                break
            out.append(int(token))
        return out

    def first_token(self, prompt: list) -> float:
        tic = time.perf_counter()
        for _ in self._generate(prompt, 1):
            return time.perf_counter() - tic
        raise RuntimeError("generate_step yielded no token")


def main(spec_path: str) -> None:
    import mlx.core as mx

    spec = json.loads(Path(spec_path).read_text())
    tic = time.perf_counter()
    client = MlxLm(spec["model"], spec["prefill_step_size"])
    out = {"load_s": time.perf_counter() - tic}
    out.update(measure(spec, client, "mlx-lm"))
    out["peak_memory_bytes"] = [mx.get_peak_memory()]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
