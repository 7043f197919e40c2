#!/usr/bin/env python3
"""Long-document QA through the patched llama.cpp (issue #69): questions whose answer is in a long document given
through the model's chat template, answered greedily under dense, sparse and local-only attention.

Each document is prose from a text file (WikiText-2 *test* by default: evaluation data, never calibration data) of
about --doc-tokens tokens, with --records short records spread through it at stratified random depths, one per
sentence boundary: "The registration number of <Name> is <number>." Names are fictional (syllables drawn from a
seeded RNG, every first and last name distinct within a document), numbers 5-digit, distinct, and absent from the
prose. Every record is asked once, as the user turn "<instruction> Document: <doc> Question: What is the registration
number of <Name>? ..." rendered with the GGUF's chat template (generate/chat.py, as `dsa run --chat` renders it); so
the records are each other's distractors (RULER's multi-key retrieval), and most answers lie far outside a local
window. Answers are greedy (eval/needle_llamacpp.py's backend: up to EOS, a newline or --max-new tokens); an answer is
correct when its first integer is the record's number (eval/needle.is_hit). The report gives per mode the accuracy,
and against dense the share of questions answered with the same text and with the same correctness; per question
the record's distance in tokens from the end of the prompt (local-only attention can see only the last `local`).

    python3 scripts/bench/docqa.py FILE.gguf [--text wiki.test.raw] [--docs 3 --records 20 --doc-tokens 7000 --ask N] \
        [--attn dense,sparse,local] [--top-k K] [--ctx N] [--seed 0] [--max-new 40] [--n-gpu-layers N] \
        [--threads N] [--out docqa.json]

--ctx defaults to the file's trained context; the prompt (document, question, template) must fit it with --max-new.
Progress goes to stderr; the JSON report to --out (atomic) or stdout. Bad input: one `error:` line, exit 3.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

INSTRUCTION = "Read the document below, then answer the question that follows it."
QUESTION = "What is the registration number of {name}? Answer with the number only."
RECORD = "The registration number of {name} is {number}."
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v",
          "z", "th", "sh", "ch"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "th", "x", "nd", "rk"]


@dataclass
class Record:
    name: str
    number: int
    depth: float            # where it was placed: share of the document's sentences before it
    char_pos: int = 0       # its offset in the document text


@dataclass
class Document:
    text: str
    records: list[Record]
    start_paragraph: int    # first paragraph of the source text used


def clean_wikitext(text: str) -> list[str]:
    """Prose paragraphs of a WikiText raw file: headings (" = Title = ") and blank lines dropped, the tokenizer
    escapes (" @-@ ", " @,@ ", " @.@ ") and the spaces before punctuation undone."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("="):
            continue
        s = s.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
        s = re.sub(r" ([,.;:!?)'])", r"\1", s).replace("( ", "(")
        s = re.sub(r" n't\b", "n't", s)
        out.append(s)
    return out


def split_sentences(paragraph: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", paragraph)
    return [p for p in parts if p]


def fictional_name(rng: random.Random, syllables: int) -> str:
    s = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
    return s.capitalize()


def make_names(rng: random.Random, n: int) -> list[str]:
    """n "First Last" names; no first name, last name or full name repeats, none is a prefix of another."""
    firsts: set[str] = set()
    lasts: set[str] = set()
    out = []
    while len(out) < n:
        f, la = fictional_name(rng, rng.choice((2, 3))), fictional_name(rng, rng.choice((2, 3)))
        if len(f) < 4 or len(la) < 4 or f == la:
            continue
        taken = firsts | lasts
        if any(a.startswith(b) or b.startswith(a) for a in (f, la) for b in taken):
            continue
        firsts.add(f)
        lasts.add(la)
        out.append(f"{f} {la}")
    return out


def make_numbers(rng: random.Random, n: int, avoid: str) -> list[int]:
    """n distinct 5-digit numbers, none of which occurs in `avoid` (the prose)."""
    out: list[int] = []
    while len(out) < n:
        x = rng.randrange(10000, 100000)
        if x not in out and str(x) not in avoid:
            out.append(x)
    return out


def build_document(paragraphs: list[str], n_records: int, n_tokens: int, count_tokens: Callable[[str], int],
                   rng: random.Random) -> Document:
    """A document of at most n_tokens tokens (count_tokens counts them): consecutive paragraphs from a random start
    with n_records records inserted at sentence boundaries, one per stratum of depth ((i + u) / n_records)."""
    if n_records < 1:
        raise ValueError("n_records must be >= 1")
    if len(paragraphs) < 2:
        raise ValueError("the text has fewer than 2 prose paragraphs")
    start = rng.randrange(len(paragraphs))
    record_budget = n_records * count_tokens(RECORD.format(name="Xxxxxxxx Yyyyyyyyy", number=12345))
    sentences: list[str] = []
    para_ends: set[int] = set()            # indices of sentences that end a paragraph
    total, i = 0, start
    while total < n_tokens - record_budget:
        p = paragraphs[i % len(paragraphs)]
        s = split_sentences(p)
        sentences += s
        para_ends.add(len(sentences) - 1)
        total += count_tokens(p) + 1
        i += 1
        if i - start > 4 * len(paragraphs):
            raise ValueError("the text is too short for the document")
    names = make_names(rng, n_records)
    numbers = make_numbers(rng, n_records, " ".join(sentences))
    # slots: record r goes after sentence slot[r] - 1 (slot 0: before the first sentence)
    recs = [Record(names[r], numbers[r], (r + rng.random()) / n_records) for r in range(n_records)]

    def render(sents: list[str]) -> Document:
        n = len(sents)
        slots = [min(n, int(round(rc.depth * n))) for rc in recs]
        pieces: list[str] = []
        for j in range(n + 1):
            for rc, sl in zip(recs, slots):
                if sl == j:
                    rc.char_pos = sum(len(x) for x in pieces)
                    pieces.append(RECORD.format(name=rc.name, number=rc.number) + " ")
            if j < n:
                pieces.append(sents[j] + ("\n\n" if j in para_ends else " "))
        return Document("".join(pieces).strip(), recs, start)

    doc = render(sentences)
    while count_tokens(doc.text) > n_tokens and len(sentences) > 1:     # trim the tail sentence by sentence
        excess = count_tokens(doc.text) - n_tokens
        drop = max(1, min(len(sentences) - 1, excess // 40))
        sentences = sentences[:-drop]
        doc = render(sentences)
    return doc


def user_turn(doc: Document, record: Record) -> str:
    return f"{INSTRUCTION}\n\nDocument:\n{doc.text}\n\nQuestion: {QUESTION.format(name=record.name)}"


def asked(records: list[Record], n: int | None) -> list[Record]:
    """n of the records spread evenly over depth (all of them when n is None or >= their number)."""
    if n is None or n >= len(records):
        return list(records)
    return [records[round(i * (len(records) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 else [records[-1]]


def build_set(paragraphs: list[str], *, docs: int, records: int, doc_tokens: int,
              count_tokens: Callable[[str], int], seed: int) -> list[Document]:
    rng = random.Random(seed)
    return [build_document(paragraphs, records, doc_tokens, count_tokens, rng) for _ in range(docs)]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--text", default="wikitext2", help="prose source: a text file, or wikitext2 (the test split, "
                    "found as `dsa eval --ppl wikitext2` finds it)")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--records", type=int, default=20, help="records (= questions) per document")
    ap.add_argument("--doc-tokens", type=int, default=7000)
    ap.add_argument("--ask", type=int, default=None, help="questions per document: that many of its records, spread "
                    "evenly over depth (default: every record)")
    ap.add_argument("--attn", default="dense,sparse,local")
    ap.add_argument("--top-k", type=int, default=None, help="run-time indexer budget (default: the file's)")
    ap.add_argument("--ctx", type=int, default=None, help="context cells (default: the file's trained context)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=40)
    ap.add_argument("--n-gpu-layers", type=int, default=None, help="default: every layer where the build offloads")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON report (default: stdout)")
    return ap.parse_args(argv)


def check_args(a) -> list[str]:
    from dsa_convert.errors import BadInputError

    for name in ("docs", "records", "doc_tokens", "max_new", "ask"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise BadInputError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    modes = [m.strip().lower() for m in a.attn.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("dense", "sparse", "local")]
    if not modes or bad:
        raise BadInputError(f"unknown --attn {bad[0] if bad else a.attn!r} (choose from dense, sparse, local)")
    if not a.gguf.is_file():
        raise BadInputError(f"file not found: {a.gguf}")
    if a.out is not None:
        from dsa_convert.formats.atomic import check_output
        check_output(a.out, force=True)
    return list(dict.fromkeys(modes))


def run(a) -> dict:
    from dsa_convert.backend.runtime import import_llama_cpp
    from dsa_convert.errors import BadInputError
    from dsa_convert.eval.data import read_eval_text, resolve
    from dsa_convert.eval.needle import answer_text, is_hit
    from dsa_convert.eval.needle_llamacpp import LlamaNeedleBackend
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.generate.chat import chat_messages, chat_prompt

    modes = check_args(a)
    text_path = resolve(a.text)
    paragraphs = clean_wikitext(read_eval_text(text_path))
    g = GgufFile(a.gguf)
    try:
        n_train = g.get(f"{g.arch}.context_length")
    finally:
        g.close()
    n_ctx = a.ctx or int(n_train or 4096)
    lc = import_llama_cpp()
    ngl = a.n_gpu_layers if a.n_gpu_layers is not None else (999 if lc.llama_supports_gpu_offload() else 0)
    log = lambda msg: print(f"docqa: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    docs: list[Document] = []
    prompts: list[tuple[int, Record, list[int], int]] = []   # (doc, record, prompt tokens, distance)
    report: dict = {"model": a.gguf.name, "text": str(text_path), "ctx": n_ctx, "docs": a.docs, "records": a.records, "ask": a.ask,
                    "doc_tokens_target": a.doc_tokens, "seed": a.seed, "max_new": a.max_new, "attn": modes,
                    "top_k_override": a.top_k, "n_gpu_layers": ngl, "modes": {}, "questions": []}
    answers: dict[str, list[str]] = {}
    for mi, mode in enumerate(modes):
        t0 = time.perf_counter()
        b = LlamaNeedleBackend(a.gguf, n_ctx=n_ctx, attn=mode, kv="f16", top_k=a.top_k, n_gpu_layers=ngl,
                               threads=a.threads, flash_attn=True)
        try:
            if mi == 0:                  # the documents and prompts, with the file's tokenizer
                llm = b._llm
                count = lambda s: len(llm.tokenize(s.encode("utf-8"), add_bos=False, special=False))  # noqa: E731
                try:
                    docs = build_set(paragraphs, docs=a.docs, records=a.records, doc_tokens=a.doc_tokens,
                                     count_tokens=count, seed=a.seed)
                except ValueError as e:
                    raise BadInputError(f"{text_path}: {e}") from None
                for di, d in enumerate(docs):
                    for rc in asked(d.records, a.ask):
                        text = chat_prompt(llm, a.gguf, chat_messages(user_turn(d, rc)))
                        toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
                        if len(toks) + a.max_new > n_ctx:
                            raise BadInputError(f"a prompt of {len(toks)} tokens + --max-new {a.max_new} exceeds "
                                                f"the context of {n_ctx}: lower --doc-tokens")
                        tail = text[text.index(rc.name + " is ", text.index("Document:")):]
                        prompts.append((di, rc, toks, len(llm.tokenize(tail.encode("utf-8"), add_bos=False,
                                                                       special=True))))
                report["doc_tokens"] = [count(d.text) for d in docs]
                report["prompt_tokens"] = {"min": min(len(p[2]) for p in prompts),
                                           "max": max(len(p[2]) for p in prompts)}
                log(f"{len(docs)} documents of {report['doc_tokens']} tokens, {len(prompts)} questions, "
                    f"prompts {report['prompt_tokens']['min']}-{report['prompt_tokens']['max']} tokens")
            report["modes"][mode] = {"attention": b.mode}
            out = []
            for qi, (_, rc, toks, _) in enumerate(prompts):
                out.append(answer_text(b, b.generate(toks, a.max_new)))
                if (qi + 1) % 10 == 0 or qi + 1 == len(prompts):
                    log(f"{mode}: {qi + 1}/{len(prompts)} answered, {time.perf_counter() - t0:.0f} s")
            answers[mode] = out
        finally:
            b.close()
        ok = [is_hit(ans, p[1].number) for ans, p in zip(out, prompts)]
        report["modes"][mode].update(correct=sum(ok), n=len(ok), accuracy=round(sum(ok) / len(ok), 4),
                                     seconds=round(time.perf_counter() - t0, 1))
    if "dense" in answers:
        dense_ok = [is_hit(x, p[1].number) for x, p in zip(answers["dense"], prompts)]
        for mode in answers:
            if mode == "dense":
                continue
            ok = [is_hit(x, p[1].number) for x, p in zip(answers[mode], prompts)]
            same = sum(x == y for x, y in zip(answers[mode], answers["dense"]))
            report["modes"][mode]["vs_dense"] = {
                "same_answer": same, "same_answer_share": round(same / len(prompts), 4),
                "same_correctness": sum(x == y for x, y in zip(ok, dense_ok)),
                "dense_correct_kept": sum(x and y for x, y in zip(ok, dense_ok))}
    for qi, (di, rc, toks, dist) in enumerate(prompts):
        report["questions"].append({"doc": di, **asdict(rc), "prompt_tokens": len(toks), "distance_tokens": dist,
                                    "answers": {m: answers[m][qi] for m in answers},
                                    "correct": {m: is_hit(answers[m][qi], rc.number) for m in answers}})
    return report


def main(argv=None) -> int:
    from dsa_convert.backend.runtime import preload_llama_cpp

    preload_llama_cpp()         # before numpy / torch load (see preload_llama_cpp)
    from dsa_convert.errors import DsaError

    a = parse_args(argv)
    try:
        rep = run(a)
        text = json.dumps(rep, indent=1)
        if a.out is None:
            print(text)
        else:
            from dsa_convert.formats.atomic import atomic_output
            with atomic_output(a.out) as tmp:
                Path(tmp).write_text(text + "\n")
    except DsaError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    for m, r in rep["modes"].items():
        extra = f", same answer as dense {r['vs_dense']['same_answer']}/{r['n']}" if "vs_dense" in r else ""
        print(f"docqa: {m}: {r['correct']}/{r['n']} correct ({r['accuracy']:.1%}){extra}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
