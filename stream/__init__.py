"""stream: events -> feature rows -> Arrow batches. Never imports torch."""
