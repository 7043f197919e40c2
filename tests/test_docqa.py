"""scripts/bench/docqa.py's document and question construction (no weights: words stand in for tokens)."""
import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "docqa.py"
_spec = importlib.util.spec_from_file_location("docqa", SCRIPT)
docqa = importlib.util.module_from_spec(_spec)
sys.modules["docqa"] = docqa         # dataclasses look their module up
_spec.loader.exec_module(docqa)

WIKI = """ = Valkyria Chronicles III = 

 Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing game . It was released in 2011 , in Japan . The game began development in 2010 , carrying over a large portion of the work .
 
 = = Gameplay = = 

 As with previous games , the player controls units . The squad has 1 @,@ 200 members and a budget of 3 @.@ 5 million . Some of them are n't here ( as planned ) .
"""


def words(s: str) -> int:
    return len(s.split())


def paragraphs(n: int = 200, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sents = [" ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(5, 15))).capitalize() + "."
                 for _ in range(rng.randrange(2, 6))]
        out.append(f"Paragraph {i}. " + " ".join(sents))
    return out


def test_clean_wikitext_drops_headings_and_escapes():
    ps = docqa.clean_wikitext(WIKI)
    assert len(ps) == 2
    assert ps[0].startswith("Senjō no Valkyria 3: Unrecorded")
    assert "role-playing" in ps[0] and "2011, in Japan." in ps[0]
    assert "1,200 members" in ps[1] and "3.5 million" in ps[1] and "aren't" in ps[1] and "(as planned)." in ps[1]
    assert not any(p.startswith("=") for p in ps)


def test_document_size_records_and_depths():
    d = docqa.build_document(paragraphs(), 20, 3000, words, random.Random(0))
    assert 2700 <= words(d.text) <= 3000
    assert len(d.records) == 20
    names = [r.name for r in d.records]
    numbers = [r.number for r in d.records]
    assert len(set(names)) == 20 and len(set(numbers)) == 20
    parts = [p for n in names for p in n.split()]
    assert len(set(parts)) == 40                               # no first / last name repeats
    assert not any(a != b and a.startswith(b) for a in parts for b in parts)
    for r in d.records:                                        # each record present once, at its recorded offset
        sent = docqa.RECORD.format(name=r.name, number=r.number)
        assert d.text.count(sent) == 1
        assert d.text[r.char_pos:].startswith(sent)
        assert d.text.count(str(r.number)) == 1 and d.text.count(r.name) == 1
    # stratified depths: record i in [i/20, (i+1)/20), so they are spread over the whole document in order
    for i, r in enumerate(d.records):
        assert i / 20 <= r.depth < (i + 1) / 20
    pos = [r.char_pos for r in d.records]
    assert pos == sorted(pos)
    assert pos[0] < 0.15 * len(d.text) and pos[-1] > 0.85 * len(d.text)


def test_records_sit_between_sentences():
    d = docqa.build_document(paragraphs(), 10, 1500, words, random.Random(3))
    for r in d.records:
        before = d.text[:r.char_pos].rstrip()
        assert before == "" or before[-1] in ".!?\"" or re.search(r"\d{5}\.$", before)


def test_seeded_and_distinct_documents():
    a = docqa.build_set(paragraphs(), docs=3, records=8, doc_tokens=1200, count_tokens=words, seed=5)
    b = docqa.build_set(paragraphs(), docs=3, records=8, doc_tokens=1200, count_tokens=words, seed=5)
    c = docqa.build_set(paragraphs(), docs=3, records=8, doc_tokens=1200, count_tokens=words, seed=6)
    assert [d.text for d in a] == [d.text for d in b]
    assert [d.text for d in a] != [d.text for d in c]
    assert len({d.start_paragraph for d in a}) > 1 or len({d.text for d in a}) == 3


def test_numbers_avoid_the_prose():
    rng = random.Random(0)
    prose = " ".join(str(x) for x in range(10000, 99000))     # only 99000-99999 are free
    nums = docqa.make_numbers(rng, 5, prose)
    assert all(99000 <= x <= 99999 for x in nums)


def test_question_turn_holds_document_and_name():
    d = docqa.build_document(paragraphs(), 4, 600, words, random.Random(2))
    t = docqa.user_turn(d, d.records[1])
    assert t.startswith(docqa.INSTRUCTION) and d.text in t
    assert t.endswith(docqa.QUESTION.format(name=d.records[1].name))
    assert str(d.records[1].number) not in t[t.index("Question:"):]


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        docqa.build_document(paragraphs(), 0, 1000, words, random.Random(0))
    with pytest.raises(ValueError):
        docqa.build_document(["One paragraph."], 3, 1000, words, random.Random(0))


def test_asked_spreads_over_depth():
    recs = [docqa.Record(f"N{i}", 10000 + i, i / 10) for i in range(10)]
    assert docqa.asked(recs, None) == recs and docqa.asked(recs, 12) == recs
    assert [r.name for r in docqa.asked(recs, 4)] == ["N0", "N3", "N6", "N9"]
    assert [r.name for r in docqa.asked(recs, 1)] == ["N9"]
