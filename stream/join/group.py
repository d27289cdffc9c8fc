"""Joiners on several machines (`stream.join.assignment = "group"`): Kafka's consumer group says who
reads which input partitions and moves them when a joiner dies or stalls; a partition's state
follows it through a changelog topic.

    joiner A (partitions 0, 2) --+                      +--> adstream.events
                                 +-- one consumer group +
    joiner B (partitions 1, 3) --+   (range assignor:   +--> <stream.join.app_id>.state (changelog,
                                     impressions p and        compacted, partition p = input p)
                                     clicks p together)

Exactly once across moves, the design (KIP-447's):
- A chunk's outputs, its state changes (as changelog records, stream/join/state.py) and its input
  offsets go out in one transaction; the offsets are sent with the consumer's group metadata, so a
  joiner whose partitions the group gave away (a zombie: paused past its session timeout, or cut off
  from the coordinator) cannot commit: its transaction fails, is aborted, and nothing it wrote is
  seen by a read-committed reader. It drops its partitions and rejoins (`Fenced`).
- The offsets carry the chunk's token as metadata. A joiner given partition p compares the token
  committed for p with its own database's (`open_state`): the same, the database is current; the
  database's previous token, it holds the one chunk whose transaction did not commit (sent again,
  as after a crash); anything else (another joiner moved p on, or this machine never held it), the
  database is rebuilt from the changelog (`restore`): read (committed only) until the progress
  record carrying that token is in, then to the last stable offset. The changelog records and the
  offsets were one transaction, but they do not become visible at once: the broker answers the
  commit once it is decided and writes its markers to each partition afterwards, so the offsets
  (and their token) can be readable while the changelog's last stable offset still stands before
  that transaction. Reading only to there rebuilt the state without that chunk, and the new owner
  read its clicks again (a CI run of the cluster: a partition's first chunk looked like an empty
  changelog, the partition was started again from the beginning and 66 positives were emitted
  twice). The token says exactly which state the offsets belong to; the offsets themselves are read
  only once stable (KIP-447: none of their transaction still pending).
- A joiner's transactional id is `<app_id>-<member>` (`stream.join.member`, the host's name by
  default): a restarted joiner fences its predecessor's open transaction at once; a dead joiner's
  is aborted by the broker after `transaction.timeout.ms`, and until then the changelog's last
  stable offset waits for it, so the new owner's restore does too (a recovery time of at most that).

A partition given back to a joiner that had paused it (impressions running ahead of the clicks,
stream/join/partitions.py) is resumed as it is assigned: librdkafka keeps a pause through a
rebalance, and the partition's fresh in-memory state says it is not paused (a CI run of the cluster
lost two partitions' negatives so: their watermark never moved again).

Not covered across joiners: a record that arrived on another partition than its id's is moved by
the joiner holding that one (stream/join/reroute.py); when its own partition is held by another
joiner, that joiner's watermark does not wait for it, so if the mover falls behind (dead, stalled)
by more than the lateness allowance the record arrives late there. Produce by murmur2 (logged once).
"""

from __future__ import annotations

import logging
import shutil
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

from stream.errors import StreamError
from stream.join.state import PROGRESS, PartitionState, decode_progress
from stream.kafka.retry import retrying
from stream.kafka.settings import KafkaSettings
from stream.kafka.topics import topic_config
from stream.settings import JoinSettings

log = logging.getLogger("adstream.join")
# the group no longer knows this joiner as the owner of what it commits: its transaction is refused
GROUP_FENCING = frozenset({"ILLEGAL_GENERATION", "UNKNOWN_MEMBER_ID", "FENCED_INSTANCE_ID", "REBALANCE_IN_PROGRESS"})
# the transaction coordinator aborted this producer's transaction (it ran past its timeout) and
# bumped its epoch: the producer cannot go on (librdkafka's fatal _FENCED)
PRODUCER_FENCING = frozenset({"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"})


class Fenced(StreamError):
    """This joiner's chunk was refused: its partitions belong to another joiner now."""


def changelog_topic(join: JoinSettings) -> str:
    """The joiner group's state changelog: `<stream.join.app_id>.state`."""
    return f"{join.app_id}.state"


def member_name(join: JoinSettings, worker: int, workers: int) -> str:
    """This joiner's name in the group (its transactional id's suffix)."""
    name = join.member or socket.gethostname()
    return f"{name}-{worker}" if workers > 1 else name


def ensure_changelog(kafka: KafkaSettings, join: JoinSettings, partitions: int, timeout_s: float = 30.0) -> None:
    """Create the changelog topic (compacted, one partition per input partition) if absent."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    topic = changelog_topic(join)
    metadata = admin.list_topics(timeout=timeout_s).topics
    if topic in metadata:
        have = len(metadata[topic].partitions)
        if have != partitions:
            raise StreamError(
                f"join: changelog {topic} has {have} partitions, the inputs {partitions}; they must match: "
                f"delete {topic} (the state is rebuilt only from it: stop every joiner first) or use another "
                "stream.join.app_id"
            )
        return
    config = {"cleanup.policy": "compact", **topic_config(kafka)}
    new = NewTopic(topic, num_partitions=partitions, replication_factor=kafka.replication_factor, config=config)
    try:
        admin.create_topics([new], operation_timeout=timeout_s)[topic].result()
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" not in str(exc):
            raise StreamError(f"join: cannot create the changelog {topic}: {exc}") from None


def committed_tokens(
    consumer: Any, topics: tuple[str, str], partitions: list[int], timeout_s: float = 60.0
) -> dict[int, str]:
    """The token committed with each partition's offsets ("" where nothing was committed), asked
    again while the broker is away or a partition's offsets are part of a transaction not yet
    complete (UNSTABLE_OFFSET_COMMIT, once librdkafka's own retries are spent)."""
    from confluent_kafka import KafkaException, TopicPartition

    asked = [TopicPartition(t, p) for p in partitions for t in topics]

    def ask() -> list[Any]:
        answer = consumer.committed(asked, timeout=10)
        failed = next((tp.error for tp in answer if tp.error is not None), None)
        if failed is not None:
            raise KafkaException(failed)
        return answer

    tokens = dict.fromkeys(partitions, "")
    for tp in retrying(ask, "reading the group's committed offsets", log, give_up_s=timeout_s):
        if tp.offset >= 0 and tp.metadata:
            tokens[tp.partition] = tp.metadata
    return tokens


def open_state(path: Path, token: str, changelog: tuple[str, int], kafka: KafkaSettings) -> tuple[PartitionState, bool]:
    """Partition p's state as the group committed it: (the state, whether its last chunk must be
    sent again). The local database is kept when its token is the committed one, or its previous
    token is (the chunk ahead, sent again); otherwise it is rebuilt from the changelog."""
    if path.exists():
        state = PartitionState(path, changelog)
        progress = state.progress
        if progress.token == token:
            return state, False
        if progress.previous == token:
            log.warning("join: partition %d: its last chunk did not commit; sending it again", changelog[1])
            return state, True
        state.close()
    return restore(path, changelog, kafka, token), False


def restore(
    path: Path, changelog: tuple[str, int], kafka: KafkaSettings, token: str = "", timeout_s: float = 600.0
) -> PartitionState:
    """Rebuild a partition's database from its changelog partition, read (committed only) from the
    start until the progress record of the chunk whose `token` the group committed is in ("": none
    committed) and on to the last stable offset: the state the group's committed offsets belong to
    (a transaction's markers reach the changelog after the offsets may already be read: wait for them)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    topic, partition = changelog
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    state = PartitionState(path, changelog)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"{topic}-restore",  # never committed: it reads by assignment
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "max.partition.fetch.bytes": kafka.max_message_bytes,
            "fetch.max.bytes": max(kafka.max_message_bytes, 50 << 20),
        }
    )
    records = 0
    found = not token  # the progress record of the committed chunk read
    try:
        tp = TopicPartition(topic, partition)
        # an empty changelog (no token committed) is read no further: its cached end never comes
        end = partial(consumer.get_watermark_offsets, tp, timeout=10)  # (retried while the broker is away)
        low, high = retrying(end, f"the end of {topic} [{partition}]", log, give_up_s=timeout_s)
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        deadline = time.monotonic() + timeout_s
        while high > low or token:
            batch = [m for m in consumer.consume(10_000, timeout=0.5) if m.error() is None]
            changes = [(m.key() or b"", m.value()) for m in batch]
            state.load(changes)
            records += len(batch)
            found = found or any(k == PROGRESS and v and decode_progress(v).token == token for k, v in changes)
            # a read-committed consumer's cached end is the last stable offset: the end of what
            # committed (an open transaction of the partition's previous owner holds it back)
            _, stable = consumer.get_watermark_offsets(tp, cached=True)
            position = consumer.position([tp])[0].offset
            at_end = stable is not None and stable >= 0 and position >= stable and not batch
            if at_end and found:
                break
            if time.monotonic() > deadline:
                raise StreamError(
                    f"join: restoring partition {partition} from {topic}: "
                    + ("" if found else f"the group's committed chunk {token} is not in it, ")
                    + f"not at its end within {timeout_s:.0f} s (at {position}, end {stable}); is a transaction "
                    f"of another joiner held open? (a changelog deleted while the group's offsets were kept "
                    "never has it: delete the group's offsets too)"
                )
    finally:
        consumer.close()
    state.close()
    state = PartitionState(path, changelog)  # reopened: its progress and bundles read from what was loaded
    log.warning(
        "join: partition %d restored from %s: %d records in %.1f s",
        partition,
        topic,
        records,
        time.monotonic() - started,
    )
    return state
