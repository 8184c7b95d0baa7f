# Two commands from a fresh clone: `make fuzz` runs the default campaign, `make test` passes the test suite.
# Each creates .venv (the project, editable, with the extras below) when it is missing and reuses it otherwise;
# it is rebuilt when pyproject.toml or setup.py change. Every other command of the README runs in that .venv
# (`. .venv/bin/activate`); the tox environments are make targets too (`make lint`, ...).

PYTHON ?= python3
VENV ?= .venv
# the project's extras installed into .venv (CI adds ray)
EXTRAS ?= test,events,metrics,plot
# extra arguments: make fuzz ARGS="--minutes 5 --seed 7", make test ARGS="-k replay"
ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.radixspec-installed

.PHONY: venv fuzz test lint crosshair sanitize bench mutation mutation-full ray clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# the differential campaign: spec, reference and optimized side by side, every machine, 1 minute on every core
fuzz: $(STAMP)
	$(VENV)/bin/radixspec fuzz $(ARGS)

# the test suite (about 2 minutes on 2 cores; the CUDA tests skip without a GPU)
test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# the tox environments (tox.ini), run by the tox of .venv
lint crosshair sanitize bench mutation mutation-full ray: $(STAMP)
	$(PY) -m tox -e $@ $(if $(ARGS),-- $(ARGS),)

clean-venv:
	rm -rf $(VENV)
