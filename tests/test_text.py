"""One-line plain messages and the closest known name (bayesfuse._text)."""

from bayesfuse._text import did_you_mean, plain_line


def test_plain_line_drops_terminal_escape_codes_and_joins_lines():
    coloured = "Weights only load failed. \x1b[1mdo those steps only if you trust it\x1b[0m.\n  More\tdetail\x07"
    assert plain_line(coloured) == "Weights only load failed. do those steps only if you trust it. More detail"
    titled = plain_line("\x1b[31;1mred\x1b[m \x1b]0;title\x07x")  # colours gone; a title's text stays, inert
    assert titled.startswith("red ") and not any(c in titled for c in "\x1b\x07")
    assert "\x1b" not in plain_line("\x1b(B\x1b[2Ktext") and plain_line("\x1b[2Ktext") == "text"
    assert plain_line("") == ""


def test_did_you_mean_names_the_closest_choice_or_nothing():
    assert did_you_mean("noise_vr", ["noise_var", "prior_var", "gamma0"]) == " (did you mean 'noise_var'?)"
    assert did_you_mean("class_count", ["noise_var", "class_counts"]) == " (did you mean 'class_counts'?)"
    assert did_you_mean("pfmn", ("pfnm", "nafi", "fedma")) == " (did you mean 'pfnm'?)"
    assert did_you_mean("hungarian", ["pfnm", "nafi"]) == ""
    assert did_you_mean("x", []) == ""
