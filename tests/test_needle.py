"""Needle-in-a-haystack evaluation (`dsa eval --needle`): prompt formats, token budgets, depth placement, seeds,
exact-match scoring, the JSON report, the heatmap, bad input through the CLI, and retrieval end to end on the
shared 32K reference model through the torch backend (and llama.cpp where the backend is built)."""
from __future__ import annotations

import json
import lzma
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, WIKI_RAW, needs, requires_backend

from dsa_convert.errors import BadInputError
from dsa_convert.eval import needle_filler
from dsa_convert.eval.needle import (NeedleOptions, answer_text, depth_values, first_integer, is_hit, plan_trials,
                                     run_needle, trial_seed)
from dsa_convert.eval.needle_filler import JUNK, JunkFiller, TextFiller, load_filler
from dsa_convert.eval.needle_plot import write_heatmap, write_heatmap_isolated
from dsa_convert.eval.needle_prompts import (ADJECTIVES, NOUNS, PASSKEY_PREFIX, PASSKEY_QUESTION, compose,
                                             magic_needle, magic_question, passkey_needle, trial_content)

MODEL_32K = SHARED / "models" / "ref-llama-27m-32k"
BOOK = SHARED / "corpus" / "books_003.txt.xz"
CALIB = SHARED / "data" / "calib" / "books-calib.txt"
EXIT_BAD_INPUT = 3


# ---- formats ---------------------------------------------------------------------------------------------------
def llama_passkey_prompt(n_junk: int, i_pos: int, passkey: int) -> str:
    """llama.cpp examples/passkey/passkey.cpp's prompt, transcribed literally."""
    prompt = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
              "I will quiz you about the important information there.")
    for i in range(n_junk):
        if i % n_junk == i_pos:
            prompt += f" The pass key is {passkey}. Remember it. {passkey} is the pass key."
        prompt += " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    return prompt + " What is the pass key? The pass key is"


def test_format_strings_as_documented():
    assert PASSKEY_PREFIX == ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                              "them. I will quiz you about the important information there.")
    assert JUNK == " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert PASSKEY_QUESTION == " What is the pass key? The pass key is"
    assert passkey_needle(31337) == " The pass key is 31337. Remember it. 31337 is the pass key."
    assert magic_needle("amber-lake", 4829173) == " One of the special magic numbers for amber-lake is: 4829173."
    assert magic_question("amber-lake") == (
        " What is the special magic number for amber-lake mentioned in the provided text? The special magic number "
        "for amber-lake mentioned in the provided text is")


@pytest.mark.parametrize("depth,i_pos", [(0.0, 0), (0.5, 5), (0.9, 9), (1 / 3, 3)])
def test_passkey_junk_prompt_is_llama_passkeys(depth, i_pos):
    c = trial_content("passkey", 1234)
    assert 1 <= c.expected <= 50000
    assert compose(c, JunkFiller().haystack(0, 10), depth).text == llama_passkey_prompt(10, i_pos, c.expected)


def test_niah_and_multikey_content():
    c = trial_content("niah", 7)
    assert c.prefix == "" and len(c.needles) == 1 and 1_000_000 <= c.expected <= 9_999_999
    a, n = c.keys[0].split("-")
    assert a in ADJECTIVES and n in NOUNS
    text = compose(c, JunkFiller().haystack(0, 4), 0.5).text
    assert text == JUNK * 2 + magic_needle(c.keys[0], c.expected) + JUNK * 2 + magic_question(c.keys[0])

    m = trial_content("multikey", 7)
    assert len(set(m.keys)) == 4 and len(set(m.values)) == 4
    text = compose(m, JunkFiller().haystack(0, 40), 0.25).text
    assert text.endswith(magic_question(m.keys[0])) and not text.startswith(" What")
    for k, v in zip(m.keys, m.values):
        assert text.count(magic_needle(k, v)) == 1
    before = text[:text.index(magic_needle(m.keys[0], m.values[0]))]
    for k, v in zip(m.keys[1:], m.values[1:]):
        before = before.replace(magic_needle(k, v), "")
    assert before == JUNK * 10                          # the asked needle at the grid's depth: 25 % of 40 repeats
    starts = sorted(text.index(magic_needle(k, v)) for k, v in zip(m.keys, m.values))
    assert len(set(starts)) == 4                        # four different positions


def test_book_needle_at_sentence_boundary():
    text = ("First sentence here. Second one follows! A third? Yes.\n"
            "New paragraph starts. It ends here.\nLast paragraph is short.")
    f = TextFiller("t", text)
    c = trial_content("niah", 3)
    hay = f.haystack(0, len(text))
    for depth in (0.0, 0.3, 0.6, 1.0):
        p = compose(c, hay, depth).text
        i = p.index(c.needles[0])
        before, after = p[:i], p[i + len(c.needles[0]):]
        assert before == "" or before[-1] in ".!?", (depth, before[-5:])
        assert after.startswith((" ", "\n")) or after.startswith(" What"), (depth, after[:10])
    # cut back to a word boundary: never ends inside a word
    assert f.haystack(0, 8).text == "First"


def test_filler_default_is_not_calibration_text(monkeypatch, tmp_path):
    assert needle_filler.default_filler("passkey") == "junk"
    assert needle_filler.default_filler("niah") == "book"
    monkeypatch.delenv(needle_filler.FILLER_ENV, raising=False)
    monkeypatch.setattr(needle_filler, "_REPO", tmp_path / "repo")
    with pytest.raises(BadInputError, match="--filler PATH"):
        needle_filler.book_path()
    (tmp_path / "shared" / "corpus").mkdir(parents=True)
    book = tmp_path / "shared" / "corpus" / "books_003.txt.xz"
    book.write_bytes(lzma.compress("Once upon a time. The end.\nAnother paragraph.".encode()))
    assert needle_filler.book_path() == book
    f = load_filler("book")
    assert isinstance(f, TextFiller) and f.text == "Once upon a time. The end.\nAnother paragraph."
    assert f.par_starts == [0, len("Once upon a time. The end.\n")]
    other = tmp_path / "other.txt"
    other.write_text("Other text.\r\nSecond line.\n")
    monkeypatch.setenv(needle_filler.FILLER_ENV, str(other))
    assert needle_filler.book_path() == other
    assert load_filler("book").text == "Other text.\nSecond line."
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(BadInputError, match="not UTF-8"):
        load_filler(str(bad))


@needs(BOOK)
def test_shared_book_filler_is_disjoint_from_calibration():
    assert needle_filler.BOOK_FILE.name == "books_003.txt.xz"
    if CALIB.is_file():
        calib = CALIB.read_text(encoding="utf-8")
        lines = [ln for ln in calib.splitlines() if len(ln) > 200][:20]
        book = lzma.decompress(BOOK.read_bytes()).decode("utf-8")
        assert lines and not any(ln in book for ln in lines)


# ---- scoring -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generated,expected,hit", [
    ("31337.", 31337, True), (" 31337. Remember it", 31337, True), ("The pass key is 31337", 31337, True),
    ("3133", 31337, False), ("313370", 31337, False), ("12 then 31337", 31337, False), ("no number", 31337, False),
    ("", 31337, False), ("4829173.", 4829173, True), ("4829173 is 31337", 31337, False)])
def test_exact_match_scoring(generated, expected, hit):
    assert is_hit(generated, expected) is hit


def test_first_integer_and_answer_text():
    assert first_integer("abc 0042 7") == 42 and first_integer("none") is None

    class Dec:
        eos_id = 1

        def detokenize(self, ids):
            return "".join({5: " 123", 6: ".\n", 7: " later 9", 8: "x" * 200}[i] for i in ids)

    assert answer_text(Dec(), [5, 6, 7]) == "123."          # cut at the newline
    assert answer_text(Dec(), [5, 1, 7]) == "123"            # cut at EOS
    assert len(answer_text(Dec(), [8])) == 80                # truncated


# ---- grid bookkeeping with the real tokenizer ------------------------------------------------------------------
class TokOnly:
    """The tokenizer half of a backend: the shared 32K model's real tokenizer (tokenizers)."""
    name = "tokenizer"
    n_ctx_train = 32768

    def __init__(self):
        from dsa_convert.eval.needle_vocab import HfVocab

        self.vocab = HfVocab(MODEL_32K)
        self.eos_id = self.vocab.eos_id

    def tokenize(self, text):
        return self.vocab.tokenize(text)

    def detokenize(self, ids):
        return self.vocab.detokenize(ids)

    def close(self):
        pass


class FakeAnswers(TokOnly):
    """Grid bookkeeping only: 'answers' by reading the asked number out of the prompt (mode `right`) or not at all
    (mode `wrong`); it records every prompt it is given."""

    def __init__(self, attn: str, kv: str, seen: dict):
        super().__init__()
        self.attn, self.kv, self.seen = attn, kv, seen

    def generate(self, tokens, max_new):
        self.seen.setdefault(self.attn, []).append(list(tokens))
        text = self.detokenize(tokens)
        asked = re.search(r"magic number for ([a-z]+-[a-z]+) mentioned in the provided text is$", text)
        m = (re.search(rf"numbers for {asked.group(1)} is: (\d+)\.", text) if asked
             else re.search(r"The pass key is (\d+)\. Remember", text))
        return self.tokenize(f" {m.group(1)}.\nmore" if self.attn == "right" else " I do not know.")


@pytest.fixture(scope="module")
def tok():
    if not MODEL_32K.is_dir():
        pytest.skip(f"{MODEL_32K} not present")
    return TokOnly()


@pytest.mark.parametrize("task,filler,lengths,slack", [("passkey", "junk", [600, 2000], 30),
                                                        ("niah", "wiki", [700, 3000], 16),
                                                        ("multikey", "wiki", [900], 16)])
def test_prompt_lengths_within_budget(tok, tmp_path, task, filler, lengths, slack):
    if filler == "wiki":
        if not WIKI_RAW.is_file():
            pytest.skip("no text for a PATH filler")
        filler = str(tmp_path / "filler.txt.xz")
        Path(filler).write_bytes(lzma.compress(WIKI_RAW.read_bytes()[:400_000]))
    o = NeedleOptions(task=task, lengths=lengths, depths=3, trials=2, filler=filler, max_new=12, quiet=True)
    plans = plan_trials(tok, o, load_filler(filler))
    assert len(plans) == len(lengths) * 3 * 2
    for p in plans:
        budget = p.length - 12
        n = len(p.tokens)
        assert budget - slack <= n <= budget, (p.length, n)
        text = tok.detokenize(p.tokens)
        assert tok.tokenize(text) == list(p.tokens)          # the tokenization of one whole text
        assert text.rstrip().endswith("mentioned in the provided text is" if task != "passkey" else "The pass key is")


@needs(BOOK)
def test_depth_placement_monotone_in_depth(tok):
    o = NeedleOptions(task="niah", lengths=[1500], depths=6, trials=1, filler="book", quiet=True)
    plans = plan_trials(tok, o, load_filler("book"))
    pos = [p.needle_pos for p in plans]
    assert pos == sorted(pos) and pos[0] == 0.0 and pos[-1] == 1.0
    for p, d in zip(plans, depth_values(6)):
        assert abs(p.needle_pos - d / 100) < 0.05, (p.needle_pos, d)
    # the same order in the prompts themselves: the needle's place among the prompt's characters
    where = []
    for p in plans:
        text = tok.detokenize(p.tokens)
        where.append(text.index(" One of the special magic numbers") / len(text))
    assert where == sorted(where)


def test_seeds_and_prompts_identical_across_modes_and_kv(tok):
    seen_a, seen_b = {}, {}
    o = NeedleOptions(task="passkey", lengths=[300, 500], depths=3, trials=2, attn=["right", "wrong"], filler="junk",
                      seed=11, quiet=True)
    res = run_needle(lambda m: FakeAnswers(m, "f16", seen_a), o)
    o.kv = "q8_0"
    res_b = run_needle(lambda m: FakeAnswers(m, "q8_0", seen_b), o)
    assert seen_a["right"] == seen_a["wrong"] == seen_b["right"] == seen_b["wrong"]
    seeds = lambda r, m: [a["seed"] for row in r["rows"] if row["attn"] == m for a in row["answers"]]  # noqa: E731
    assert seeds(res, "right") == seeds(res, "wrong") == seeds(res_b, "right")
    assert len(set(seeds(res, "right"))) == 12
    assert seeds(res, "right")[0] == trial_seed(11, 300, 0, 0)
    # another --seed: other needles
    other = run_needle(lambda m: FakeAnswers(m, "f16", {}), NeedleOptions(
        task="passkey", lengths=[300], depths=3, trials=2, attn=["right"], filler="junk", seed=12, quiet=True))
    def expected(r):
        return [a["expected"] for row in r["rows"] if row["length"] == 300 and row["attn"] == "right"
                for a in row["answers"]]
    assert expected(other) != expected(res)


def test_json_shape_and_scores(tok, tmp_path):
    o = NeedleOptions(task="multikey", lengths=[400, 700], depths=2, trials=2, attn=["right", "wrong"],
                      filler="junk", model="fake.gguf", quiet=True)
    res = json.loads(json.dumps(run_needle(lambda m: FakeAnswers(m, "f16", {}), o)))
    for k in ("task", "filler", "seed", "model", "backend", "kv", "rows", "summary", "seconds"):
        assert k in res
    assert (res["task"], res["filler"], res["model"], res["backend"]) == ("multikey", "junk", "fake.gguf", "tokenizer")
    assert len(res["rows"]) == 2 * 2 * 2
    for r in res["rows"]:
        assert set(r) >= {"length", "depth", "depth_index", "attn", "hits", "trials", "prompt_tokens", "answers"}
        assert r["trials"] == 2 and len(r["answers"]) == 2 and r["prompt_tokens"] <= r["length"] - o.max_new
        for a in r["answers"]:
            assert set(a) >= {"expected", "generated", "hit", "seed"}
            assert a["hit"] == (r["attn"] == "right")
            assert a["generated"] == (f"{a['expected']}." if a["hit"] else "I do not know.")
        assert r["hits"] == sum(a["hit"] for a in r["answers"])
    assert res["summary"] == [{"length": n, "attn": m, "hits": 4 if m == "right" else 0, "trials": 4,
                               "accuracy": 1.0 if m == "right" else 0.0}
                              for m in ("right", "wrong") for n in (400, 700)]
    out = write_heatmap(res, tmp_path / "grid.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert not list(tmp_path.glob(".*tmp*"))
    # the llama.cpp grid draws in a child interpreter (matplotlib beside llama.cpp's CUDA backend segfaults)
    child = write_heatmap_isolated(res, tmp_path / "child.png")
    assert child.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and child.stat().st_size > 5000
    (tmp_path / "not-a-result.json").write_text('{"task": "passkey"}')
    r = subprocess.run([sys.executable, "-m", "dsa_convert.eval.needle_plot", str(tmp_path / "not-a-result.json"),
                        str(tmp_path / "x.png")], capture_output=True, text=True)
    assert r.returncode == 3 and r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_too_small_and_too_short_are_bad_input(tok, tmp_path):
    with pytest.raises(BadInputError, match="too small for the prompt's fixed parts"):
        plan_trials(tok, NeedleOptions(task="niah", lengths=[40], depths=1, filler="junk", quiet=True),
                    load_filler("junk"))
    short = tmp_path / "short.txt"
    short.write_text("A few words only. Not enough for a haystack.\n")
    with pytest.raises(BadInputError, match="filler is too short"):
        plan_trials(tok, NeedleOptions(task="passkey", lengths=[1024], depths=1, filler=str(short), quiet=True),
                    load_filler(str(short)))


# ---- the command line --------------------------------------------------------------------------------------------
def run_dsa(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == EXIT_BAD_INPUT, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert sum(ln.startswith("error: ") for ln in lines) == 1 and lines[-1].startswith("error: "), r.stderr[-2000:]
    assert needle.lower() in lines[-1].lower(), lines[-1]


@pytest.fixture(scope="module")
def gguf_32k(tmp_path_factory) -> Path:
    if not MODEL_32K.is_dir():
        pytest.skip(f"{MODEL_32K} not present")
    out = tmp_path_factory.mktemp("needle") / "ref32k.gguf"
    r = run_dsa("convert", str(MODEL_32K), str(out), "--no-dsa", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_cli_bad_input_without_a_model(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("not a gguf")
    cases = [
        (["eval", str(tmp_path / "missing.gguf"), "--needle", "passkey"], "not found"),
        (["eval", str(txt), "--needle", "passkey"], "not a GGUF"),
        (["eval", str(txt), "--needle", "haystack"], "unknown --needle"),
        (["eval", str(txt), "--needle", "passkey", "--filler", "nowhere"], "unknown --filler"),
        (["eval", str(txt), "--needle", "passkey", "--attn", "dense,oracle"], "unknown --attn 'oracle'"),
        (["eval", str(txt), "--needle", "passkey", "--depths", "0"], "--depths must be >= 1"),
        (["eval", str(txt), "--needle", "passkey", "--trials", "0"], "--trials must be >= 1"),
        (["eval", str(txt), "--needle", "passkey", "--lengths", "4096,x"], "not an integer"),
        (["eval", str(txt), "--needle", "passkey", "--plot", str(tmp_path / "no" / "g.png")],
         "directory does not exist"),
        (["eval", str(txt), "--lengths", "4096"], "--lengths is an option of --needle"),
        (["eval", str(txt), "--needle", "passkey", "--kld"], "--kld"),
        (["eval", str(txt), "--backend", "torch", "--flash-attn"], "--flash-attn / --no-flash-attn is an option of "
         "--backend llama.cpp"),
        (["eval", str(txt), "--needle", "passkey", "--backend", "torch", "--n-gpu-layers", "0"],
         "--n-gpu-layers is an option of --backend llama.cpp"),
        (["eval", str(txt), "--backend", "torch", "--threads", "2"], "--threads is an option of --backend llama.cpp"),
        (["eval", str(txt), "--needle", "passkey", "--threads", "0"], "--threads must be >= 1"),
        (["eval", str(txt), "-t", "-1"], "--threads must be >= 1"),
    ]
    for args, msg in cases:
        assert_one_line_error(run_dsa(*args), msg)


def test_cli_bad_input_with_the_32k_model(gguf_32k, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Far too short to fill a prompt.\n")
    cases = [
        (["eval", str(gguf_32k), "--needle", "passkey", "--attn", "dense", "--lengths", "4096,65536"],
         "exceeds the model's trained context 32768"),
        (["eval", str(gguf_32k), "--needle", "passkey", "--attn", "dense", "--backend", "torch", "--tokenizer",
          str(MODEL_32K), "--lengths", "40000"], "exceeds the model's trained context 32768"),
        (["eval", str(gguf_32k), "--needle", "passkey", "--attn", "sparse"], "no DSA indexer"),
        (["eval", str(MODEL_32K), "--needle", "niah", "--backend", "torch", "--attn", "bogus"], "unknown --attn"),
        (["eval", str(MODEL_32K), "--needle", "niah", "--backend", "torch", "--attn", "dense", "--lengths", "40"],
         "too small for the prompt's fixed parts"),
        (["eval", str(MODEL_32K), "--needle", "passkey", "--backend", "torch", "--attn", "dense", "--lengths", "1024",
          "--filler", str(short)], "filler is too short"),
    ]
    for args, msg in cases:
        assert_one_line_error(run_dsa(*args), msg)


# ---- end to end: real generation -------------------------------------------------------------------------------
def _check_retrieval(res: dict, length: int, depths: int) -> None:
    assert res["summary"] == [{"length": length, "attn": "dense", "hits": depths, "trials": depths, "accuracy": 1.0}]
    for r in res["rows"]:
        assert r["prompt_tokens"] <= length - res["max_new"]
        for a in r["answers"]:
            assert a["hit"] and first_integer(a["generated"]) == a["expected"], a


def test_torch_backend_retrieves_passkey(gguf_32k, tmp_path):
    """The model's README: dense passkey 6/6 at 4K. Torch backend, the converted GGUF, 2K prompts, 3 depths."""
    png = tmp_path / "grid.png"
    r = run_dsa("eval", str(gguf_32k), "--needle", "passkey", "--backend", "torch", "--tokenizer", str(MODEL_32K),
                "--device", "cpu", "--lengths", "2048", "--depths", "3", "--attn", "dense", "--max-new", "6",
                "--plot", str(png), "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["backend"] == "torch" and res["filler"] == "junk"
    _check_retrieval(res, 2048, 3)
    assert png.read_bytes()[:4] == b"\x89PNG"


@requires_backend
def test_llamacpp_backend_retrieves_passkey_same_prompts(gguf_32k, tmp_path):
    png = tmp_path / "grid.png"                          # drawn in a child interpreter (needle_plot)
    r = run_dsa("eval", str(gguf_32k), "--needle", "passkey", "--lengths", "2048", "--depths", "3", "--attn", "dense",
                "--max-new", "6", "--threads", "1", "--plot", str(png), "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["backend"] == "llama.cpp" and res["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    assert res["threads"] == 1
    _check_retrieval(res, 2048, 3)
    # the prompts are the torch backend's: same seeds, same needles, same lengths in tokens
    assert [a["seed"] for row in res["rows"] for a in row["answers"]] == [trial_seed(0, 2048, d, 0) for d in range(3)]


def test_needle_summary_compares_cells_across_files(tmp_path):
    """scripts/needle_summary.py: per-mode files of one grid side by side; cells below the reference, by more than
    one trial, and the lowest cell where the reference retrieves >= 90 %."""
    def grid(attn: str, kv: str, hits: dict) -> Path:
        rows = [{"length": L, "depth_index": d, "depth": 50.0 * d, "attn": attn, "kv": kv, "hits": h, "trials": 10}
                for (L, d), h in hits.items()]
        p = tmp_path / f"{attn}-{kv}.json"
        p.write_text(json.dumps({"task": "niah", "filler": "book", "kv": kv, "rows": rows}))
        return p

    dense = grid("dense", "f16", {(4096, 0): 10, (4096, 1): 9, (8192, 0): 8, (8192, 1): 10})
    sparse = grid("sparse", "f16", {(4096, 0): 10, (4096, 1): 8, (8192, 0): 5, (8192, 1): 10})
    asq = grid("sparse", "asq", {(4096, 0): 7, (4096, 1): 9, (8192, 0): 9, (8192, 1): 10})
    r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "needle_summary.py"),
                        str(dense), str(sparse), str(asq)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "| 4096 | 19/20 | 18/20 | 16/20 |" in lines and "| 8192 | 18/20 | 15/20 | 19/20 |" in lines
    # sparse: two cells below, one by more than one trial (8K d0: 5 vs 8, a cell where dense has < 90 %)
    assert ("sparse: 2 of 4 cells below dense, 1 by more than one trial, 0 above; lowest where dense >= 90 %: 8/10: "
            "4096@d1 8 vs 9, 8192@d0 5 vs 8") in lines
    assert ("sparse/asq: 1 of 4 cells below dense, 1 by more than one trial, 1 above; lowest where dense >= 90 %: "
            "7/10: 4096@d0 7 vs 10") in lines
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "needle_summary.py"), str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a dsa eval --needle JSON" in r.stderr.strip().splitlines()[-1]
