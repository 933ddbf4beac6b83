"""Kafka client helpers every walbridge process uses: client settings, topic
creation, reading partitions from one offset to another, consumer-group offsets.

Invariants:
- A partition read ends at end-of-partition as the Fetch that reached it
  reports it (``enable.partition.eof``), so a scan sees every message that was
  there when it ended, without asking for the end offset first.
- Scanning consumers never join or commit to a group of the user's: each gets
  a group id of its own that nothing else uses. Committed offsets are read
  with the user's group id by a consumer that never subscribes (never joins,
  never commits), not through the admin client (see :class:`GroupOffsets`).
- ``ensure_topics`` only creates what is missing and returns the partition
  counts the broker actually has (an existing topic keeps its own).
- Every client made from :func:`client_config` logs through Python logging
  (logger ``walbridge.librdkafka``, records served by the client's ``poll``),
  never straight to stderr, and at most one record of a kind per
  ``LOG_WINDOW`` seconds: a broker that is down cannot flood the log or break
  its JSON lines.
- Waits that run out raise ``KafkaException`` (``_TIMED_OUT``), so the failure
  policy (:mod:`schemas.failures`) sees a Kafka timeout, not a bare one.
- A broker that refuses the connection itself (credentials, a certificate not
  trusted) or a group coordinator lookup (ACLs) is told apart from one that
  cannot be reached: librdkafka reports the refusal only to the client's
  ``error_cb`` or as one consumer event (kept by :class:`Refusals`, set by
  :func:`client_config`) and retries for ever; the first request that then
  fails raises it instead (:func:`raise_refusal`, permanent for the failure
  policy), so a process with a wrong password or a denied group ends within
  seconds.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import tenacity
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from schemas import wire
from schemas.wire import commit_topic_id

log = logging.getLogger("walbridge.kafka")
T = TypeVar("T")

Writer = tuple[str, int]
"""A topic-partition: the unit the FlushTracker calls a writer."""
Headers = list[tuple[str, bytes]]  # a Kafka message's, in order

LOG_WINDOW = 30.0  # seconds: librdkafka records of one kind pass once per window
METADATA_TIMEOUT = 10.0  # seconds for a broker to answer a metadata request


class RateLimit(logging.Filter):
    """Lets one record of a kind through per ``window`` seconds; the next one
    that passes says how many it stood for. A kind is the level and the text
    with numbers and client names blanked (``Connect to ipv4#127.0.0.1:1
    failed ... (after 0ms ...)`` is one kind whatever the timing)."""

    MAX_KINDS = 1000

    def __init__(self, window: float = LOG_WINDOW, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._window = window
        self._clock = clock
        self._kinds: dict[tuple[int, str], list] = {}  # kind -> [when it last passed, held back since]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = (record.levelno, re.sub(r"rdkafka#\w+-\d+|\d+", "#", text))
        now = self._clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self._window:
            seen[1] += 1
            return False
        if len(self._kinds) >= self.MAX_KINDS:
            self._kinds.clear()
        self._kinds[kind] = [now, 0]
        if seen is not None and seen[1]:
            record.msg, record.args = f"{text} ({seen[1]} more like it in the last {now - seen[0]:.0f}s)", None
        return True


LIBRDKAFKA_LOG = logging.getLogger("walbridge.librdkafka")
LIBRDKAFKA_LOG.addFilter(RateLimit())


# The refusals librdkafka retries for ever, reporting them only to error_cb.
REFUSAL_CODES = (KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.GROUP_AUTHORIZATION_FAILED,
                 KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED)


class Refusals:
    """The ``error_cb`` of the clients made from one :func:`client_config`:
    keeps the last refusal (:data:`REFUSAL_CODES`)."""

    def __init__(self) -> None:
        self.last: KafkaError | None = None

    def __call__(self, error: KafkaError) -> None:
        if error.code() in REFUSAL_CODES:
            self.last = error

    def __repr__(self) -> str:  # the same for every instance: configs that differ only here are equal
        return "Refusals()"


def client_config(bootstrap: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": LIBRDKAFKA_LOG, "error_cb": Refusals()}
    conf.update(extra or {})
    return conf


def metadata(client: AdminClient | Consumer | Producer, conf: dict[str, Any], timeout: float,
             topic: str | None = None) -> Any:
    """``list_topics``; when it fails and the broker refused the connection
    (see :class:`Refusals`), that refusal is raised instead. A consumer must
    not be assigned yet: its callbacks are served by a ``poll``."""
    try:
        return client.list_topics(topic, timeout=timeout)
    except KafkaException:
        raise_refusal(client, conf)
        raise


def raise_refusal(client: AdminClient | Consumer | Producer, conf: dict[str, Any]) -> None:
    """Raise the refusal ``client`` met, if any (:class:`Refusals`). Serves
    the client's callbacks with a ``poll``: a consumer must have no
    assignment (a group coordinator's refusal is one of its events)."""
    event = client.poll(0)
    refusals = conf.get("error_cb")
    if not isinstance(refusals, Refusals):
        return
    if isinstance(event, Message) and event.error() is not None:
        refusals(event.error())
    if refusals.last is not None:
        raise KafkaException(refusals.last) from None


def timed_out(what: str) -> KafkaException:
    return KafkaException(KafkaError(KafkaError._TIMED_OUT, what))


def cluster_metadata(client: AdminClient | Consumer, conf: dict[str, Any], timeout: float,
                     stop: threading.Event) -> Any:
    """:func:`metadata` that ``stop`` interrupts: asked in slices of at most a
    second, so a process told to stop while the broker is gone stops within
    one (librdkafka blocks a metadata request for its whole timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return metadata(client, conf, max(0.1, min(1.0, deadline - time.monotonic())))
        except KafkaException as e:
            if e.args[0].code() in REFUSAL_CODES or stop.is_set() or time.monotonic() >= deadline:
                raise


def produce_acknowledged(producer: Producer, topic: str, value: bytes, key: bytes, timeout: float, what: str,
                         headers: Headers | None = None) -> None:
    """Produce one message and wait for its acknowledgement alone (a flush()
    would wait for every queued change too); raises KafkaException, _TIMED_OUT
    (transient) when none came within ``timeout`` seconds."""
    produce_all_acknowledged(producer, [(topic, value, key, headers)], timeout, what)


def produce_all_acknowledged(producer: Producer, messages: Sequence[tuple[str, bytes, bytes, Headers | None]],
                             timeout: float, what: str) -> None:
    """Produce ``messages`` (topic, value, key, headers), in order, and wait
    for the acknowledgements of all of them: one linger and round trip for
    many, where one at a time pays each (as :func:`produce_acknowledged`)."""
    outcomes: list = []
    for topic, value, key, headers in messages:
        producer.produce(topic, value, key, headers=headers, on_delivery=lambda err, msg: outcomes.append(err))
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(messages) and time.monotonic() < deadline:
        producer.poll(0.05)
    if len(outcomes) < len(messages):
        raise timed_out(f"{what}: no acknowledgement from {messages[0][0]} within {timeout:.0f}s")
    for err in outcomes:
        if err is not None:
            raise KafkaException(err)


def ensure_topics(admin: AdminClient, topics: Iterable[str], partitions: int, replication: int,
                  config: dict[str, str] | None = None, timeout: float = 30.0) -> dict[str, int]:
    """Create missing topics; returns each topic's actual partition count."""
    topics = list(dict.fromkeys(topics))
    existing = admin.list_topics(timeout=min(timeout, METADATA_TIMEOUT)).topics
    missing = [t for t in topics if t not in existing]
    if missing:
        futures = admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=replication, config=config or {})
             for t in missing], request_timeout=timeout)
        for topic, fut in futures.items():
            try:
                fut.result()
                log.info("created topic %s with %d partitions", topic, partitions)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
    meta = metadata_with(admin, topics, timeout).topics
    return {t: len(meta[t].partitions) for t in topics}


def asked_until_complete(ask: Callable[[], T], absent: Callable[[T], list[str]], timeout: float, what: str) -> T:
    """``ask()``'s answer once ``absent(answer)`` is empty, asked again every
    0.2 s: a topic just created reaches the brokers one by one, and each
    request may be answered by another broker, so one answer that knows it
    says nothing of the next. Raises a timed-out (transient) error naming
    ``what`` and what is still absent after ``timeout``; an error of ``ask``
    is raised at once."""
    def give_up(state: tenacity.RetryCallState) -> T:
        raise timed_out(f"{what}: {', '.join(absent(state.outcome.result()))}")

    return tenacity.Retrying(retry=tenacity.retry_if_result(lambda answer: bool(absent(answer))),
                             wait=tenacity.wait_fixed(0.2), stop=tenacity.stop_after_delay(timeout),
                             retry_error_callback=give_up)(ask)


def metadata_with(admin: AdminClient, topics: Iterable[str], timeout: float = 30.0) -> Any:
    """The cluster's metadata once it lists every one of ``topics`` with its
    partitions (see :func:`asked_until_complete`)."""
    topics = list(dict.fromkeys(topics))
    return asked_until_complete(
        lambda: admin.list_topics(timeout=min(timeout, METADATA_TIMEOUT)),
        lambda meta: [t for t in topics if t not in meta.topics or not meta.topics[t].partitions],
        timeout, "topics not visible after creation")


def scan_consumer(conf: dict[str, Any], purpose: str) -> Consumer:
    # A scan ends at end-of-partition, which an empty fetch reports: the broker
    # must not hold that fetch for the default 500 ms (each restart reads the
    # partition tails and the backfill requests this way).
    return Consumer({"fetch.wait.max.ms": 10, **conf, "group.id": wire.reader_group(purpose),
                     "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest"})


def scan(consumer: Consumer, ranges: dict[Writer, tuple[int, int | None]], timeout: float) -> Iterator[Message]:
    """Yield the messages of several partitions at once, each from its start to
    its stop (exclusive) or to end-of-partition (stop None). Order is per
    partition only."""
    if not ranges:
        return
    consumer.assign([TopicPartition(t, p, start if start > 0 else OFFSET_BEGINNING)
                     for (t, p), (start, _) in ranges.items()])
    open_ = set(ranges)
    deadline = time.monotonic() + timeout
    try:
        while open_:
            if time.monotonic() > deadline:
                raise timed_out(f"reading {len(open_)} partition(s) timed out, e.g. {next(iter(open_))}")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            writer = (msg.topic(), msg.partition())
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    open_.discard(writer)
                    continue
                raise KafkaException(msg.error())
            if writer not in open_:
                continue
            stop = ranges[writer][1]
            if stop is not None and msg.offset() >= stop:
                open_.discard(writer)
                continue
            yield msg
    finally:
        consumer.unassign()


def read_to_end(conf: dict[str, Any], topic: str, purpose: str = "read",
                timeout: float = 30.0) -> Iterator[Message]:
    """Every message of every partition of ``topic``, from the beginning to
    end-of-partition (as Fetch reports it); nothing if the topic does not exist."""
    consumer = scan_consumer(conf, purpose)
    try:
        meta = metadata(consumer, conf, timeout, topic).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return
        yield from scan(consumer, {(topic, p): (0, None) for p in sorted(meta.partitions)}, timeout)
    finally:
        consumer.close()


@dataclass(frozen=True)
class Described:
    """What a topic is now: its id (KIP-516; it changes when the topic is
    recreated; None where the broker keeps none) and its partitions."""

    topic_id: str | None
    partitions: tuple[int, ...]


def describe_topics(admin: AdminClient, topics: Iterable[str], timeout: float = 30.0
                    ) -> dict[str, Described | Exception]:
    """Many topics described in one request: topic -> :class:`Described`, or
    the exception met for it (LookupError: the topic is missing; KafkaException)."""
    topics = sorted(set(topics))
    futures = admin.describe_topics(TopicCollection(topics)) if topics else {}
    out: dict[str, Described | Exception] = {}
    for topic in topics:
        try:
            out[topic] = _described(topic, futures[topic], timeout)
        except (LookupError, KafkaException) as e:
            out[topic] = e
    return out


def topic_ids(admin: AdminClient, topics: Iterable[str], timeout: float = 30.0) -> dict[str, str | None | Exception]:
    """Many topics' ids (KIP-516) in one request: topic -> its id, None where
    the broker keeps none, or the exception met for it (LookupError: missing;
    KafkaException)."""
    described = describe_topics(admin, topics, timeout)
    return {t: d.topic_id if isinstance(d, Described) else d for t, d in described.items()}


def latest_offsets(admin: AdminClient, writers: Iterable[Writer], timeout: float = 30.0) -> dict[Writer, int]:
    """Each partition's end (the offset its next message gets), all asked in
    one request per partition leader. Raises KafkaException (``_TIMED_OUT``
    when the broker does not answer within ``timeout`` seconds; else the
    first partition's error, e.g. a missing topic)."""
    asked = [TopicPartition(t, p) for t, p in sorted(set(writers))]
    if not asked:
        return {}
    futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in asked}, request_timeout=timeout)
    out = {}
    for tp, future in futures.items():
        try:
            out[(tp.topic, tp.partition)] = future.result(timeout=timeout).offset
        except TimeoutError:  # the future's own wait
            raise timed_out(f"listing the end offsets of {len(asked)} partitions: no answer within "
                            f"{timeout:.0f}s") from None
    return out


def _described(topic: str, future, timeout: float) -> Described:
    try:
        desc = future.result(timeout=timeout)
    except KafkaException as e:
        if e.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise LookupError(f"topic {topic} does not exist") from None
        raise
    except TimeoutError:  # the future's own wait (a broker that accepts and never answers)
        raise timed_out(f"describing topic {topic}: no answer within {timeout:.0f}s") from None
    tid = str(desc.topic_id) if desc.topic_id is not None else ""
    return Described(tid if tid.strip("A=") else None,  # all-zero id: the broker keeps none
                     tuple(sorted(p.id for p in desc.partitions)))


class GroupOffsets:
    """Reads consumer groups' committed offsets with one ``Consumer`` per group
    that never subscribes (so it never joins the group, and never commits):
    ``committed()`` asks the group's coordinator for the offsets (OffsetFetch).

    Not ``AdminClient.list_consumer_group_offsets``: in librdkafka 2.16 an admin
    request to a group coordinator that times out (a broker frozen for longer
    than the request timeout) can abort the whole process on the assertion
    ``rd_kafka_enq_once_del_source_return: eonce->refcnt > 0`` once the broker
    answers again (librdkafka issue #4605, open).

    A commit whose metadata names a topic id (:func:`schemas.wire.commit_metadata`)
    counts only while the topic still has that id (:func:`trusted_offsets`)."""

    def __init__(self, conf: dict[str, Any]):
        self._conf = conf
        self._consumers: dict[str, Consumer] = {}
        self._admin: AdminClient | None = None
        self._reported: set[str] = set()

    def read(self, groups: Iterable[str], writers: list[Writer],
             timeout: float = 10.0) -> dict[str, dict[Writer, int]]:
        """Each group's committed offset (the next offset it will read) per
        writer; 0 where the group has committed nothing. Raises
        KafkaException (``_TIMED_OUT``) when the coordinator does not answer
        within ``timeout`` seconds."""
        result: dict[str, dict[Writer, int]] = {}
        for group in groups:
            consumer = self._consumers.get(group)
            if consumer is None:
                consumer = self._consumers[group] = Consumer(
                    {**self._conf, "group.id": group, "enable.auto.commit": False})
            consumer.poll(0)  # serves the client's log records
            tps = consumer.committed([TopicPartition(t, p) for t, p in writers], timeout=timeout)
            commits = {(tp.topic, tp.partition): (tp.offset, commit_topic_id(tp.metadata)) for tp in tps}
            ids = self._topic_ids({t for (t, _), (_, tid) in commits.items() if tid}, timeout)
            ends = latest_offsets(self._admin_client(), [w for w, (o, _) in commits.items() if o > 0], timeout)
            result[group], untrusted = trusted_offsets(group, commits, ids, ends)
            for line in untrusted:
                if line not in self._reported:  # once, not at every ack poll
                    self._reported.add(line)
                    log.error("%s", line)
        return result

    def _topic_ids(self, topics: set[str], timeout: float) -> dict[str, str | None]:
        """The current ids of the topics commits named an id for (none asked
        where no commit carries one: commits made by other tools)."""
        if not topics:
            return {}
        ids = {}
        for topic, found in topic_ids(self._admin_client(), topics, timeout).items():
            if isinstance(found, LookupError):
                found = None  # missing: no commit on it is progress
            elif isinstance(found, Exception):
                raise found
            ids[topic] = found
        return ids

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self._conf)
        return self._admin

    def close(self) -> None:
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            consumer.close()
        self._admin = None


def trusted_offsets(group: str, commits: dict[Writer, tuple[int, str | None]],
                    current_ids: dict[str, str | None], ends: dict[Writer, int]) -> tuple[dict[Writer, int], list[str]]:
    """Each writer's committed offset (0 where none) from ``commits`` (offset,
    topic id its metadata names), counting as 0 an offset committed for
    another incarnation of the topic than ``current_ids`` names, or one beyond
    the partition's end (``ends``; a commit without our metadata
    leaves only this sign): a commit made before the topic was re-created (a
    retry, or one in flight) is not progress on the new topic, and trusting
    it would release WAL no consumer applied. Also returns what was not
    trusted, one line per partition naming the group."""
    out, untrusted = {}, []
    for (topic, partition), (offset, committed_id) in commits.items():
        current, end = current_ids.get(topic), ends.get((topic, partition))
        if committed_id is not None and committed_id != current and offset > 0:
            untrusted.append(f"consumer group {group} committed offset {offset} on {topic}[{partition}] for "
                             f"topic id {committed_id}, but the topic's id is now {current} (re-created since): "
                             "not counting it as read")
            offset = 0
        elif end is not None and offset > end:
            untrusted.append(f"consumer group {group} committed offset {offset} on {topic}[{partition}], beyond "
                             f"the partition's end {end} (a commit made before the topic was re-created?): not "
                             "counting it as read")
            offset = 0
        out[(topic, partition)] = max(offset, 0)
    return out, untrusted


def group_offsets(conf: dict[str, Any], groups: Iterable[str], writers: list[Writer],
                  timeout: float = 10.0) -> dict[str, dict[Writer, int]]:
    """:meth:`GroupOffsets.read` once, with clients of its own."""
    reader = GroupOffsets(conf)
    try:
        return reader.read(groups, writers, timeout)
    finally:
        reader.close()
