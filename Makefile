# Two commands from a fresh clone: `make fuzz` runs the default campaign, `make test` passes the test suite.
# Each creates .venv (the project, editable, with the extras below) when it is missing and reuses it otherwise;
# it is rebuilt when pyproject.toml or setup.py change. Every other command of the README runs in that .venv
# (`. .venv/bin/activate`); the tox environments are make targets too (`make lint`, ...).

PYTHON ?= python3
VENV ?= .venv
# the project's extras and dependency groups (PEP 735: the development tools) installed into .venv (CI adds ray)
EXTRAS ?= events,metrics,plot
GROUPS ?= test
# the torch of .venv: the CPU wheel of this machine's disk, installed first (pyproject.toml admits any torch >= 2.13;
# `make compat` checks an engine's 2.14.1). TORCH= (empty) keeps whatever the environment resolves.
TORCH ?= 2.13.0
# extra arguments: make fuzz ARGS="--minutes 5 --seed 7", make test ARGS="-k replay"
ARGS ?=
# the test suite's worker processes (pytest-xdist): one per core; TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= auto

PY := $(VENV)/bin/python
comma := ,
STAMP := $(VENV)/.radixspec-installed

.PHONY: venv fuzz test compat speed lint crosshair sanitize bench mutation mutation-full ray clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH)")
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" $(foreach group,$(subst $(comma), ,$(GROUPS)),--group $(group))
	touch $(STAMP)

# the differential campaign: spec, reference and optimized side by side, every machine, 1 minute on every core
fuzz: $(STAMP)
	$(VENV)/bin/radixspec fuzz $(ARGS)

# the test suite (about 14 minutes on 2 cores, a worker per core, an idle worker taking tests queued on the other;
# the CUDA tests skip without a GPU)
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# radixspec inside an engine's environment: a fresh virtualenv that holds SGLang 0.5.23's torch (2.14.1) first,
# then the wheel built from a clean copy of the checkout, installed (not editable), which must keep that torch
# (.ci/wheel-venv); then the whole suite runs against the installed package (pytest's append import mode:
# site-packages' radixspec comes before the checkout's; conftest.py refuses a run that imports the checkout's).
# CI runs the installed-behaviour part of it there, with campaigns of every target (.ci/installed)
COMPAT_VENV ?= /tmp/radixspec-compat
COMPAT_TORCH ?= 2.14.1
compat:
	.ci/wheel-venv $(COMPAT_VENV) $(COMPAT_TORCH) $(EXTRAS)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --group test
	RADIXSPEC_TEST_INSTALLED=1 $(COMPAT_VENV)/bin/pytest --import-mode=append $(ARGS)

# the fuzzer's own speed against a past tree, side by side in one run (tools/bench_compare.py): a batch of the manager
# machine (its shape fixed: 100 examples of 80 steps, tools/bench_batch.py) on both trees, three interleaved rounds;
# a median ratio below 0.8x of SPEED_REF fails. CI runs it; run it before pushing a change to a machine
# (ARGS="--machines ..." for others: docs/campaigns.md). SPEED_REF is the release the throughput is held to
# (79b4c1f, 2026-12-01); move it on deliberately, with the figures
SPEED_REF ?= 79b4c1f
speed: $(STAMP)
	$(PY) -m tools.bench_compare --against $(SPEED_REF) --machines manager --examples 100 --no-exhaustive \
		--rounds 3 --threshold 0.8 $(ARGS)

# the tox environments (tox.ini), run by the tox of .venv
lint crosshair sanitize bench mutation mutation-full ray: $(STAMP)
	$(PY) -m tox -e $@ $(if $(ARGS),-- $(ARGS),)

clean-venv:
	rm -rf $(VENV)
