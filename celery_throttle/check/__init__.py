"""This process's side of a check: the controller (the user and operator API), the checks of
one call, the operators' controls, leases, concurrency slots, lines, the hints a producer
sends on, the breaker after a store error, and the metrics."""
