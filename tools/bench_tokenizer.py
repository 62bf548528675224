"""Seconds to tokenize a text of N characters without spaces (one pre-tokenizer piece), for a GGUF model's BPE.

    python3 tools/bench_tokenizer.py [--model FILE] [N ...]

Default model: the engine's default (SmolLM2-135M-Instruct), when it is here. Each text is tokenized once, its
pieces not cached before (a fresh tokenizer per text), so the figure is the BPE merge's and the split's cost.
"""

import argparse
import time

from pagedrt.engine import loader, model_path
from pagedrt.engine.tokenizer import Tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the engine's default model, not fetched)")
    parser.add_argument("sizes", nargs="*", type=int, default=[8_000, 100_000])
    args = parser.parse_args()
    path = model_path(args.model, fetch=False)
    vocab = loader.read_vocabulary(loader.open_gguf(path).fields)
    print(f"{path.name}: {len(vocab.tokens)} tokens, {len(vocab.merges)} merges")
    for n in args.sizes:
        for name, text in (("'a' * n", "a" * n), ("'the' * n/3", ("the" * (n // 3 + 1))[:n])):
            tokenizer = Tokenizer(vocab)
            start = time.perf_counter()
            ids = tokenizer.encode(text, bos=False)
            print(f"{n:>9,} characters, {name:12s}: {time.perf_counter() - start:6.3f} s, {ids.size:,} tokens")


if __name__ == "__main__":
    main()
