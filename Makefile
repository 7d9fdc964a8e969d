# Two commands do all set-up: `make demo` runs the demo, `make test` runs the tests.
PYTHON ?= python3

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -q -e '.[test,demo]'

demo: install
	$(PYTHON) -m examples.demo

test: install
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m bench
