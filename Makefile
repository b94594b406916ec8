# Each target sets up its own virtual environment, so both work on a fresh clone.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install train test test-all
install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python experiments/train.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests $(ARGS)

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "" tests $(ARGS)
