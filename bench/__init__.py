"""Benchmarks for celery_throttle: run with ``python -m bench`` (see bench/__main__.py).

Never run by the test suite. Starts its own Celery workers against the local Redis
(databases 10 and 11, which it owns and empties), and writes bench/out/.
"""
