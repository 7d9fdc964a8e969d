# Two commands do all set-up: `make demo` runs the demo, `make test` runs the tests.
PYTHON ?= python3

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -q -e '.[test,demo]'

demo: install
	$(PYTHON) -m examples.demo

# The suite, then the 20 000-task soak as a second pass (kept apart: it takes minutes).
test: install
	$(PYTHON) -m pytest
	$(PYTHON) -m pytest -m soak

bench: install
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m bench
