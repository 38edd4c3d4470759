# The two commands a new user needs: `make run` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test bench clean browser

$(STAMP): setup.cfg pyproject.toml tests/entrypoint_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet -e tests/entrypoint_plugin  # a plugin found only through its entry point
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## the gateway: the demo without a config, or `make run ARGS="--config my.toml"`
	$(PY) -m kilnproxy $(ARGS)

test: $(STAMP) browser  ## the whole test suite
	$(PY) -m pytest $(PYTEST_ARGS)

browser:  ## Debian's chromium, for the inspector's browser test (Playwright drives it; it downloads no browser)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
		{ apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; }

bench: $(STAMP)  ## what the gateway adds over a bare pass-through (M1-M6, < 10 min): bench/results/<date>.md
	@command -v wrk >/dev/null && command -v nginx >/dev/null || { \
		command -v apt-get >/dev/null || { echo "make bench needs wrk and nginx"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx >/dev/null; }
	cd bench && ../$(PY) run.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
