"""Long waits: a task put in its key's line (``deferral``), the releaser thread that sends the
heads of lines on, tasks earlier versions parked, and where one task waits (``why``)."""
