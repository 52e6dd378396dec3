import random

from dlm.data.tinymath import corrupt_program, generate_splits
from dlm.evaluation.tasks import grade_programs, trivial_baseline


def test_reference_programs_grade_correct_and_corrupted_ones_wrong():
    records = generate_splits(20, 2, 2, "hard", seed=4)["train"]
    answers = [r["answer"] for r in records]
    assert all(grade_programs([r["response"] for r in records], answers))
    rng = random.Random(0)
    assert not any(grade_programs([corrupt_program(rng, r) for r in records], answers))
    # a hostile generation is just a wrong answer, not a crash of the grader
    assert grade_programs(["import os\ndef solution():\n    os.system('true')\n    return 1", "def solution(:"],
                          [1, 1]) == [False, False]


def test_trivial_baseline_is_most_common_answer_share():
    assert trivial_baseline([{"answer": 3}, {"answer": 3}, {"answer": 5}, {"answer": 7}]) == 0.5
