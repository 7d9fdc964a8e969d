"""The pure core: what a throttle declares and the values it is made of, with no Redis and no
Celery worker. Rates, the settings, key names, the timing policy, the header a task carries
and the protocol with the store's scripts, the errors."""
