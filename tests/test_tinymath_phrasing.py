"""tinymath's unseen phrasing (issue 17, item 6): held-out templates, disjoint from the training ones by construction."""

import hashlib
import json
import random
import re
from string import Formatter

import pytest

from dlm.data import tinymath as tm
from dlm.data.tinymath import (
    LEVELS,
    NAMES,
    OBJECTS,
    PHRASINGS,
    count_steps,
    generate_problem,
    generate_splits,
    generate_unseen_test,
    run_solution,
    write_tinymath,
)


def _alt(words):
    return "(?:" + "|".join(re.escape(w) for w in sorted(set(words), key=len, reverse=True)) + ")"


_NAME = _alt(n for n, _ in NAMES)
_FIELDS = {  # what each template field can be filled with
    "S": _alt([n for n, _ in NAMES] + ["She", "He"]), "s_": _alt([n for n, _ in NAMES] + ["she", "he"]),
    "o_": _alt([n for n, _ in NAMES] + ["her", "him"]), "pos": "(?:her|his)", "pr": "(?:she|he)",
    "refl": "(?:herself|himself)", "Npos": _NAME + "'s", "X": _NAME, "A": _NAME, "B": _NAME, "O": _NAME,
    "names": f"(?:{_NAME}, )*{_NAME} and {_NAME}", "d": r"\d+", "a": r"\d+", "b": r"\d+", "m": r"\d+",
    "P": _alt(p for _, p in OBJECTS), "Q": _alt(p for _, p in OBJECTS), "s": _alt(s for s, _ in OBJECTS),
    "C": _alt(c for c, _ in tm.CONTAINERS), "Cp": _alt(c for _, c in tm.CONTAINERS),
    "mw": _alt(tm._MULT.values()), "mv": _alt(tm._MVERB.values()), "mr": _alt(tm._MRES.values()),
    "fw": _alt(tm._FRAC.values()), "fo": _alt(tm._FRAC_OF.values()), "rel": _alt(tm.RELATIVES),
    "place": _alt(tm.PLACES),
}


def _templates(ph):
    """Every sentence template of a phrasing family (facts, events, questions, distractors)."""
    out = [*ph.base, *ph.product, *ph.q_final_ev, *ph.q_final, *ph.q_total, *ph.q_diff, *ph.distract]
    out += [t for ts in ph.rel.values() for t in ts] + [t for ts in ph.event.values() for t, _ in ts]
    return out + [t for t, _ in ph.q_div + ph.q_mul]


def _regex(tpl):
    """A template as a regex: its fixed wording verbatim, each field as the values it can take."""
    return "".join(re.escape(lit) + (_FIELDS[f] if f is not None else "") for lit, f, _, _ in Formatter().parse(tpl))


_TEMPLATES = {name: _templates(ph) for name, ph in PHRASINGS.items()}
_SENTENCE = {name: [re.compile(r"(?:^|(?<=[.?] ))" + _regex(t) + "(?= |$)") for t in ts]
             for name, ts in _TEMPLATES.items()}
_WHOLE = {name: re.compile("(?:" + "|".join(_regex(t) for t in ts) + ")(?: (?:" + "|".join(_regex(t) for t in ts)
                           + "))*") for name, ts in _TEMPLATES.items()}
_PROBLEMS = {(ph, level): [generate_problem(random.Random(f"{ph}:{level}:{i}"), level, phrasing=ph)
                           for i in range(120)] for ph in PHRASINGS for level in LEVELS}


def test_each_prompt_is_made_of_its_own_familys_templates_only():
    # the regexes read every prompt: a prompt of one family is a sequence of that family's sentences...
    for (ph, level), problems in _PROBLEMS.items():
        for r in problems:
            assert _WHOLE[ph].fullmatch(r["prompt"]), (ph, level, r["prompt"])
    # ...and every unseen template is reachable
    used = {i for (ph, _), ps in _PROBLEMS.items() if ph == "unseen" for r in ps
            for i, rx in enumerate(_SENTENCE["unseen"]) if rx.search(r["prompt"])}
    assert used == set(range(len(_TEMPLATES["unseen"])))


@pytest.mark.parametrize("family,other", [("unseen", "seen"), ("seen", "unseen")])
def test_no_template_of_one_family_appears_in_the_other(family, other):
    for (ph, level), problems in _PROBLEMS.items():
        if ph != other:
            continue
        for r in problems:
            hits = [t for t, rx in zip(_TEMPLATES[family], _SENTENCE[family]) if rx.search(r["prompt"])]
            assert not hits, (family, level, hits, r["prompt"])
    assert not set(_TEMPLATES["seen"]) & set(_TEMPLATES["unseen"])


_N = "(" + _NAME + ")"
_WHO = "(" + _NAME + "|[Ss]he|[Hh]e|her|him)"
_W = r"[a-z]+"
_FRAC_WORD = {"half": 2, "a third": 3, "a quarter": 4, "a fifth": 5}
_FRAC_OF_WORD = {"half of": 2, "one third of": 3, "one quarter of": 4, "one fifth of": 5}
_RESULT_WORD = {"doubled": 2, "tripled": 3, "quadrupled": 4}
_FW, _FO, _MR = (_alt(w) for w in (_FRAC_WORD, _FRAC_OF_WORD, _RESULT_WORD))


def _read_unseen(prompt):
    """The answer an unseen-phrasing question asks for, computed from its wording alone (a reader written from the
    meaning of each sentence, not from the generator): facts relate initial counts, events then change them in order,
    a pronoun is the first person named in the sentence before it (and must have that person's gender)."""
    gender = dict(NAMES)
    known, relations, events, asked, unit = {}, [], [], None, None
    ref = None
    for sentence in re.split(r"(?<=[.?]) ", prompt):
        def who(word):
            if word in gender:
                return word
            assert ref is not None and gender[ref] == ("f" if word.lower() in ("she", "her") else "m"), (word, prompt)
            return ref

        def m(pattern):
            return re.fullmatch(pattern.replace("{N}", _N).replace("{WHO}", _WHO).replace("{W}", _W)
                                .replace("{FW}", f"({_FW})").replace("{FO}", f"({_FO})").replace("{MR}", f"({_MR})"),
                                sentence)

        def rel(a, b, forward, backward):  # a = forward(b), b = backward(a)
            relations.append((a, b, forward, backward))

        if g := (m(r"{N} keeps (\d+) {W} at home\.") or m(r"{N} starts the day with (\d+) {W}\.")):
            known[g[1]] = int(g[2])
        elif g := (m(r"(\d+) {W} belong to {N}\.") or m(r"In {N}'s room, there are (\d+) {W}\.")):
            name, d = (g[2], g[1]) if g[1].isdigit() else (g[1], g[2])
            known[name] = int(d)
        elif g := m(r"Each of {N}'s (\d+) {W} holds (\d+) {W}\."):
            known[g[1]] = int(g[2]) * int(g[3])
        elif g := m(r"(\d+) {W} fit in one {W}, and {N} has (\d+) full {W}\."):
            known[g[2]] = int(g[1]) * int(g[3])
        elif g := m(r"{N} lines up (\d+) {W}, putting (\d+) {W} in every one\."):
            known[g[1]] = int(g[2]) * int(g[3])
        elif g := (m(r"{N} would need (\d+) more {W} to match {N}\.") or m(r"{N} is (\d+) {W} behind {N}\.")):
            d = int(g[2])
            rel(g[1], g[3], lambda v, d=d: v - d, lambda v, d=d: v + d)
        elif g := m(r"{N} is (\d+) {W} ahead of {N}\."):
            d = int(g[2])
            rel(g[1], g[3], lambda v, d=d: v + d, lambda v, d=d: v - d)
        elif g := m(r"{N}'s count of {W} is (\d+) (above|below) {N}'s\."):
            d = int(g[2]) * (1 if g[3] == "above" else -1)
            rel(g[1], g[4], lambda v, d=d: v + d, lambda v, d=d: v - d)
        elif g := (m(r"For every {W} {N} has, {N} has (\d+)\.")):
            d = int(g[3])
            rel(g[2], g[1], lambda v, d=d: v * d, lambda v, d=d: v / d)
        elif g := m(r"{N}'s {W} outnumber {N}'s by a factor of (\d+)\.") or m(r"{N} has (\d+) times the {W} that {N} has\."):
            a, d, b = (g[1], g[3], g[2]) if not g[2].isdigit() else (g[1], g[2], g[3])
            rel(a, b, lambda v, d=int(d): v * d, lambda v, d=int(d): v / d)
        elif g := m(r"{N} has only {FW} of the {W} {N} has\."):
            d = _FRAC_WORD[g[2]]
            rel(g[1], g[3], lambda v, d=d: v / d, lambda v, d=d: v * d)
        elif g := m(r"For every (\d+) {W} {N} has, {N} has one\."):
            d = int(g[1])
            rel(g[3], g[2], lambda v, d=d: v / d, lambda v, d=d: v * d)
        elif g := m(r"{N}'s pile of {W} is {FW} the size of {N}'s\."):
            d = _FRAC_WORD[g[2]]
            rel(g[1], g[3], lambda v, d=d: v / d, lambda v, d=d: v * d)
        elif g := (m(r"(\d+) more {W} are bought by {WHO}\.") or m(r"At a fair, (\d+) {W} are won by {WHO}\.")):
            events.append((who(g[2]), lambda v, d=int(g[1]): v + d))
        elif g := (m(r"On a walk, {WHO} comes across (\d+) more {W}\.") or m(r"{WHO} collects (\d+) additional {W} from the garden\.")):
            events.append((who(g[1]), lambda v, d=int(g[2]): v + d))
        elif g := m(r"As a gift, {N} hands {WHO} another (\d+) {W}\."):
            events.append((who(g[2]), lambda v, d=int(g[3]): v + d))
        elif g := m(r"(\d+) of {N}'s {W} are handed over to {N}\."):
            events.append((g[2], lambda v, d=int(g[1]): v - d))
        elif g := (m(r"At the market, {WHO} sells off (\d+) {W}\.") or m(r"{WHO} drops (\d+) {W} and never finds them\.")
                   or m(r"{WHO} lends (\d+) {W} to {N}\.")):
            events.append((who(g[1]), lambda v, d=int(g[2]): v - d))
        elif g := m(r"A charity receives (\d+) {W} from {WHO}\."):
            events.append((who(g[2]), lambda v, d=int(g[1]): v - d))
        elif g := (m(r"The number of {W} {WHO} owns is then multiplied by (\d+)\.")
                   or m(r"{WHO} makes (?:her|his) pile of {W} (\d+) times bigger\.")):
            events.append((who(g[1]), lambda v, d=int(g[2]): v * d))
        elif g := m(r"Thanks to a trade, the {W} {WHO} owns are {MR}\."):
            events.append((who(g[1]), lambda v, d=_RESULT_WORD[g[2]]: v * d))
        elif g := m(r"Only {FW} of {N}'s {W} are kept, and the rest are given away\."):
            events.append((g[2], lambda v, d=_FRAC_WORD[g[1]]: v / d))
        elif g := m(r"{WHO} divides (?:her|his) {W} into (\d+) equal piles and keeps a single pile\."):
            events.append((who(g[1]), lambda v, d=int(g[2]): v / d))
        elif g := m(r"After giving most away, {WHO} is left with {FO} the {W} (?:she|he) had\."):
            events.append((who(g[1]), lambda v, d=_FRAC_OF_WORD[g[2]]: v / d))
        elif (m(r"{N} turns \d+ this year\.") or m(r"{N} walks \d+ miles to the {W} every week\.")
              or m(r"\d+ {W} are owned by {N}'s {W}\.") or m(r"{N} waits \d+ minutes for a bus\.")
              or m(r"On the windowsill sit \d+ {W}\.") or m(r"{N} keeps \d+ {W} in a drawer\.")):
            pass  # distractors: nothing to count
        elif g := (m(r"{N}'s {W} are packed equally into (\d+) {W}\.") ):
            unit = ("/", g[1], int(g[2]))
        elif g := (m(r"A single {W} has a weight of (\d+) grams\.") or m(r"The price of one {W} is (\d+) dollars\.")):
            unit = int(g[1])
        elif g := (m(r"Once all of this is done, what is the number of {W} {N} holds\?") or m(r"What is {N}'s final count of {W}\?")
                   or m(r"How many {W} are in {N}'s possession once everything is over\?") or m(r"What is {N}'s count of {W}\?")
                   or m(r"How many {W} belong to {N}\?") or m(r"Count {N}'s {W}: how many are there\?")):
            asked = ("final", [x for x in g.groups() if x in gender])
        elif g := (m(r"If (.+) put all their {W} together, how many are there\?") or m(r"Together, how many {W} belong to (.+)\?")
                   or m(r"What is the combined count of {W} held by (.+)\?")):
            asked = ("total", re.findall(_NAME, g[0]))
        elif g := (m(r"By how many {W} does {N} lead {N}\?") or m(r"How big is the gap between {N}'s {W} and {N}'s {W}\?")):
            asked = ("diff", [x for x in g.groups() if x in gender])
        elif g := m(r"How many {W} would {N} need to catch up with {N}\?"):
            asked = ("diff", [g[2], g[1]])
        elif g := m(r"What is the number of {W} in each {W}\?"):
            asked = ("div", [unit[1]], unit[2])
        elif g := (m(r"If (\d+) friends split {N}'s {W} evenly, how many {W} does one friend receive\?")
                   or m(r"How many groups of (\d+) can {N} make from (?:her|his) {W}\?")):
            asked = ("div", [g[2]], int(g[1]))
        elif g := m(r"At (\d+) dollars per {W}, how many dollars does {N} make by selling all (?:her|his) {W}\?"):
            asked = ("mul", [g[2]], int(g[1]))
        elif g := (m(r"What is the total weight in grams of {N}'s {W}\?") or m(r"What are {N}'s {W} worth in dollars\?")):
            asked = ("mul", [g[1]], unit)
        else:
            raise AssertionError(f"the reader cannot read {sentence!r}")
        names = re.findall(rf"\b(?:{_WHO[1:-1]})\b", sentence)
        ref = who(names[0]) if names else None
    while len(known) < len({p for r in relations for p in r[:2]} | set(known)):  # propagate the facts
        grew = False
        for a, b, forward, backward in relations:
            for x, y, f in ((a, b, forward), (b, a, backward)):
                if y in known and x not in known:
                    value = f(known[y])
                    assert value == int(value), prompt
                    known[x], grew = int(value), True
        assert grew, f"the facts do not determine every count: {prompt}"
    for name, change in events:
        value = change(known[name])
        assert value == int(value) and value >= 0, prompt
        known[name] = int(value)
    kind, people, *arg = asked
    values = [known[p] for p in people]
    if kind == "final":
        return values[0]
    if kind == "total":
        return sum(values)
    if kind == "diff":
        assert values[0] >= values[1], prompt
        return values[0] - values[1]
    return values[0] // arg[0] if kind == "div" else values[0] * arg[0]


@pytest.mark.parametrize("level", list(LEVELS))
def test_unseen_wording_means_the_program(level):
    lv = LEVELS[level]
    for r in _PROBLEMS[("unseen", level)]:
        assert set(r) == {"prompt", "response", "answer"} and run_solution(r["response"]) == r["answer"], r
        assert lv.min_steps <= count_steps(r["response"]) <= lv.max_steps and len(r["prompt"].split()) <= 80
        assert _read_unseen(r["prompt"]) == r["answer"], r


def test_unseen_programs_use_the_training_vocabulary():
    # the programs' variable names come from the same role names: only the wording of the question is new
    roles = {name: ({r for ts in ph.event.values() for _, r in ts}, {r for _, r in ph.q_div + ph.q_mul})
             for name, ph in PHRASINGS.items()}
    assert roles["unseen"] == roles["seen"]


# sha256 prefixes of seen generation made with the code before the unseen family existed (commit 8c8a722)
_SEEN_DIGESTS = {"starter": "e43e9785063c851a", "easy": "abf9a46bc2a172a1", "medium": "57f9a25e4bb809c7",
                 "hard": "9829f24328081e74"}


@pytest.mark.parametrize("level", list(LEVELS))
def test_seen_generation_is_unchanged(level):
    rng = random.Random(f"seen-digest:{level}")
    problems = [generate_problem(rng, level) for _ in range(40)]
    blob = json.dumps([problems, generate_splits(60, 10, 10, level, seed=2), rng.random()], sort_keys=True)
    assert hashlib.sha256(blob.encode()).hexdigest()[:16] == _SEEN_DIGESTS[level]
    a, b = random.Random(9), random.Random(9)
    assert [generate_problem(a, level) for _ in range(5)] == [generate_problem(b, level, "seen") for _ in range(5)]
    assert a.getstate() == b.getstate()


def test_unseen_test_is_deterministic_and_independent_of_the_other_splits():
    state = random.getstate()
    a = generate_unseen_test(20, "hard", seed=3)
    assert random.getstate() == state
    assert a == generate_unseen_test(20, "hard", seed=3) and a[:8] == generate_unseen_test(8, "hard", seed=3)
    assert a != generate_unseen_test(20, "hard", seed=4)
    assert all(r["phrasing"] == "unseen" for r in a) and len({r["prompt"] for r in a}) == 20
    with pytest.raises(ValueError, match="unknown tinymath phrasing 'novel'"):
        generate_problem(random.Random(0), "easy", phrasing="novel")


def test_write_tinymath_adds_test_unseen(tmp_path):
    paths = write_tinymath(tmp_path, n_train=60, n_val=10, n_test=12, level="medium", seed=7)
    rows = {s: [json.loads(x) for x in paths[s].read_text().splitlines()] for s in ("train", "validation", "test")}
    assert rows == generate_splits(60, 10, 12, "medium", seed=7)  # seen splits as before, no extra field
    unseen = [json.loads(x) for x in paths["test_unseen"].read_text().splitlines()]
    assert paths["test_unseen"] == tmp_path / "test_unseen.jsonl" and unseen == generate_unseen_test(12, "medium", 7)
    assert not {r["prompt"] for r in unseen} & {r["prompt"] for rs in rows.values() for r in rs}
    meta = json.loads(paths["meta"].read_text())
    assert meta["counts"] == {"train": 60, "validation": 10, "test": 12, "test_unseen": 12}
    assert meta["phrasing"] == {"seen": ["train", "validation", "test"], "unseen": ["test_unseen"]}


def test_eval_reads_test_unseen(tmp_path, tiny_tokenizer):
    from dlm.evaluation.run import evaluate_model
    from tests.conftest import tiny_model

    m = tiny_model(len(tiny_tokenizer))
    m.spec.eos_token_id, m.spec.pad_token_id = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    m.save_pretrained(tmp_path / "ar")
    tiny_tokenizer.save_pretrained(tmp_path / "ar")
    paths = write_tinymath(tmp_path / "data", n_train=5, n_val=2, n_test=3, level="starter", seed=1)
    result = evaluate_model(tmp_path / "ar", data=paths["test_unseen"], max_new_tokens=4, truncate_prompts=True,
                            progress=False)
    assert result["n"] == 3 and result["data"] == str(paths["test_unseen"])
    assert result["accuracy"] == 0.0  # an untrained model's 4 tokens cannot hold a `def solution()` program
    prompts = [json.loads(x)["prompt"] for x in paths["test_unseen"].read_text().splitlines()]
    assert [s["prompt"] for s in result["samples"]] == prompts
