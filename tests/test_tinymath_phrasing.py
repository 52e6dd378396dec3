"""tinymath's unseen phrasing (issue 17, item 6): held-out templates, disjoint from the training ones by
construction."""

import hashlib
import json
import random
import re
from string import Formatter

import pytest

from dlm.data import tinymath_templates as tm
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
    "mw": _alt(tm.TIMES_WORDS.values()), "mv": _alt(tm.TIMES_VERBS.values()), "mr": _alt(tm.TIMES_RESULTS.values()),
    "fw": _alt(tm.FRACTION_WORDS.values()), "fo": _alt(tm.FRACTION_OF_WORDS.values()), "rel": _alt(tm.RELATIVES),
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
_RESULT_WORD = {"doubled": 2, "tripled": 3, "quadrupled": 4}
_FW, _MR = _alt(_FRAC_WORD), _alt(_RESULT_WORD)


def _read_unseen(prompt):
    """The answer an unseen-phrasing question asks for, computed from its wording alone (a reader written from the
    meaning of each sentence, not from the generator): facts relate initial counts, events then change them in order
    (a transfer changes both people's counts where they are known), and a pronoun is the first person named in the
    sentence before it, of the same gender."""
    gender = dict(NAMES)
    known, relations, events, asked, pending, ref = {}, [], [], None, None, None
    for sentence in re.split(r"(?<=[.?]) ", prompt):
        def who(word, ref=ref):
            if word in gender:
                return word
            assert ref is not None and gender[ref] == ("f" if word.lower() in ("she", "her") else "m"), (word, prompt)
            return ref

        def m(*patterns, sentence=sentence):
            for pattern in patterns:
                rx = (pattern.replace("{N}", _N).replace("{WHO}", _WHO).replace("{W}", _W).replace("{FW}", f"({_FW})")
                      .replace("{MV}", "(doubles|triples|quadruples)").replace("{MR}", f"({_MR})"))
                if g := re.fullmatch(rx, sentence):
                    return g
            return None

        def rel(a, b, forward, backward):  # count of a = forward(count of b); count of b = backward(count of a)
            relations.append((a, b, forward, backward))

        def change(person, f):
            events.append((who(person), f))

        if g := m(r"{N} keeps (\d+) {W} at home\.", r"In {N}'s house, there are (\d+) {W}\.",
                  r"{N}'s collection is (\d+) {W}\."):
            known[g[1]] = int(g[2])
        elif g := m(r"(\d+) {W} are {N}'s\."):
            known[g[2]] = int(g[1])
        elif g := m(r"Each of {N}'s (\d+) {W} holds (\d+) {W}\.",
                    r"{N} has (\d+) {W}, and there are (\d+) {W} in each one\."):
            known[g[1]] = int(g[2]) * int(g[3])
        elif g := m(r"(\d+) {W} are in each {W}, and {N} has (\d+) {W}\."):
            known[g[2]] = int(g[1]) * int(g[3])
        elif g := m(r"{N} has to get (\d+) more {W} to have as many as {N}\."):
            rel(g[1], g[3], lambda v, d=int(g[2]): v - d, lambda v, d=int(g[2]): v + d)
        elif g := m(r"{N} has all the {W} {N} has, and (\d+) more\."):
            rel(g[1], g[2], lambda v, d=int(g[3]): v + d, lambda v, d=int(g[3]): v - d)
        elif g := m(r"The number of {W} {N} has is (\d+) (more|fewer) than {N} has\."):
            d = int(g[2]) if g[3] == "more" else -int(g[2])
            rel(g[1], g[4], lambda v, d=d: v + d, lambda v, d=d: v - d)
        elif g := m(r"{N} has (\d+) {W} for each {W} {N} has\.",
                    r"The number of {W} {N} has is (\d+) times the number {N} has\."):
            rel(g[1], g[3], lambda v, d=int(g[2]): v * d, lambda v, d=int(g[2]): v / d)
        elif g := m(r"{N} has (\d+) times the number of {W} {N} has\."):
            rel(g[1], g[3], lambda v, d=int(g[2]): v * d, lambda v, d=int(g[2]): v / d)
        elif g := m(r"{N} has one {W} for each (\d+) {W} {N} has\."):
            rel(g[1], g[3], lambda v, d=int(g[2]): v / d, lambda v, d=int(g[2]): v * d)
        elif g := m(r"{N}'s {W} are only {FW} of {N}'s\."):
            d = _FRAC_WORD[g[2]]
            rel(g[1], g[3], lambda v, d=d: v / d, lambda v, d=d: v * d)
        elif g := m(r"(\d+) more {W} are bought by {WHO}\.", r"(\d+) {W} are found by {WHO}\.",
                    r"Then (\d+) more {W} are picked up by {WHO}\.", r"(\d+) {W} are won at a fair by {WHO}\."):
            change(g[2], lambda v, d=int(g[1]): v + d)
        elif g := m(r"(\d+) {W} are given to {WHO} by {WHO}\.", r"(\d+) {W} are borrowed from {WHO} by {WHO}\."):
            taker, giver = (g[2], g[3]) if "given" in sentence else (g[3], g[2])
            events.append((who(taker), lambda v, d=int(g[1]): v + d))
            events.append((who(giver), lambda v, d=int(g[1]): v - d))
        elif g := m(r"(\d+) of {N}'s {W} are sold\.", r"(\d+) {W} are donated to the school by {WHO}\."):
            change(g[2], lambda v, d=int(g[1]): v - d)
        elif g := m(r"On the way home, {WHO} loses (\d+) {W}\."):
            change(g[1], lambda v, d=int(g[2]): v - d)
        elif g := m(r"Then the number of {W} {WHO} has {MV}\."):
            change(g[1], lambda v, d={"doubles": 2, "triples": 3, "quadruples": 4}[g[2]]: v * d)
        elif g := m(r"{N}'s {W} are {MR} after a trade\."):
            change(g[1], lambda v, d=_RESULT_WORD[g[2]]: v * d)
        elif g := m(r"{WHO} ends up with (\d+) times the {W} (?:she|he) had\."):
            change(g[1], lambda v, d=int(g[2]): v * d)
        elif g := m(r"{N}'s {W} are split into (\d+) equal groups, and {WHO} keeps one group\.",
                    r"The {W} {WHO} has are shared equally among (\d+) people, and (?:she|he) keeps one share\."):
            person, d = (g[1], g[2]) if not g[1].isdigit() else (g[2], g[1])
            change(person, lambda v, d=int(d): v / d)
        elif g := m(r"{WHO} gives away all but {FW} of (?:her|his) {W}\."):
            change(g[1], lambda v, d=_FRAC_WORD[g[2]]: v / d)
        elif m(r"The age of {N} is \d+\.", r"{N} lives \d+ miles from the {W}\.", r"\d+ {W} are owned by {N}'s {W}\.",
               r"\d+ minutes are spent by {N} at the {W}\.", r"On the kitchen table, there are \d+ {W}\.",
               r"\d+ {W} are in {N}'s bag\."):
            pass  # distractors: nothing to count
        elif g := m(r"{N}'s {W} are put into (\d+) {W} equally\."):
            pending = ("div", g[1], int(g[2]))
        elif g := m(r"{N} sells all of (?:her|his) {W} for (\d+) dollars each\.",
                    r"{N}'s {W} cost (\d+) dollars each\."):
            pending = ("mul", g[1], int(g[2]))
        elif m(r"How many {W} are in each {W}\?", r"How many dollars are they worth\?"):
            asked = (pending[0], [pending[1]], pending[2])
        elif g := m(r"How many dollars does {WHO} earn\?"):
            assert who(g[1]) == pending[1], prompt
            asked = (pending[0], [pending[1]], pending[2])
        elif g := m(r"If (\d+) friends share {N}'s {W} equally, how many {W} does each of them get\?",
                    r"How many groups of (\d+) {W} can {N} make\?"):
            asked = ("div", [g[2]], int(g[1]))
        elif g := m(r"If one {W} weighs (\d+) grams, how many grams do {N}'s {W} weigh in total\?"):
            asked = ("mul", [g[2]], int(g[1]))
        elif g := m(r"At the end, what is the number of {W} {N} has\?", r"Now, how many {W} are {N}'s\?",
                    r"{N} now has how many {W}\?", r"How many {W} are {N}'s\?", r"{N} has how many {W}\?",
                    r"What number of {W} does {N} own\?"):
            asked = ("final", [g[1]])
        elif g := m(r"If (.+) put all of their {W} together, how many {W} are there\?",
                    r"Altogether, (.+) have how many {W}\?", r"In total, how many {W} are there among (.+)\?"):
            asked = ("total", re.findall(_NAME, g[1]))
        elif g := m(r"{N} has how many more {W} than {N}\?", r"How many more {W} are {N}'s than {N}'s\?"):
            asked = ("diff", [g[1], g[2]])
        elif g := m(r"How many {W} does {N} have to get to have as many as {N}\?"):
            asked = ("diff", [g[2], g[1]])
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
    for name, f in events:
        if name in known:  # a person whose count was never stated only gives or takes
            value = f(known[name])
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
