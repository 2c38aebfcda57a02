import pytest

from rstar2.world import problems


def test_deterministic_disjoint_and_correct():
    sizes = {"sft": 300, "train": 120, "val": 30, "test": 60}
    a, b = problems.generate(7, sizes), problems.generate(7, sizes)
    for split in problems.SPLITS:
        assert a[split].equals(b[split]) and a[split].height == sizes[split]
    prompts = [set(a[s]["prompt"]) for s in problems.SPLITS]
    assert all(not (p & q) for i, p in enumerate(prompts) for q in prompts[i + 1:])
    # the held-out split is drawn first, so resizing the others never moves it
    assert problems.generate(7, {"sft": 10, "train": 5, "test": 60})["test"].equals(a["test"])
    assert a["test"].height == 60 and set(a["test"]["source"]) == set(problems.KINDS)
    for row in a["test"].iter_rows(named=True):  # the reference code's output is the label
        assert problems.solve(row["solution_code"]) == row["answer"]
        assert row["answer"].lstrip("-").isdigit()


def test_hand_worked_kinds():
    assert problems.solve("print(123 * 45)") == "5535"
    assert problems.solve("print(pow(3, 13, 7))") == "3"  # 3^6 = 1 mod 7, so 3^13 = 3
    assert problems.solve("print(sum(i ** 2 for i in range(1, 3 + 1)))") == "14"
    assert problems.solve("n = 12\nprint(sum(1 for d in range(1, n + 1) if n % d == 0))") == "6"
    assert problems.solve("import math\nprint(math.comb(5, 2))") == "10"


def test_different_seed_differs_and_unknown_kind_rejected():
    a = problems.generate(1, {"test": 30})["test"]
    b = problems.generate(2, {"test": 30})["test"]
    assert not a.equals(b)
    with pytest.raises(ValueError, match="unknown problem kinds"):
        problems.generate(0, {"test": 3}, ["mul", "calculus"])

