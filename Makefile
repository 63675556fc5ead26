# Quick start (README): `make demo` sets everything up and trains the CPU demo on AN4, then prints the test WER;
# `make test` sets everything up and runs the test suite. Both create .venv on first use.
VENV := .venv
PYTHON := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PYTHON) -m trainer experiment=cpu_demo

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q

.PHONY: demo test
