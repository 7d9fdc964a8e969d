"""The Celery integration: the worker's wiring, the decorator, the pool's hook before a task's
trace, the consumer's screen, admission at publish, and costs settled after the call."""
