"""The demo's table prints counts as integers."""

from bayesfuse.demo import COLUMNS, format_table


def test_counts_print_as_integers_and_scores_with_four_decimals():
    row = {"method": "pfnm", "accuracy": 0.9, "nll": 0.35, "ece": 0.07, "hidden": 264.0, "rounds": 0.0, "seconds": 2.5}
    table = format_table([row], [c for c in COLUMNS if c in row])
    cells = table.splitlines()[2].split()
    assert cells == ["pfnm", "0.9000", "0.3500", "0.0700", "264", "0", "2.5000"]


def test_a_mean_that_is_not_whole_keeps_its_decimals():
    row = {"method": "pfnm", "hidden": 263.5}
    assert format_table([row], ["method", "hidden"]).splitlines()[2].split() == ["pfnm", "263.5000"]
