# Each target sets up its own virtual environment, so every one works on a fresh clone.
PY ?= python3
# `make train` and `make plot`: the package with its [train] extra (no torch, no libtpu).
VENV := .venv
TRAIN_STAMP := $(VENV)/.installed-train
# `make test`: a venv of its own, because the [test] extra brings libtpu (jax[tpu], for the
# AOT tests), which makes every `import jax` of a CPU machine print TPU probe errors.
TEST_VENV := .venv-test
TEST_STAMP := $(TEST_VENV)/.installed-test
# The run `make plot` draws (RUN=<workdir> for another one).
RUN ?= runs/tiny
# The exact versions the suite passes with: every install below is constrained to them.
CONSTRAINTS := constraints.txt

# setuptools announces every editable install with a warning ("Editable installation ...
# folders in your working directory with the same name as your package ..."), which pip
# prints even under -q: advice on the flat layout, not a fault. Only that message is dropped.
$(TRAIN_STAMP) $(TEST_STAMP) install-tpu: export PYTHONWARNINGS = ignore:Editable installation

$(TRAIN_STAMP): setup.py $(CONSTRAINTS)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[train]'
	touch $(TRAIN_STAMP)

# CI (.ci/run runs `make test`): the constrained install must resolve and be consistent;
# tests/pins_test.py then checks the venv against the pins.
$(TEST_STAMP): setup.py $(CONSTRAINTS)
	test -d $(TEST_VENV) || $(PY) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[test]'
	$(TEST_VENV)/bin/pip check
	touch $(TEST_STAMP)

# Two pytest workers (pytest-xdist), one test file each: XLA compiles on one thread, so a
# second worker fills the idle core (default suite 11m47s -> 8m56s on a 2-core CPU). Files go
# out in tests/conftest.py's order (longest first), not xdist's by number of tests.
TEST_WORKERS ?= 2
PYTEST := $(TEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install install-tpu install-test train plot test test-all
install: $(TRAIN_STAMP)

# TPU VMs: the package and libtpu in .venv.
install-tpu: $(TRAIN_STAMP)
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[train,tpu]'

install-test: $(TEST_STAMP)

train: $(TRAIN_STAMP)
	$(VENV)/bin/python experiments/train.py $(ARGS)

plot: $(TRAIN_STAMP)
	$(VENV)/bin/python experiments/plot_run.py $(RUN) $(ARGS)

test: $(TEST_STAMP)
	$(PYTEST) tests $(ARGS)

test-all: $(TEST_STAMP)
	$(PYTEST) -m "" tests $(ARGS)
