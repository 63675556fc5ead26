# Quick start (README): `make demo` sets everything up and trains the CPU demo on AN4, then prints the test WER
# (greedy, then with a beam search and a word language model);
# `make test` sets everything up and runs the test suite, listing its 15 slowest tests (CI's 90 minutes are the
# limit to watch). Both create .venv on first use.
VENV := .venv
PYTHON := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# The demo's run directory, named once per `make demo`; after training, the best checkpoint is decoded again with
# a beam search and a word trigram model of the training transcripts.
DEMO_RUN := demo-$(shell date +%Y%m%d-%H%M%S)

demo: $(VENV)/.installed
	$(PYTHON) -m trainer experiment=cpu_demo run_name=$(DEMO_RUN)
	$(PYTHON) -m trainer.lm --manifest manifests/an4_train.jsonl --order 3 --out runs/$(DEMO_RUN)/an4_3gram.arpa
	$(PYTHON) -m trainer.evaluate --checkpoint runs/$(DEMO_RUN)/checkpoints/best.pt --beam 16 \
		--lm runs/$(DEMO_RUN)/an4_3gram.arpa

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q --durations=15

.PHONY: demo test
