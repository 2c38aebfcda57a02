"""Hard-sample mining: drop the problems solved k/k, keep the counts (lineage)."""

import polars as pl
import pytest

from rstar2.run.mining import candidates, hard_set


def _problems(n):
    return pl.DataFrame({"problem_id": [f"p{i}" for i in range(n)], "prompt": ["q"] * n, "answer": ["1"] * n,
                         "source": ["t"] * n})


def test_problems_solved_in_every_sample_are_dropped():
    scored = pl.DataFrame({"problem_id": ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3,
                           "reward": [1.0, 1, 1, 1, 0, 1, 0, 0, 0]})
    hard, counts = hard_set(_problems(3), scored, k=3)
    assert hard["problem_id"].to_list() == ["p1", "p2"] and hard["mined_solved"].to_list() == [2, 0]
    assert counts == {"problems_before": 3, "problems_after": 2, "solved_all": 1, "solved_none": 1, "k": 3}


def test_a_wrong_number_of_samples_is_an_error():
    scored = pl.DataFrame({"problem_id": ["p0", "p0", "p1"], "reward": [1.0, 1.0, 0.0]})
    with pytest.raises(ValueError, match="expects 2 rollouts per problem"):
        hard_set(_problems(2), scored, k=2)


def test_the_candidate_subset_is_seeded(tmp_path):
    uri = tmp_path / "train.parquet"
    _problems(50).write_parquet(uri)
    a, b = candidates(str(uri), 10, seed=3), candidates(str(uri), 10, seed=3)
    assert a["problem_id"].to_list() == b["problem_id"].to_list() and a.height == 10
    assert candidates(str(uri), None, seed=3).height == 50
