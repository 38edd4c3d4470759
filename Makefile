# The two commands a new user needs: `make run` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test clean

$(STAMP): setup.cfg pyproject.toml tests/entrypoint_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet -e tests/entrypoint_plugin  # a plugin found only through its entry point
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## the gateway: the demo without a config, or `make run ARGS="--config my.toml"`
	$(PY) -m kilnproxy $(ARGS)

test: $(STAMP)  ## the whole test suite
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
