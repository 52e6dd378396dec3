"""tinymath's words and sentence templates: names, objects, and two phrasing families that word the same arithmetic.

``seen`` words every training split (train/validation/test); ``unseen`` words only ``test_unseen`` and shares no
sentence template with ``seen`` (tests/test_tinymath_phrasing.py), so accuracy on it measures generalisation beyond
the training wording (issue 17, item 6). Fields: {S}/{s_}/{o_} the person as subject (capitalised or not) or object,
{X} their name, {Npos}/{pos} possessives, {B}/{A}/{O} other people, {d}/{a}/{b}/{m} numbers, {P}/{s} the object.
"""

from __future__ import annotations

from dataclasses import dataclass

_FEMALE_NAMES = ("Mia Emma Ava Lily Zoe Nora Ella Chloe Grace Ruby Hannah Sara Lucy Amy Julia Nina Rosa Maya "
                 "Ivy Anna Kate Leah Olivia").split()
_MALE_NAMES = ("Leo Tom Ben Sam Jack Noah Liam Owen Eli Luke Ryan Adam Omar Ivan Hugo Carl Dan Paul Raj Theo "
               "Finn Kai Jake").split()
NAMES: list[tuple[str, str]] = [(n, "f") for n in _FEMALE_NAMES] + [(n, "m") for n in _MALE_NAMES]
OBJECTS: list[tuple[str, str]] = [(s, s + "s") for s in (
    "apple marble sticker pencil cookie book card shell stamp coin balloon crayon flower candy cupcake muffin button "
    "feather ribbon rock egg grape lemon bead block puzzle kite sock orange plum toy".split())] + [
    ("peach", "peaches"), ("cherry", "cherries"), ("leaf", "leaves"), ("brush", "brushes")]
OBJECTS = [(s, "candies" if s == "candy" else p) for s, p in OBJECTS]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("basket", "baskets"), ("pack", "packs"),
              ("tray", "trays"), ("bucket", "buckets")]
PLACES = ["park", "library", "school", "store", "zoo", "beach", "market", "pool"]
RELATIVES = ["brother", "sister", "cousin", "aunt", "uncle", "neighbor", "friend"]
# number words for multiples and fractions, by factor
TIMES_WORDS = {2: "twice", 3: "three times", 4: "four times"}
TIMES_VERBS = {2: "doubles", 3: "triples", 4: "quadruples"}
TIMES_RESULTS = {2: "doubled", 3: "tripled", 4: "quadrupled"}
FRACTION_WORDS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}
FRACTION_OF_WORDS = {2: "half of", 3: "one third of", 4: "one quarter of", 5: "one fifth of"}

BASE_T = ["{S} has {d} {P}.", "{S} owns {d} {P}.", "{S} has a collection of {d} {P}.",
          "There are {d} {P} in {Npos} bag."]
PRODUCT_T = ["{S} has {a} {Cp} with {b} {P} in each {C}.", "{S} fills {a} {Cp} with {b} {P} each.",
             "{S} buys {a} {Cp} of {P}, and each {C} holds {b} {P}."]
REL_T = {
    "+": ["{S} has {d} more {P} than {B}.", "{S} owns {d} more {P} than {B} does.",
          "Compared with {B}, {S} has {d} more {P}."],
    "-": ["{S} has {d} fewer {P} than {B}.", "{S} owns {d} fewer {P} than {B} does.",
          "Compared with {B}, {S} has {d} fewer {P}."],
    "*": ["{S} has {mw} as many {P} as {B}.", "{S} owns {mw} as many {P} as {B} does.",
          "{S} has {mw} the number of {P} that {B} has."],
    "/": ["{S} has {fw} as many {P} as {B}.", "{S} owns {fw} as many {P} as {B} does.",
          "{S} has {fo} the number of {P} that {B} has."],
}
EVENT_T = {  # (template, name of the amount variable for + and -)
    "+": [("{S} buys {d} more {P}.", "bought"), ("{S} finds {d} more {P}.", "found"),
          ("{O} gives {o_} {d} more {P}.", "received"), ("Later, {s_} picks up {d} more {P}.", "picked"),
          ("Then {s_} wins {d} {P} at a fair.", "won")],
    "-": [("{S} gives {d} {P} to {O}.", "given"), ("{S} sells {d} of {pos} {P}.", "sold"),
          ("{S} loses {d} {P} on the way home.", "lost"), ("Then {s_} donates {d} {P} to the school.", "donated"),
          ("{O} borrows {d} {P} from {o_}.", "borrowed")],
    "*": [("{S} {mv} the number of {P} {pr} has.", ""), ("After a trade, {s_} has {mw} as many {P} as before.", ""),
          ("A week later, {s_} has {mw} as many {P} as {pr} did.", "")],
    "/": [("{S} splits {pos} {P} into {m} equal groups and keeps one group.", ""),
          ("{S} keeps {fo} {pos} {P} and gives the rest away.", ""),
          ("{S} shares {pos} {P} equally among {m} people, including {refl}, and keeps one share.", "")],
}
Q_FINAL_EV = ["How many {P} does {S} have now?", "How many {P} does {S} end up with?",
              "How many {P} does {S} have at the end?", "After all this, how many {P} does {S} have?"]
Q_FINAL = ["How many {P} does {S} have?", "How many {P} does {S} own?", "What is the number of {P} that {S} has?"]
Q_TOTAL = ["How many {P} do {names} have in total?", "How many {P} do {names} have altogether?",
           "How many {P} do they have combined?", "What is the total number of {P} that {names} have?"]
Q_DIFF = ["How many more {P} does {A} have than {B}?", "How many fewer {P} does {B} have than {A}?",
          "What is the difference between the number of {P} {A} has and the number {B} has?"]
Q_DIV = [("If {S} packs all of {pos} {P} equally into {m} {Cp}, how many {P} go in each {C}?", "each"),
         ("{S} shares all of {pos} {P} equally among {m} friends. How many {P} does each friend get?", "each"),
         ("{S} puts {pos} {P} into groups of {m}. How many groups does {pr} make?", "groups")]
Q_MUL = [("If {S} sells each {s} for {m} dollars, how many dollars does {pr} earn from all of them?", "earned"),
         ("Each {s} weighs {m} grams. How many grams do all of {Npos} {P} weigh?", "grams"),
         ("Each {s} costs {m} dollars. How many dollars are all of {Npos} {P} worth?", "worth")]
DISTRACT_T = ["{X} is {d} years old.", "{X} also has {d} {Q}.", "{X}'s {rel} has {d} {Q}.",
              "The {place} is {d} miles from {Npos} house.", "{X} spends {d} minutes at the {place}.",
              "There are {d} {Q} on the kitchen table."]

# The unseen family: the same facts, events and questions in other sentence structures (passive voice, the quantity
# or the other person first, statements turned into questions), never used for train/validation/test. Its words are
# mostly the seen family's (the byte-level BPE trained on the train split then splits them as it did in training, so
# the split tests wording, not spelling), and program variable names are the seen role names.
BASE_U = ["{X} keeps {d} {P} at home.", "{d} {P} are {Npos}.", "In {Npos} house, there are {d} {P}.",
          "{Npos} collection is {d} {P}."]
PRODUCT_U = ["Each of {Npos} {a} {Cp} holds {b} {P}.", "{b} {P} are in each {C}, and {X} has {a} {Cp}.",
             "{X} has {a} {Cp}, and there are {b} {P} in each one."]
REL_U = {
    "+": ["{B} has to get {d} more {P} to have as many as {X}.", "{X} has all the {P} {B} has, and {d} more.",
          "The number of {P} {X} has is {d} more than {B} has."],
    "-": ["{X} has to get {d} more {P} to have as many as {B}.", "{B} has all the {P} {X} has, and {d} more.",
          "The number of {P} {X} has is {d} fewer than {B} has."],
    "*": ["{X} has {d} {P} for each {s} {B} has.", "{B}'s {P} are only {fw} of {Npos}.",
          "The number of {P} {X} has is {d} times the number {B} has."],
    "/": ["{X} has one {s} for each {d} {P} {B} has.", "{Npos} {P} are only {fw} of {B}'s.",
          "{B} has {d} times the number of {P} {X} has."],
}
EVENT_U = {
    "+": [("{d} more {P} are bought by {o_}.", "bought"), ("{d} {P} are found by {o_}.", "found"),
          ("{d} {P} are given to {o_} by {O}.", "received"), ("Then {d} more {P} are picked up by {o_}.", "picked"),
          ("{d} {P} are won at a fair by {o_}.", "won")],
    "-": [("{d} {P} are given to {O} by {o_}.", "given"), ("{d} of {Npos} {P} are sold.", "sold"),
          ("On the way home, {s_} loses {d} {P}.", "lost"), ("{d} {P} are donated to the school by {o_}.", "donated"),
          ("{d} {P} are borrowed from {o_} by {O}.", "borrowed")],
    "*": [("Then the number of {P} {s_} has {mv}.", ""), ("{Npos} {P} are {mr} after a trade.", ""),
          ("{S} ends up with {d} times the {P} {pr} had.", "")],
    "/": [("{Npos} {P} are split into {m} equal groups, and {s_} keeps one group.", ""),
          ("{S} gives away all but {fw} of {pos} {P}.", ""),
          ("The {P} {s_} has are shared equally among {m} people, and {pr} keeps one share.", "")],
}
Q_FINAL_EV_U = ["At the end, what is the number of {P} {S} has?", "Now, how many {P} are {Npos}?",
                "{S} now has how many {P}?"]
Q_FINAL_U = ["How many {P} are {Npos}?", "{S} has how many {P}?", "What number of {P} does {S} own?"]
Q_TOTAL_U = ["If {names} put all of their {P} together, how many {P} are there?",
             "Altogether, {names} have how many {P}?", "In total, how many {P} are there among {names}?"]
Q_DIFF_U = ["{A} has how many more {P} than {B}?", "How many {P} does {B} have to get to have as many as {A}?",
            "How many more {P} are {A}'s than {B}'s?"]
Q_DIV_U = [("{Npos} {P} are put into {m} {Cp} equally. How many {P} are in each {C}?", "each"),
           ("If {m} friends share {Npos} {P} equally, how many {P} does each of them get?", "each"),
           ("How many groups of {m} {P} can {S} make?", "groups")]
Q_MUL_U = [("{S} sells all of {pos} {P} for {m} dollars each. How many dollars does {pr} earn?", "earned"),
           ("If one {s} weighs {m} grams, how many grams do {Npos} {P} weigh in total?", "grams"),
           ("{Npos} {P} cost {m} dollars each. How many dollars are they worth?", "worth")]
DISTRACT_U = ["The age of {X} is {d}.", "{X} lives {d} miles from the {place}.", "{d} {Q} are owned by {Npos} {rel}.",
              "{d} minutes are spent by {X} at the {place}.", "On the kitchen table, there are {d} {Q}.",
              "{d} {Q} are in {Npos} bag."]


@dataclass(frozen=True)
class Phrasing:
    """One family of sentence templates for every sentence form the generator writes."""

    base: list
    product: list
    rel: dict
    event: dict
    q_final_ev: list
    q_final: list
    q_total: list
    q_diff: list
    q_div: list
    q_mul: list
    distract: list


PHRASINGS: dict[str, Phrasing] = {
    "seen": Phrasing(BASE_T, PRODUCT_T, REL_T, EVENT_T, Q_FINAL_EV, Q_FINAL, Q_TOTAL, Q_DIFF, Q_DIV, Q_MUL, DISTRACT_T),
    "unseen": Phrasing(BASE_U, PRODUCT_U, REL_U, EVENT_U, Q_FINAL_EV_U, Q_FINAL_U, Q_TOTAL_U, Q_DIFF_U, Q_DIV_U,
                       Q_MUL_U, DISTRACT_U),
}
