"""Operations: ``celery -A proj throttle ...`` and how it shows what it found."""
