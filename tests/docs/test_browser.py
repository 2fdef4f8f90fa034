"""The built site in a real headless browser: Playwright (PyPI) driving Debian's chromium.

Playwright's own browser download needs the internet; ``make browser`` installs Debian's
``chromium`` instead (as root; ``make data`` installs Fashion-MNIST the same way). Without a
browser the test skips and says how to get one. Screenshots of the index and of an API page
are kept in ``docs/_build/screenshots/``.
"""

import functools
import http.server
import os
import shutil
import threading

import pytest

CHROMIUM = os.environ.get("BAYESFUSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright: pip install -e '.[docs]'")
    if CHROMIUM is None:
        pytest.skip(
            "no chromium on PATH: `make browser` installs Debian's (as root), "
            "or set BAYESFUSE_CHROMIUM to a Chromium executable"
        )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(site):
    """The site over HTTP on a free local port, as a reader's browser would fetch it."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.errors = []
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("requestfailed", lambda req: page.errors.append(f"failed to load {req.url}"))
    yield page
    page.close()


def shot(page, site, name):
    folder = site.parent / "screenshots"
    folder.mkdir(exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=False)


def test_the_index_loads_without_console_errors(page, served, site):
    page.goto(f"{served}/index.html", wait_until="networkidle")
    assert "bayesfuse" in page.title()
    assert page.locator("nav").count() > 0
    shot(page, site, "index.png")
    assert page.errors == []


def test_an_api_page_loads_without_console_errors_and_renders_its_equations(page, served, site):
    page.goto(f"{served}/_generated/api/bayesfuse.inference.matching.html", wait_until="networkidle")
    page.wait_for_selector("mjx-container", timeout=30_000)  # MathJax, served from the site itself
    rendered = page.locator("mjx-container").first
    assert rendered.bounding_box()["height"] > 10
    assert "\\lambda_i" not in rendered.inner_text()  # typeset, not the TeX source
    shot(page, site, "api-matching.png")
    page.goto(f"{served}/_generated/api/bayesfuse.match_neurons.html", wait_until="networkidle")
    assert page.locator("h1").first.inner_text().startswith("bayesfuse.match_neurons")
    shot(page, site, "api-match_neurons.png")
    assert page.errors == []


def test_the_search_finds_match_neurons(page, served, site):
    page.goto(f"{served}/search.html?q=match_neurons", wait_until="networkidle")
    page.wait_for_selector("#search-results li a", timeout=30_000)
    links = page.locator("#search-results li a").all_inner_texts()
    assert any("match_neurons" in text for text in links), links
    shot(page, site, "search.png")
    assert page.errors == []
