"""tinymath: synthetic arithmetic word problems (TinyGSM-style) whose answer is a short Python program.

Each record is ``{"prompt", "response", "answer"}``; ``response`` defines ``solution()``, which returns the integer
``answer``. Generation is deterministic given a seed and uses only the standard library. Two phrasing families word
the same arithmetic: ``seen`` (every training split) and ``unseen`` (only ``test_unseen``), which share no sentence
template, so accuracy on ``test_unseen`` measures generalisation beyond the training templates (issue 17, item 6).
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Formatter

from dlm.data.tinymath_templates import (
    _FRAC,
    _FRAC_OF,
    _MRES,
    _MULT,
    _MVERB,
    CONTAINERS,
    NAMES,
    OBJECTS,
    PHRASINGS,
    PLACES,
    RELATIVES,
)

__all__ = ["Difficulty", "LEVELS", "PHRASINGS", "generate_problem", "generate_splits", "generate_unseen_test",
           "write_tinymath", "corrupt_program", "run_solution", "count_steps"]


@dataclass(frozen=True)
class Difficulty:
    """Knobs controlling the size and structure of generated problems."""

    name: str
    min_steps: int
    max_steps: int
    max_number: int
    operations: tuple[str, ...] = ("+", "-")
    relational: bool = False
    distractors: int = 0
    shuffle_facts: bool = False
    max_entities: int = 1

    def __post_init__(self):
        if not self.operations or not set(self.operations) <= set("+-*/"):
            raise ValueError(f"operations must be a non-empty subset of '+-*/', got {self.operations!r}")
        if not 1 <= self.min_steps <= self.max_steps or self.max_number < 5 or self.max_entities < 1:
            raise ValueError(f"invalid difficulty {self!r}")


LEVELS: dict[str, Difficulty] = {
    # one operation on numbers up to 20: a fast-learning level for smoke and learning tests, not for comparisons
    "starter": Difficulty("starter", 1, 1, 20, ("+", "-"), False, 0, False, 1),
    "easy": Difficulty("easy", 1, 2, 20, ("+", "-"), False, 0, False, 1),
    "medium": Difficulty("medium", 2, 4, 50, ("+", "-", "*", "/"), True, 1, True, 2),
    "hard": Difficulty("hard", 4, 6, 100, ("+", "-", "*", "/"), True, 2, True, 4),
}

_PYOP = {"+": "+", "-": "-", "*": "*", "/": "//"}
_PEOPLE = {"S", "s_", "o_", "X", "Npos", "pos", "pr", "B", "A", "O"}  # template fields naming a person


def _keeps_subject(tpl: str, phrasing: str) -> bool:
    """Whether a sentence leaves its own person as the one a following pronoun refers to."""
    if phrasing == "seen":  # the rule the seen data was generated with: changing it would change that data
        return not tpl.startswith(("There", "{O}"))
    first = next((f for _, f, _, _ in Formatter().parse(tpl) if f in _PEOPLE), None)
    return first is not None and first not in ("B", "A", "O")


class _Retry(Exception):
    """Raised when a random draw cannot be completed; the caller draws again."""


class _Ent:
    """A person holding a quantity of the problem's object."""

    def __init__(self, person: tuple[str, str]):
        self.person, self.var, self.value, self.parent = person, "", 0, None


def _forms(person: tuple[str, str] | None, pronoun: bool) -> dict:
    """Template fields naming `person` (as a pronoun when `pronoun`)."""
    if person is None:
        return {}
    name, g = person
    she, her, his, refl = ("she", "her", "her", "herself") if g == "f" else ("he", "him", "his", "himself")
    return {"S": she.capitalize() if pronoun else name, "s_": she if pronoun else name, "o_": her if pronoun else name,
            "pos": his, "pr": she, "refl": refl, "Npos": f"{name}'s", "X": name}


class _Builder:
    """Builds one problem: program lines (dependency order) and prompt sentences (possibly shuffled)."""

    def __init__(self, rng: random.Random, lv: Difficulty, phrasing: str = "seen"):
        self.rng, self.lv, self.phrasing, self.t = rng, lv, phrasing, PHRASINGS[phrasing]
        self.cap = min(10 * lv.max_number, 10_000)
        self.lines: list[str] = []
        self.used: set[str] = set()
        self.nums: set[int] = set()

    def fresh(self, *bases: str) -> str:
        for b in bases:
            if b not in self.used:
                self.used.add(b)
                return b
        i = 2
        while f"{bases[0]}{i}" in self.used:
            i += 1
        self.used.add(f"{bases[0]}{i}")
        return f"{bases[0]}{i}"

    def assign(self, names: tuple[str, ...], expr: str) -> str:
        var = self.fresh(*names)
        self.lines.append(f"{var} = {expr}")
        return var

    def num(self, lo: int, hi: int) -> int:
        if hi < lo:
            raise _Retry
        d = self.rng.randint(lo, hi)
        self.nums.add(d)
        return d

    def check(self, v: int) -> int:
        if not 1 <= v <= self.cap:
            raise _Retry
        return v

    def operand(self, op: str, v: int, scale: int) -> int | None:
        """A random operand making `v op operand` a valid bounded positive integer, or None."""
        if op == "+":
            hi = min(scale, self.cap - v)
            return self.rng.randint(2, hi) if hi >= 2 else None
        if op == "-":
            hi = min(scale, v - 1)
            return self.rng.randint(2, hi) if hi >= 2 else None
        ms = [m for m in (2, 3, 4) if v * m <= self.cap] if op == "*" else [m for m in (2, 3, 4, 5) if v % m == 0]
        return self.rng.choice(ms) if ms else None

    def pick(self, v: int, scale: int) -> tuple[str, int]:
        ops = list(self.lv.operations)
        self.rng.shuffle(ops)
        for op in ops:
            arg = self.operand(op, v, scale)
            if arg is not None:
                self.nums.add(arg)
                return op, arg
        raise _Retry

    def apply(self, op: str, v: int, arg: int) -> int:
        return self.check({"+": v + arg, "-": v - arg, "*": v * arg, "/": v // arg}[op])

    def base_value(self) -> int:
        hi = self.lv.max_number
        if "/" in self.lv.operations and self.rng.random() < 0.5:
            m = self.rng.choice((2, 3, 4, 6, 10))
            v = m * self.rng.randint(1, hi // m)
            if v >= 2:
                self.nums.add(v)
                return v
        return self.num(2, hi)

    def build(self) -> dict:
        rng, lv, t = self.rng, self.lv, self.t
        k = rng.randint(lv.min_steps, lv.max_steps)
        obj_s, obj_p = rng.choice(OBJECTS)
        n = rng.randint(max(1, lv.max_entities - 2), lv.max_entities)
        people = rng.sample(NAMES, n + 3)
        ents, others = [_Ent(p) for p in people[:n]], people[n:]
        facts, steps = [], 0
        for i, e in enumerate(ents):
            own = (obj_p.replace(" ", "_"),) if n == 1 else (e.person[0].lower(),)
            if i > 0 and lv.relational and rng.random() < 0.85:
                e.parent = i - 1 if rng.random() < 0.7 else rng.randrange(i)
                par = ents[e.parent]
                op, arg = self.pick(par.value, max(2, lv.max_number // 2))
                e.value = self.apply(op, par.value, arg)
                e.var = self.assign(own, f"{par.var} {_PYOP[op]} {arg}")
                f = {"B": par.person[0], "d": arg, "mw": _MULT.get(arg), "fw": _FRAC.get(arg), "fo": _FRAC_OF.get(arg)}
                facts.append((rng.choice(t.rel[op]), f, e.person, False))
                steps += 1
            elif "*" in lv.operations and rng.random() < 0.2:
                (c, cp), a = rng.choice(CONTAINERS), self.num(2, 9)
                b = self.num(2, min(lv.max_number, self.cap // a))
                cv, pv = self.assign((cp,), str(a)), self.assign((f"per_{c}",), str(b))
                e.value, e.var = self.check(a * b), self.assign(own, f"{cv} * {pv}")
                facts.append((rng.choice(t.product), {"a": a, "b": b, "C": c, "Cp": cp}, e.person, False))
                steps += 1
            else:
                e.value = self.base_value()
                e.var = self.assign(own, str(e.value))
                facts.append((rng.choice(t.base), {"d": e.value}, e.person, False))
        if lv.shuffle_facts:
            rng.shuffle(facts)

        def anc(i: int) -> set[int]:
            return {i} | (anc(ents[i].parent) if ents[i].parent is not None else set())

        everyone, last, ops = set(range(n)), n - 1, lv.operations
        qs = []  # (kind, step cost, entities whose final values the question reads)
        if n > 1 and "+" in ops:
            qs.append(("total", n - 1, list(range(n))))
        if anc(last) == everyone:
            qs += [("final", 0, [last])] + [(q, 1, [last]) for q, o in (("div", "/"), ("mul", "*")) if o in ops]
        if "-" in ops and n > 1:
            qs += [("diff", 1, [last, j]) for j in range(last) if anc(last) | anc(j) == everyone]
        qs = [q for q in qs if steps + q[1] <= k]
        if not qs:
            raise _Retry
        kind = rng.choice(sorted({q[0] for q in qs}))
        kind, cost, targets = rng.choice([q for q in qs if q[0] == kind])
        events = []
        for _ in range(k - steps - cost):
            e = rng.choice([ents[t] for t in targets])
            op, arg = self.pick(e.value, lv.max_number)
            tpl, role = rng.choice(t.event[op])
            prefix = "" if n == 1 else e.person[0].lower() + "_"
            res = {"+": ("total", "now"), "-": ("left", "remaining"), "/": ("kept", "share")}.get(op, (_MRES.get(arg),))
            if op in "+-":
                amount = self.assign((role,), str(arg))
                e.var = self.assign(tuple(prefix + r for r in res), f"{e.var} {op} {amount}")
            else:
                e.var = self.assign(tuple(prefix + r for r in res), f"{e.var} {_PYOP[op]} {arg}")
            e.value = self.apply(op, e.value, arg)
            f = {"d": arg, "m": arg, "mw": _MULT.get(arg), "mv": _MVERB.get(arg), "fo": _FRAC_OF.get(arg),
                 "O": rng.choice(others)[0], "mr": _MRES.get(arg), "fw": _FRAC.get(arg)}
            events.append((tpl, f, e.person, True))
        subj = ents[targets[0]]
        qf = {"S": subj.person[0], "names": ", ".join(p[0] for p in people[: n - 1]) + f" and {people[n - 1][0]}"}
        if kind == "total":
            answer = self.check(sum(e.value for e in ents))
            ret = self.assign(("total",), " + ".join(e.var for e in ents))
            q = rng.choice(t.q_total)
        elif kind == "final":
            answer, ret, q = subj.value, subj.var, rng.choice(t.q_final_ev if events else t.q_final)
        elif kind == "diff":
            a, b = sorted((ents[t] for t in targets), key=lambda e: -e.value)
            answer, ret = self.check(a.value - b.value), self.assign(("diff",), f"{a.var} - {b.var}")
            q, qf = rng.choice(t.q_diff), {"A": a.person[0], "B": b.person[0]}
        else:
            if kind == "div":
                ms = [m for m in range(2, 11) if subj.value % m == 0 and subj.value > m]
                q, name = rng.choice(t.q_div)
            else:
                ms = [m for m in range(2, 11) if subj.value * m <= self.cap]
                q, name = rng.choice(t.q_mul)
            if not ms:
                raise _Retry
            m = rng.choice(ms)
            self.nums.add(m)
            c, cp = rng.choice(CONTAINERS)
            qf.update(m=m, C=c, Cp=cp)
            answer = subj.value // m if kind == "div" else subj.value * m
            ret = self.assign((name,), f"{subj.var} {'//' if kind == 'div' else '*'} {m}")
        body = facts + events
        for _ in range(rng.randint(0, lv.distractors)):
            choices = [d for d in range(2, lv.max_number + 1) if d not in self.nums]
            d = rng.choice(choices)
            self.nums.add(d)
            tpl, x = rng.choice(t.distract), rng.choice(people)
            subject = x if tpl.startswith("{X} ") else None
            f = {"d": d, "Q": rng.choice([o for o in OBJECTS if o[1] != obj_p])[1], "rel": rng.choice(RELATIVES),
                 "place": rng.choice(PLACES), **_forms(x, False)}
            body.insert(rng.randint(0, len(body)), (tpl, f, subject, False))
        body.append((q, qf, subj.person, False))
        sentences, prev = [], None
        for tpl, f, person, may_pronoun in body:
            pron = may_pronoun and person == prev and rng.random() < 0.6
            sentences.append(tpl.format(**{**_forms(person, pron), "P": obj_p, "s": obj_s, **f}))
            prev = person if _keeps_subject(tpl, self.phrasing) else None
        code = "def solution():\n" + "".join(f"    {line}\n" for line in self.lines) + f"    return {ret}"
        prompt = " ".join(sentences)
        steps_ok = lv.min_steps <= count_steps(code) <= lv.max_steps
        if len(prompt.split()) > 80 or run_solution(code) != answer or not steps_ok:
            raise _Retry
        return {"prompt": prompt, "response": code, "answer": answer}


def run_solution(code: str):
    """Run a generated program and return ``solution()``'s value, or None if it fails (trusted, own code only)."""
    scope: dict = {"__builtins__": {}}
    try:
        exec(compile(code, "<tinymath>", "exec"), scope)
        return scope["solution"]()
    except Exception:
        return None


def count_steps(code: str) -> int:
    """Number of arithmetic operations (binary operators) in a program."""
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(ast.parse(code)))


def _resolve(level: str | Difficulty) -> Difficulty:
    """The Difficulty for a level name (or the Difficulty itself)."""
    if isinstance(level, Difficulty):
        return level
    if level not in LEVELS:
        raise ValueError(f"unknown tinymath level {level!r}; choose from {sorted(LEVELS)}")
    return LEVELS[level]


def generate_problem(rng: random.Random, level: Difficulty | str = "medium", phrasing: str = "seen") -> dict:
    """One problem {"prompt", "response", "answer"} drawn with `rng` at `level`, worded by the `phrasing` family
    ("seen": the training templates; "unseen": held-out templates for `test_unseen`)."""
    lv = _resolve(level)
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown tinymath phrasing {phrasing!r}; choose from {sorted(PHRASINGS)}")
    for _ in range(1000):
        try:
            return _Builder(rng, lv, phrasing).build()
        except _Retry:
            continue
    raise RuntimeError(f"could not generate a problem for {lv!r}")


def generate_splits(n_train: int, n_val: int, n_test: int, level: str | Difficulty = "medium",
                    seed: int = 0) -> dict[str, list[dict]]:
    """Train/validation/test records, disjoint by prompt; test and validation do not depend on n_train."""
    lv, seen, out = _resolve(level), set(), {}
    for split, n in (("test", n_test), ("validation", n_val), ("train", n_train)):
        rng, records = random.Random(f"tinymath:{seed}:{split}"), []
        for _ in range(50 * n + 1000):
            if len(records) >= n:
                break
            rec = generate_problem(rng, lv)
            if rec["prompt"] not in seen:
                seen.add(rec["prompt"])
                records.append(rec)
        if len(records) < n:
            raise RuntimeError(f"only {len(records)} distinct {split} problems at level {lv.name!r}")
        out[split] = records
    return {"train": out["train"], "validation": out["validation"], "test": out["test"]}


def generate_unseen_test(n: int, level: str | Difficulty = "medium", seed: int = 0) -> list[dict]:
    """`n` distinct problems in the unseen phrasing (records carry "phrasing": "unseen"), from their own rng stream:
    they do not depend on the seen splits' sizes, and share no sentence template with them."""
    lv, seen, records = _resolve(level), set(), []
    rng = random.Random(f"tinymath:{seed}:test_unseen")
    for _ in range(50 * n + 1000):
        if len(records) >= n:
            break
        rec = generate_problem(rng, lv, phrasing="unseen")
        if rec["prompt"] not in seen:
            seen.add(rec["prompt"])
            records.append({**rec, "phrasing": "unseen"})
    if len(records) < n:
        raise RuntimeError(f"only {len(records)} distinct test_unseen problems at level {lv.name!r}")
    return records


def write_tinymath(out_dir, n_train: int = 20000, n_val: int = 500, n_test: int = 500,
                   level: str | Difficulty = "medium", seed: int = 0) -> dict[str, Path]:
    """Write train/validation/test jsonl, test_unseen.jsonl (as many problems as test, in the held-out phrasing),
    corpus.txt and meta.json under `out_dir`; return their paths."""
    lv, out = _resolve(level), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = generate_splits(n_train, n_val, n_test, lv, seed)
    paths = {name: out / f"{name}.jsonl" for name in splits}
    for name, records in splits.items():
        paths[name].write_text("".join(json.dumps({k: r[k] for k in ("prompt", "response", "answer")}) + "\n"
                                       for r in records))
    paths["test_unseen"] = out / "test_unseen.jsonl"
    unseen = generate_unseen_test(n_test, lv, seed)
    paths["test_unseen"].write_text("".join(json.dumps(r) + "\n" for r in unseen))
    paths["corpus"] = out / "corpus.txt"
    paths["corpus"].write_text("\n\n".join(f"user: {r['prompt']}\nassistant: {r['response']}"
                                           for r in splits["train"]) + "\n")
    paths["meta"] = out / "meta.json"
    meta = {"task": "tinymath", "level": asdict(lv), "seed": seed,
            "counts": {**{name: len(records) for name, records in splits.items()}, "test_unseen": len(unseen)},
            "phrasing": {"seen": list(splits), "unseen": ["test_unseen"]}}
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    return paths


def _mutate(rng: random.Random, code: str) -> str | None:
    """One random corruption of `code`: a swapped operator, a changed number or broken syntax."""
    kind = rng.choice(("op", "num", "syntax"))
    if kind == "op":
        spots = list(re.finditer(r" (\+|-|\*|//) ", code))
        if not spots:
            return None
        s = rng.choice(spots)
        new = rng.choice([o for o in ("+", "-", "*", "//") if o != s.group(1)])
        return f"{code[:s.start(1)]}{new}{code[s.end(1):]}"
    if kind == "num":
        spots = list(re.finditer(r"\b\d+\b", code))
        if not spots:
            return None
        s = rng.choice(spots)
        old = int(s.group())
        new = max(1, old + rng.choice((-3, -2, -1, 1, 2, 3, 5, 10))) if rng.random() < 0.8 else old * 2
        return f"{code[:s.start()]}{new}{code[s.end():]}"
    lines = code.split("\n")
    i = rng.randrange(1, len(lines))
    how = rng.choice(("colon", "operand", "equals", "paren"))
    if how == "colon":
        lines[0] = lines[0].rstrip(":")
    elif how == "operand" and re.search(r" (\+|-|\*|//) ", lines[i]):
        lines[i] = lines[i].rsplit(" ", 1)[0]
    elif how == "equals" and " = " in lines[i]:
        lines[i] = lines[i].replace(" = ", " ", 1)
    else:
        lines[i] = lines[i] + " ("
    return "\n".join(lines)


def add_rejected(records: list[dict], seed: int = 0) -> list[dict]:
    """Preference pairs for reward models: each record gains `rejected`, a corrupted version of its program (wrong
    operation, wrong number or broken syntax), deterministic by seed."""
    rng = random.Random(seed * 7919 + 17)
    return [{**r, "rejected": corrupt_program(rng, r)} for r in records]


def corrupt_program(rng: random.Random, record: dict) -> str:
    """A wrong version of `record["response"]` (verified by running it) for preference pairs."""
    code, answer = record["response"], record["answer"]
    for _ in range(50):
        bad = _mutate(rng, code)
        if bad is not None and bad != code and run_solution(bad) != answer:
            return bad
    head, ret = code.rsplit("return ", 1)
    return f"{head}return {ret} + 1"
