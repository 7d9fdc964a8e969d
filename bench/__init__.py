"""The celery_throttle benchmark: ``python -m bench`` (bench/__main__.py; CONTRIBUTING.md, "Benchmarks")."""
