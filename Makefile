# Two entry points (README): `make demo` runs the main job, `make test` runs the test suite (`make test-quick`: all but
# the tests marked slow, for iteration).
# Each creates .venv with Python 3.12 when it is missing and installs what it needs, pinned by constraints.txt.
PY312 := $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)/versions/3.12"*/bin/python3.12; do \
            "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-quick clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (python3.12 or pyenv 3.12.x)"; exit 1; }
	test -x $(PY) || $(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m jlora demo

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadgroup -q --durations=15

test-quick: $(VENV)/.installed  # for iteration: the suite less the tests marked slow (CI runs them all)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

clean:
	rm -rf $(VENV)
