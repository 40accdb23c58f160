#!/usr/bin/env python3
"""Writes the JSONL request files of the engine benchmark (bench/engine_batch.sh).

  batch_prompts.py books CORPUS_DIR N WORDS MAX_TOKENS   N excerpts of WORDS words, each from
                                                          another book (cycling), raw prompts
  batch_prompts.py prefix CORPUS_DIR N WORDS MAX_TOKENS  N requests sharing one excerpt of WORDS
                                                          words, each ending with its own question
"""
import json
import pathlib
import sys


def excerpt(path, words, skip=2000):
    """WORDS words of the book from word SKIP on; SKIP wraps around a book too short for it."""
    text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace").split()
    if len(text) < words:
        sys.exit(f"batch_prompts.py: {path} has {len(text)} words, fewer than the {words} of an excerpt")
    skip %= len(text) - words + 1
    return " ".join(text[skip:skip + words])


def main():
    mode, corpus, n, words, max_tokens = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    books = sorted(p for p in corpus.glob("*.txt"))
    if not books:
        sys.exit(f"batch_prompts.py: no .txt books in {corpus}")
    questions = ["Who speaks first?", "Where does this take place?", "What happens next?",
                 "Summarize it in one line.", "Which names appear?", "What is the mood?",
                 "What time of day is it?", "What does the narrator want?"]
    seen = set()
    for i in range(n):
        if mode == "books":
            prompt = excerpt(books[i % len(books)], words, skip=2000 + 500 * (i // len(books)))
        elif mode == "prefix":
            prompt = excerpt(books[0], words) + "\n\nQuestion " + str(i) + ": " + questions[i % len(questions)]
        else:
            sys.exit("batch_prompts.py: mode is books or prefix")
        if prompt in seen:  # a short book's excerpts wrapped onto one already given
            sys.exit(f"batch_prompts.py: request {i} repeats an earlier excerpt (too few words in {corpus})")
        seen.add(prompt)
        print(json.dumps({"id": f"{mode}{i}", "prompt": prompt, "max_tokens": max_tokens}))


if __name__ == "__main__":
    main()
