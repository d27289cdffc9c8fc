"""Create adstream's topics (idempotent) with the partition count and message limit of the settings."""

from __future__ import annotations

from stream.errors import StreamError
from stream.kafka.settings import KafkaSettings


def ensure_topics(kafka: KafkaSettings, timeout_s: float = 30.0) -> list[str]:
    """Create the events, batches, DLQ, impressions and clicks topics if absent (impressions and clicks
    with one partition count: the joiner needs them co-partitioned); returns the names created."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        raise StreamError(f"kafka at {kafka.bootstrap}: unreachable ({exc}); start it with `adstream up`") from None
    config = topic_config(kafka)
    wanted = [kafka.events_topic, kafka.batches_topic, kafka.dlq_topic, kafka.impressions_topic, kafka.clicks_topic]
    new = [
        NewTopic(t, num_partitions=kafka.partitions, replication_factor=kafka.replication_factor, config=config)
        for t in wanted
        if t not in existing
    ]
    if not new:
        return []
    for topic, future in admin.create_topics(new, operation_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise StreamError(f"kafka: cannot create topic {topic}: {exc}") from None
    return [t.topic for t in new]


def partition_count(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> int:
    """How many partitions `topic` has on the broker (it may have been made with another count than
    kafka.partitions)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        metadata = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(topic, timeout=timeout_s)
    except KafkaException as exc:
        raise StreamError(f"kafka at {kafka.bootstrap}: unreachable ({exc}); start it with `adstream up`") from None
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise StreamError(f"kafka at {kafka.bootstrap}: topic {topic} not found ({found and found.error})")
    return len(found.partitions)


def topic_config(kafka: KafkaSettings) -> dict[str, str]:
    """The settings of a topic adstream creates: the message limit and the replicas a write waits for."""
    return {"max.message.bytes": str(kafka.max_message_bytes), "min.insync.replicas": str(kafka.min_insync_replicas)}
