#!/usr/bin/env python3
"""A plain byte-level BPE trainer, the reference kvlab's train_bpe is tested against.

    bpe_reference.py CORPUS VOCAB_SIZE PATTERN  prints one merge per line: "left right token"

It recounts every pair before each merge (slow, but obviously right). Tie rule, as kvlab's:
the highest count, then the lowest (left, right) pair of ids. 256 byte tokens (id = byte
value), then one token per merge; one special token (<|endoftext|>) comes after the merges.
Needs the `regex` module (Debian: python3-regex) for the \\p{L} classes of the patterns.
"""
import collections
import sys

import regex

PATTERNS = {
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "cl100k": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
PATTERNS["kvlab"] = PATTERNS["cl100k"]


def merge(ids, pair, token):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(token)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train(text, vocab_size, pattern):
    chunks = collections.Counter(regex.findall(PATTERNS[pattern], text))
    words = [(list(chunk.encode("utf-8")), count) for chunk, count in chunks.items()]
    merges = []
    for token in range(256, vocab_size - 1):
        pairs = collections.Counter()
        for ids, count in words:
            for pair in zip(ids, ids[1:]):
                pairs[pair] += count
        if not pairs:
            raise SystemExit(f"no pair left after {len(merges)} merges")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append((best[0], best[1], token))
        words = [(merge(ids, best, token), count) for ids, count in words]
    return merges


def main():
    corpus, vocab_size, pattern = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(corpus, encoding="utf-8", newline="") as f:  # \r\n kept as it is
        text = f.read()
    for left, right, token in train(text, vocab_size, pattern):
        print(left, right, token)


if __name__ == "__main__":
    main()
