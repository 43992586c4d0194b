# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The install step is idempotent: it re-runs only when setup.py changes (stamp file in the venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mix_src-installed
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(STAMP): setup.py
	@test -x $(PY) || python3 -m venv $(VENV)
	@# a current pip: the resolver of the pip that ships with python3.11's venv backtracks for minutes here
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=25"
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

demo: install
	bash recipes/cpu_tiny/run.sh

bench: install
	$(PY) -m mix_src.bench all

clean:
	rm -rf $(VENV) build *.egg-info outputs
