"""The store: the Redis client and its scripts (``lua/``, beside the modules that call them),
the dead letters, and what the store risks (``doctor``). Nothing here knows Celery."""
