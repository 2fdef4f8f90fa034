"""The built documentation holds what the user guide promises, generated from the code."""

import re

from bayesfuse import methods


def test_the_site_builds_with_an_index_and_api_pages(site):
    assert (site / "index.html").exists()
    for name in ("fuse", "match_neurons", "load", "FusionResult", "inference.matching"):
        assert (site / "_generated" / "api" / f"bayesfuse.{name}.html").exists(), name


def test_the_method_page_lists_every_method_of_the_table_with_its_keys(site):
    page = (site / "guide" / "methods.html").read_text(encoding="utf-8")
    for m in methods.METHODS.values():
        assert f'id="method-{m.name}"' in page, m.name
        for key in m.keys():
            assert f'<code class="docutils literal notranslate"><span class="pre">{key}</span></code>' in page, key


def test_the_notebooks_are_rendered_with_their_outputs(site):
    pages = sorted((site / "_generated" / "notebooks").glob("*.html"))
    assert len(pages) >= 4
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "cell_output" in text, f"{page.name} has no outputs"
    assert any("<img" in p.read_text(encoding="utf-8") for p in pages), "no notebook shows a figure"


def test_the_benchmarks_page_says_where_and_when_each_record_was_measured(site):
    text = (site / "_generated" / "benchmarks.html").read_text(encoding="utf-8")
    sections = re.findall(r"Measured on (\d{4}-\d\d-\d\d \d\d:\d\d UTC): ([^<]+?), (\d+) cores", text)
    assert len(sections) >= 5, text[:2000]


def test_the_exit_statuses_and_command_help_are_generated(site):
    text = (site / "guide" / "cli.html").read_text(encoding="utf-8")
    assert "exit status: 0 done" in text
    assert "usage: bayesfuse fuse" in text
