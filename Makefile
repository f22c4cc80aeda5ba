# `make demo`, `make test` and `make test-full`. Each works on a fresh machine with only
# Python (>= 3.10) and a C++ compiler: it creates its virtualenv and installs what it needs.
#
#   make test                 # the quick tier, TensorFlow 2.21 in .venv (2 test processes; PYTEST_WORKERS=N
#                             # to change); at most 10 minutes on a 2-core box, or it fails (tests/_tiers.py)
#   make test-full            # every test and every parametrized case, fuzz and slow tests included (CI)
#                             # (TFMETAL_EXT_KERAS_HUB_SRC=<keras-hub checkout>: keras-hub's own tests too)
#   make test TF=2.19.1       # the same against TensorFlow 2.19.1 in .venv-tf2.19.1
#   make demo                 # examples/quickstart.py

PYTHON ?= python3
TF ?= 2.21.0
DEFAULT_TF := 2.21.0
ifeq ($(TF),$(DEFAULT_TF))
VENV ?= .venv
# keras-hub's tensorflow-text follows TensorFlow's minor: only beside the default TensorFlow.
EXTRAS ?= test,examples,gen,hub,export
else
VENV ?= .venv-tf$(TF)
EXTRAS ?= test,examples,gen,export
endif
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist), whole test files per process: the suite is mostly tracing and
# graph rewriting, one core each. PYTEST_WORKERS=0 runs everything in this one process.
PYTEST_WORKERS ?= 2
# Keep TensorFlow's C++ logging quiet in test and demo output.
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-full venv clean

$(VENV)/.installed-$(TF): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "tensorflow==$(TF)" -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed-$(TF)

test: venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --tier quick $(PYTEST_ARGS)

test-full: venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --tier full $(PYTEST_ARGS)

demo: venv
	$(PY) examples/quickstart.py

clean:
	rm -rf .venv .venv-tf* build *.egg-info
