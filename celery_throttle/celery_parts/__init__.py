"""The parts of Celery the plugin leans on below the check: its private parts
(``internals``, the only module that touches them) and a task's message as the store keeps
it (``messages``)."""
