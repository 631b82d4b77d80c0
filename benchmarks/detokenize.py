"""A streamed reply's detokenization: decoding every token's whole text again against
:class:`rl2gem.serving.openai_routes.IncrementalText`, side by side in one run.

A stream sends each new piece of text as tokens arrive. Decoding the whole reply at each token
costs O(n^2) over a reply of ``n`` tokens, and on the server's event loop that time is taken
from every other stream and, through the GIL, from the embedded engine's thread. The incremental
text decodes only the tokens since the update before last. Random token ids of SmolLM2's
vocabulary, one update per token (the CPU's embedded engine runs one token per round; a GPU's
runs four).

Run: ``python benchmarks/detokenize.py`` (``--lengths 500,2000,8000``).
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from rl2gem.models import resolve_model
from rl2gem.serving.openai_routes import IncrementalText


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,2000,8000", help="reply lengths in tokens, comma-separated")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    rng = random.Random(0)
    print("| reply tokens | whole text each token, s | incremental, s | speed-up |")
    print("|---:|---:|---:|---:|")
    for length in (int(n) for n in args.lengths.split(",")):
        ids = [rng.randrange(200, tokenizer.vocab_size) for _ in range(length)]
        start = time.perf_counter()
        for end in range(1, length + 1):
            whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
        again = time.perf_counter() - start
        incremental, start = IncrementalText(tokenizer), time.perf_counter()
        for end in range(1, length + 1):
            incremental.update(ids[:end])
        once = time.perf_counter() - start
        if incremental.text != whole:
            raise SystemExit(f"the incremental text differs from the whole decode at {length} tokens")
        print(f"| {length} | {again:.3f} | {once:.3f} | {again / once:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
