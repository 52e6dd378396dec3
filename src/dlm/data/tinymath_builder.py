"""How one tinymath problem is drafted from a random stream: people and their quantities, the facts that state them,
the question, the events that change them, distractors, and the wording; the program is written alongside.

A draw that cannot be completed (no operation fits a quantity, no question fits the step count, a total or difference
out of range) returns None, and the caller draws again from the same stream. Every random draw happens in a fixed
order, so a seed always gives the same problems (tests/test_tinymath_frozen.py).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from string import Formatter
from typing import TYPE_CHECKING, NamedTuple

from dlm.data.tinymath_templates import (
    CONTAINERS,
    FRACTION_OF_WORDS,
    FRACTION_WORDS,
    NAMES,
    OBJECTS,
    PHRASINGS,
    PLACES,
    RELATIVES,
    TIMES_RESULTS,
    TIMES_VERBS,
    TIMES_WORDS,
)

if TYPE_CHECKING:
    from dlm.data.tinymath import Difficulty

Person = tuple[str, str]  # (name, "f" or "m")

_PYTHON_OPERATOR = {"+": "+", "-": "-", "*": "*", "/": "//"}
_PERSON_FIELDS = {"S", "s_", "o_", "X", "Npos", "pos", "pr", "B", "A", "O"}  # template fields naming a person
_EVENT_RESULT_NAMES = {"+": ("total", "now"), "-": ("left", "remaining"), "/": ("kept", "share")}


@dataclass
class Holder:
    """A person in the problem with their quantity of the object: its program variable and current value."""

    person: Person
    variable: str = ""
    value: int = 0
    parent: int | None = None  # index of the holder whose quantity this one was stated relative to


class Sentence(NamedTuple):
    """One sentence to write: its template, the fields that fill it, its person, and whether a pronoun may name them."""

    template: str
    fields: dict
    person: Person | None
    may_use_pronoun: bool


class Question(NamedTuple):
    """A question the problem may end with: its kind, the operations it adds, and the holders whose values it reads."""

    kind: str  # "total", "final", "div", "mul" or "diff"
    cost: int
    targets: list[int]


def person_fields(person: Person | None, as_pronoun: bool) -> dict:
    """Template fields naming `person`, as a pronoun when `as_pronoun` (a sentence about the person just named)."""
    if person is None:
        return {}
    name, gender = person
    she, her, his, herself = ("she", "her", "her", "herself") if gender == "f" else ("he", "him", "his", "himself")
    return {"S": she.capitalize() if as_pronoun else name, "s_": she if as_pronoun else name,
            "o_": her if as_pronoun else name, "pos": his, "pr": she, "refl": herself, "Npos": f"{name}'s", "X": name}


def keeps_subject(template: str, phrasing: str) -> bool:
    """Whether a sentence leaves its own person as the one a following pronoun refers to."""
    if phrasing == "seen":  # the rule the seen data was generated with: changing it would change that data
        return not template.startswith(("There", "{O}"))
    first = next((field for _, field, _, _ in Formatter().parse(template) if field in _PERSON_FIELDS), None)
    return first is not None and first not in ("B", "A", "O")


class ProblemBuilder:
    """Drafts one problem: program lines in dependency order and prompt sentences (facts possibly shuffled)."""

    def __init__(self, rng: random.Random, level: Difficulty, phrasing: str = "seen"):
        self.rng, self.level, self.phrasing, self.templates = rng, level, phrasing, PHRASINGS[phrasing]
        self.value_cap = min(10 * level.max_number, 10_000)  # every intermediate value stays in 1..value_cap
        self.lines: list[str] = []
        self.variables: set[str] = set()
        self.numbers_used: set[int] = set()  # numbers the prompt mentions; distractors avoid them
        self.holders: list[Holder] = []
        self.people: list[Person] = []

    # --- program variables ---------------------------------------------------------------------------------------

    def fresh_name(self, *candidates: str) -> str:
        """The first unused candidate name, else the first one numbered 2, 3, ...; marked used."""
        numbered = (f"{candidates[0]}{suffix}" for suffix in itertools.count(2))
        name = next(c for c in itertools.chain(candidates, numbered) if c not in self.variables)
        self.variables.add(name)
        return name

    def assign(self, candidates: tuple[str, ...], expression: str) -> str:
        """Append `name = expression` to the program under a fresh name; return the name."""
        name = self.fresh_name(*candidates)
        self.lines.append(f"{name} = {expression}")
        return name

    # --- numbers (None: this draw cannot be completed) ------------------------------------------------------------

    def number(self, low: int, high: int) -> int:
        """A random number in low..high (never empty: a Difficulty's max_number is at least 5), remembered as used."""
        drawn = self.rng.randint(low, high)
        self.numbers_used.add(drawn)
        return drawn

    def in_range(self, value: int) -> int | None:
        """`value` when it is a positive integer within the cap, else None."""
        return value if 1 <= value <= self.value_cap else None

    def operand(self, op: str, value: int, scale: int) -> int | None:
        """A random operand making `value op operand` a valid bounded positive integer, or None."""
        if op == "+":
            high = min(scale, self.value_cap - value)
            return self.rng.randint(2, high) if high >= 2 else None
        if op == "-":
            high = min(scale, value - 1)
            return self.rng.randint(2, high) if high >= 2 else None
        if op == "*":
            factors = [m for m in (2, 3, 4) if value * m <= self.value_cap]
        else:
            factors = [m for m in (2, 3, 4, 5) if value % m == 0]
        return self.rng.choice(factors) if factors else None

    def pick_operation(self, value: int, scale: int) -> tuple[str, int] | None:
        """An operation of the level (tried in random order) and an operand that fits `value`, or None."""
        ops = list(self.level.operations)
        self.rng.shuffle(ops)
        for op in ops:
            arg = self.operand(op, value, scale)
            if arg is not None:
                self.numbers_used.add(arg)
                return op, arg
        return None

    @staticmethod
    def apply(op: str, value: int, arg: int) -> int:
        """`value op arg` (integer division for /); within 1..value_cap for every operand `operand` returns."""
        return {"+": value + arg, "-": value - arg, "*": value * arg, "/": value // arg}[op]

    def base_value(self) -> int:
        """A starting quantity: half the time a multiple of a small divisor when the level divides."""
        high = self.level.max_number
        if "/" in self.level.operations and self.rng.random() < 0.5:
            divisor = self.rng.choice((2, 3, 4, 6, 10))
            value = divisor * self.rng.randint(1, high // divisor)
            if value >= 2:
                self.numbers_used.add(value)
                return value
        return self.number(2, high)

    # --- the problem, part by part ----------------------------------------------------------------------------------

    def state_relative(self, index: int, holder: Holder, own_name: tuple[str, ...]) -> Sentence | None:
        """State `holder`'s quantity relative to an earlier holder's ("3 more than Ben")."""
        holder.parent = index - 1 if self.rng.random() < 0.7 else self.rng.randrange(index)
        parent = self.holders[holder.parent]
        picked = self.pick_operation(parent.value, max(2, self.level.max_number // 2))
        if picked is None:
            return None
        op, arg = picked
        holder.value = self.apply(op, parent.value, arg)
        holder.variable = self.assign(own_name, f"{parent.variable} {_PYTHON_OPERATOR[op]} {arg}")
        fields = {"B": parent.person[0], "d": arg, "mw": TIMES_WORDS.get(arg), "fw": FRACTION_WORDS.get(arg),
                  "fo": FRACTION_OF_WORDS.get(arg)}
        return Sentence(self.rng.choice(self.templates.rel[op]), fields, holder.person, False)

    def state_product(self, holder: Holder, own_name: tuple[str, ...]) -> Sentence:
        """State `holder`'s quantity as containers times items per container (at most value_cap by construction)."""
        (container, containers), count = self.rng.choice(CONTAINERS), self.number(2, 9)
        per_container = self.number(2, min(self.level.max_number, self.value_cap // count))
        count_var = self.assign((containers,), str(count))
        per_var = self.assign((f"per_{container}",), str(per_container))
        holder.value, holder.variable = count * per_container, self.assign(own_name, f"{count_var} * {per_var}")
        fields = {"a": count, "b": per_container, "C": container, "Cp": containers}
        return Sentence(self.rng.choice(self.templates.product), fields, holder.person, False)

    def state_facts(self, object_plural: str) -> tuple[list[Sentence], int] | None:
        """One fact per holder (plain, relative or a product) and the number of operations they add; None to redraw."""
        level, facts, steps = self.level, [], 0
        for index, holder in enumerate(self.holders):
            own_name = (object_plural.replace(" ", "_"),) if len(self.holders) == 1 else (holder.person[0].lower(),)
            if index > 0 and level.relational and self.rng.random() < 0.85:
                fact, steps = self.state_relative(index, holder, own_name), steps + 1
            elif "*" in level.operations and self.rng.random() < 0.2:
                fact, steps = self.state_product(holder, own_name), steps + 1
            else:
                holder.value = self.base_value()
                holder.variable = self.assign(own_name, str(holder.value))
                fact = Sentence(self.rng.choice(self.templates.base), {"d": holder.value}, holder.person, False)
            if fact is None:
                return None
            facts.append(fact)
        return facts, steps

    def with_sources(self, index: int) -> set[int]:
        """Holder `index` and every holder its quantity was stated relative to, transitively."""
        parent = self.holders[index].parent
        return {index} | (self.with_sources(parent) if parent is not None else set())

    def choose_question(self, steps_left: int) -> Question | None:
        """A question that reads every holder's value and costs at most `steps_left` operations, or None."""
        count, ops = len(self.holders), self.level.operations
        last, everyone = count - 1, set(range(count))
        options = []
        if count > 1 and "+" in ops:
            options.append(Question("total", count - 1, list(range(count))))
        if self.with_sources(last) == everyone:
            options.append(Question("final", 0, [last]))
            options += [Question(kind, 1, [last]) for kind, op in (("div", "/"), ("mul", "*")) if op in ops]
        if "-" in ops and count > 1:
            options += [Question("diff", 1, [last, other]) for other in range(last)
                        if self.with_sources(last) | self.with_sources(other) == everyone]
        options = [q for q in options if q.cost <= steps_left]
        if not options:
            return None
        kind = self.rng.choice(sorted({q.kind for q in options}))
        return self.rng.choice([q for q in options if q.kind == kind])

    def add_event(self, holder: Holder, bystanders: list[Person]) -> Sentence | None:
        """One event changing `holder`'s quantity (buys, loses, doubles, splits), or None to redraw."""
        picked = self.pick_operation(holder.value, self.level.max_number)
        if picked is None:
            return None
        op, arg = picked
        template, amount_name = self.rng.choice(self.templates.event[op])
        prefix = "" if len(self.holders) == 1 else holder.person[0].lower() + "_"
        names = _EVENT_RESULT_NAMES[op] if op in _EVENT_RESULT_NAMES else (TIMES_RESULTS[arg],)  # "*": arg in 2..4
        result_names = tuple(prefix + name for name in names)
        if op in "+-":
            amount = self.assign((amount_name,), str(arg))
            holder.variable = self.assign(result_names, f"{holder.variable} {op} {amount}")
        else:
            holder.variable = self.assign(result_names, f"{holder.variable} {_PYTHON_OPERATOR[op]} {arg}")
        holder.value = self.apply(op, holder.value, arg)
        fields = {"d": arg, "m": arg, "mw": TIMES_WORDS.get(arg), "mv": TIMES_VERBS.get(arg),
                  "fo": FRACTION_OF_WORDS.get(arg), "O": self.rng.choice(bystanders)[0], "mr": TIMES_RESULTS.get(arg),
                  "fw": FRACTION_WORDS.get(arg)}
        return Sentence(template, fields, holder.person, True)

    def ask_scaled(self, question: Question, fields: dict) -> tuple[Sentence, int, str] | None:
        """A "div" or "mul" question: the asked-about quantity shared into or multiplied by a small number."""
        subject = self.holders[question.targets[0]]
        if question.kind == "div":
            factors = [m for m in range(2, 11) if subject.value % m == 0 and subject.value > m]
            template, result_name = self.rng.choice(self.templates.q_div)
        else:
            factors = [m for m in range(2, 11) if subject.value * m <= self.value_cap]
            template, result_name = self.rng.choice(self.templates.q_mul)
        if not factors:
            return None
        factor = self.rng.choice(factors)
        self.numbers_used.add(factor)
        container, containers = self.rng.choice(CONTAINERS)
        fields.update(m=factor, C=container, Cp=containers)
        answer = subject.value // factor if question.kind == "div" else subject.value * factor
        op = "//" if question.kind == "div" else "*"
        returned = self.assign((result_name,), f"{subject.variable} {op} {factor}")
        return Sentence(template, fields, subject.person, False), answer, returned

    def ask(self, question: Question, after_events: bool) -> tuple[Sentence, int, str] | None:
        """The question sentence, its answer and the variable the program returns; None to redraw."""
        subject = self.holders[question.targets[0]]
        names = [p[0] for p in self.people[:len(self.holders)]]
        fields = {"S": subject.person[0], "names": ", ".join(names[:-1]) + f" and {names[-1]}"}
        if question.kind == "total":
            answer = self.in_range(sum(h.value for h in self.holders))
            if answer is None:
                return None
            returned = self.assign(("total",), " + ".join(h.variable for h in self.holders))
            template = self.rng.choice(self.templates.q_total)
        elif question.kind == "final":
            answer, returned = subject.value, subject.variable
            template = self.rng.choice(self.templates.q_final_ev if after_events else self.templates.q_final)
        elif question.kind == "diff":
            more, fewer = sorted((self.holders[t] for t in question.targets), key=lambda h: -h.value)
            answer = self.in_range(more.value - fewer.value)
            if answer is None:
                return None
            returned = self.assign(("diff",), f"{more.variable} - {fewer.variable}")
            template, fields = self.rng.choice(self.templates.q_diff), {"A": more.person[0], "B": fewer.person[0]}
        else:
            return self.ask_scaled(question, fields)
        return Sentence(template, fields, subject.person, False), answer, returned

    def add_distractors(self, body: list[Sentence], object_plural: str) -> None:
        """Insert the level's irrelevant sentences (ages, distances, other objects) at random places in `body`."""
        for _ in range(self.rng.randint(0, self.level.distractors)):
            unused = [d for d in range(2, self.level.max_number + 1) if d not in self.numbers_used]
            number = self.rng.choice(unused)
            self.numbers_used.add(number)
            template, person = self.rng.choice(self.templates.distract), self.rng.choice(self.people)
            subject = person if template.startswith("{X} ") else None
            fields = {"d": number, "Q": self.rng.choice([o for o in OBJECTS if o[1] != object_plural])[1],
                      "rel": self.rng.choice(RELATIVES), "place": self.rng.choice(PLACES),
                      **person_fields(person, False)}
            body.insert(self.rng.randint(0, len(body)), Sentence(template, fields, subject, False))

    def write(self, body: list[Sentence], object_singular: str, object_plural: str) -> str:
        """The prompt: each sentence filled in, a pronoun sometimes standing for the person just named."""
        sentences, previous = [], None
        for template, fields, person, may_use_pronoun in body:
            pronoun = may_use_pronoun and person == previous and self.rng.random() < 0.6
            sentences.append(template.format(**{**person_fields(person, pronoun), "P": object_plural,
                                                "s": object_singular, **fields}))
            previous = person if keeps_subject(template, self.phrasing) else None
        return " ".join(sentences)

    def build(self) -> dict | None:
        """A draft problem {"prompt", "response", "answer"}, or None when this draw cannot be completed."""
        rng, level = self.rng, self.level
        target_steps = rng.randint(level.min_steps, level.max_steps)
        object_singular, object_plural = rng.choice(OBJECTS)
        count = rng.randint(max(1, level.max_entities - 2), level.max_entities)
        self.people = rng.sample(NAMES, count + 3)
        self.holders, bystanders = [Holder(p) for p in self.people[:count]], self.people[count:]
        stated = self.state_facts(object_plural)
        if stated is None:
            return None
        facts, steps = stated
        if level.shuffle_facts:
            rng.shuffle(facts)
        question = self.choose_question(target_steps - steps)
        if question is None:
            return None
        events: list[Sentence] = []
        for _ in range(target_steps - steps - question.cost):
            event = self.add_event(self.holders[rng.choice(question.targets)], bystanders)
            if event is None:
                return None
            events.append(event)
        asked = self.ask(question, after_events=bool(events))
        if asked is None:
            return None
        sentence, answer, returned = asked
        body = facts + events
        self.add_distractors(body, object_plural)
        body.append(sentence)
        code = "def solution():\n" + "".join(f"    {line}\n" for line in self.lines) + f"    return {returned}"
        return {"prompt": self.write(body, object_singular, object_plural), "response": code, "answer": answer}
