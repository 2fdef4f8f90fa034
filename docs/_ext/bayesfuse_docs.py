"""The documentation's generated pages, written when a build starts (``builder-inited``).

* ``_generated/methods.md``: the method table of :mod:`bayesfuse.methods` (each method, what it
  takes, its hyper-parameters with their defaults, constraints and meaning), so the guide's page
  on choosing a method is never a copy that drifts from the code;
* ``_generated/cli.md``: ``bayesfuse --help`` and each subcommand's help, and the exit statuses;
* ``_generated/benchmarks.md``: one section per benchmark record in ``benchmark-results/``
  (``benchmarks/run_all.py`` writes them; ``make docs-bench`` copies the latest ``make bench``
  run there): its options, tables, figures, machine and date;
* ``_generated/notebooks/``: copies of ``notebooks/*.ipynb``, which myst-nb executes.

A file is rewritten only when its text changes, so an unchanged page is not rebuilt.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
OUT = DOCS / "_generated"
BENCH = DOCS / "benchmark-results"


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else text
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def methods_page() -> str:
    from bayesfuse import methods

    lines = ["| method | fuses | what it does |", "| --- | --- | --- |"]
    for m in methods.METHODS.values():
        data = " Needs the clients' data (retrains them)." if m.needs_data else ""
        lines.append(f"| [`{m.name}`](#method-{m.name}) | {' and '.join(m.kinds)} | {_cell(m.summary)}.{data} |")
    for m in methods.METHODS.values():
        lines += ["", f"(method-{m.name})=", f"### `{m.name}`", "", _cell(m.summary) + ".", ""]
        if m.variants:
            lines += ["Variants: " + ", ".join(f"`{m.name}:{v}`" for v in m.variants) + ".", ""]
        keys = [k for k in m.keys() if not isinstance(m.constraint(k), methods.Fixed)]
        if not keys:
            lines.append("No hyper-parameters.")
            continue
        lines += [
            "| key | " + " | ".join(f"default ({k})" for k in m.kinds) + " | allowed | meaning |",
            "| --- | " + " | ".join("---" for _ in m.kinds) + " | --- | --- |",
        ]
        for key in keys:
            defaults = " | ".join(f"`{m.defaults[k][key]!r}`" if key in m.defaults[k] else "" for k in m.kinds)
            lines.append(f"| `{key}` | {defaults} | {_cell(m.constraint(key))} | {_cell(methods.PARAMS[key].help)} |")
    return "\n".join(lines) + "\n"


def cli_page() -> str:
    from bayesfuse import cli

    lines = []
    for command in ([], ["fuse"], ["summarize"], ["methods"], ["demo"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
            cli.main([*command, "--help"])
        title = " ".join(["bayesfuse", *command])
        lines += [f"### `{title}`", "", "```text", buffer.getvalue().rstrip(), "```", ""]
    lines += ["(exit-statuses)=", "### Exit statuses", "", "```text", cli.EXIT_STATUS, "```", ""]
    return "\n".join(lines)


def benchmarks_page() -> str:
    records = sorted(BENCH.glob("bench_*.json"))
    if not records:
        return (
            "# Benchmarks\n\nNo benchmark records: run `make bench`, then `make docs-bench` to copy its records "
            "into `docs/benchmark-results/`.\n"
        )
    lines = [
        "# Benchmarks",
        "",
        "Each section is one benchmark's smoke run (`make bench`: the embedded digits, one seed, few "
        "epochs), as `benchmarks/run_all.py` recorded it: the tables it printed, its figures, and the "
        "machine and date of the run. `make bench-full` runs them at their defaults; "
        "`benchmarks/README.md` discusses the results.",
        "",
    ]
    for path in records:
        r = json.loads(path.read_text(encoding="utf-8"))
        m = r["machine"]
        name = Path(r["benchmark"]).stem
        lines += [
            f"## `{name}`",
            "",
            f"Measured on {m['date']}: {m['cpu']}, {m['cores']} cores, {m['os']}, Python {m['python']}, "
            f"torch {m['torch']}; {r['seconds']:.0f} s. Command: "
            f"`{' '.join(['python', 'benchmarks/' + r['benchmark'], *r['options']])}`.",
            "",
        ]
        if r["returncode"] != 0:
            lines += [f"The run failed (exit status {r['returncode']}).", ""]
        lines += ["```text", r["output"].rstrip() or "(no output)", "```", ""]
        for figure in r.get("figures", []):
            source = BENCH / figure
            if source.exists():
                _write(OUT / "benchmarks" / figure, source.read_bytes())
                lines += [
                    f"```{{figure}} benchmarks/{figure}",
                    f":alt: {figure}",
                    "",
                    f"`{figure}`, from `{name}`; measured on {m['date']} ({m['cpu']}, {m['cores']} cores).",
                    "```",
                    "",
                ]
    return "\n".join(lines)


def copy_notebooks() -> None:
    sources = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for nb in sources:
        _write(OUT / "notebooks" / nb.name, nb.read_bytes())
    for name in {p.name for p in (OUT / "notebooks").glob("*.ipynb")} - {p.name for p in sources}:
        (OUT / "notebooks" / name).unlink()


def generate(app=None) -> None:
    _write(OUT / "methods.md", methods_page())
    _write(OUT / "cli.md", cli_page())
    _write(OUT / "benchmarks.md", benchmarks_page())
    copy_notebooks()


def _is_header(lines: list[str], i: int) -> bool:
    return (
        i + 1 < len(lines)
        and lines[i].strip() != ""
        and set(lines[i + 1].strip()) == {"-"}
        and len(lines[i + 1].strip()) >= len(lines[i].strip()) - 1
    )


def choosing_sections(app, what, name, obj, options, lines: list[str]) -> None:
    """Keep a docstring's prose sections that numpydoc does not know ("Choosing sigma, sigma0,
    gamma0", as POT's "Choosing a solver"): moved to the end of its Notes, under a rubric.

    numpydoc drops a section it does not know, with a warning; this runs before it."""
    extra: list[str] = []
    i = 0
    while i < len(lines):
        if _is_header(lines, i) and lines[i].strip().startswith("Choosing"):
            end = next((k for k in range(i + 2, len(lines)) if _is_header(lines, k)), len(lines))
            extra += ["", f".. rubric:: {lines[i].strip()}", "", *lines[i + 2 : end]]
            del lines[i:end]
        else:
            i += 1
    if not extra:
        return
    notes = next((k for k in range(len(lines)) if _is_header(lines, k) and lines[k].strip() == "Notes"), None)
    if notes is None:
        at = next(
            (k for k in range(len(lines)) if _is_header(lines, k) and lines[k].strip() in ("References", "Examples")),
            len(lines),
        )
        lines[at:at] = ["Notes", "-----", *extra, ""]
    else:
        at = next((k for k in range(notes + 2, len(lines)) if _is_header(lines, k)), len(lines))
        lines[at:at] = [*extra, ""]


def setup(app):
    app.connect("builder-inited", generate)
    app.connect("autodoc-process-docstring", choosing_sections, priority=400)
    return {"version": "1", "parallel_read_safe": True}
