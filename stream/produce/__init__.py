"""stream/produce: what puts events on Kafka: replay of raw logs (logs.py read them) or of the
synthetic generator, and labelled rows split into impressions + delayed clicks (clicks.py)."""
