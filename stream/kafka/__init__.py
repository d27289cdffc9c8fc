"""stream/kafka: the plumbing every Kafka process shares (stream's and the trainer's): the [kafka]
settings, topic creation, transient errors retried, librdkafka's log lines, Prometheus endpoints,
worker processes, the murmur2 partitioner, and the dead-letter topic read back."""
