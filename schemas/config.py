"""walbridge's one configuration file: a TOML document, validated before anything
touches a database or a broker.

Invariants:
- ``load_config`` either returns a fully validated :class:`Config` or raises
  :class:`ConfigError`; every problem it reports names the offending key as a
  dotted path (``shapes[1].where``) and says what is wrong with it.
- Shape filters are parsed (with sqlglot, via :mod:`schemas.shape_filter`)
  during validation, so an unsupported filter stops the process before a slot or
  publication is created.
- Secrets never appear in messages: DSNs are shown through :func:`redact_dsn`.
- Unknown keys are errors (a misspelt key silently ignored is a setting lost).
- The environment enters in two ways only, before validation: ``${NAME}``
  (``${NAME:-default}``; ``$${`` for a literal ``${``) in any string value, and
  ``<key>_file`` in place of any string ``<key>``: the file's content, its
  trailing newline removed (secrets mounted as files). An unset variable or an
  unreadable file is an error naming its key, never an empty value.
- ``[kafka.client]`` is checked by librdkafka itself (a client is built with it,
  connecting nowhere), so an unknown or invalid property fails here.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from confluent_kafka import KafkaException, Producer
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.java_client import JavaClientError, java_client_options
from schemas.shape_filter import FilterError, compile_filter

_IDENT = r'(?:[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+")'
_QUALIFIED_TABLE = re.compile(rf"^{_IDENT}\.{_IDENT}$|^{_IDENT}$")
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")


def _check_dsn(dsn: str) -> str:
    try:
        conninfo_to_dict(dsn)
    except Exception as e:  # psycopg raises ProgrammingError with libpq's text
        raise ValueError(f"is not a valid PostgreSQL connection string ({str(e).strip()})") from None
    return dsn


Dsn = Annotated[str, AfterValidator(_check_dsn)]  # a libpq connection string (URI or key=value)


class ConfigError(ValueError):
    """A configuration problem; ``str()`` lists every problem, one per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        head = f"invalid config {source}" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


def _join_password(data: Any, dsn_key: str, password_key: str) -> Any:
    if isinstance(data, dict) and data.get(password_key) is not None and isinstance(data.get(dsn_key), str):
        try:
            data = {**data, dsn_key: make_conninfo(data[dsn_key], password=str(data[password_key]))}
        except Exception:  # noqa: BLE001 - the DSN's own validator names the problem
            pass
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reconnecting(_Section):
    # Transient failures (a lost connection, an unreachable broker) are retried
    # with jittered exponential backoff up to reconnect_max_backoff seconds
    # between attempts; the process gives up after reconnect_max_elapsed
    # seconds of failing (None: never).
    reconnect_max_backoff: Annotated[float, Field(gt=0)] = 30.0
    reconnect_max_elapsed: Annotated[float, Field(gt=0)] | None = None


class SourceConfig(_Reconnecting):
    dsn: Dsn = Field(repr=False)  # may hold a password: shown only through redact_dsn
    # Joined into the DSN (keeps a secret out of it: password_file, ${VAR}).
    password: str | None = Field(default=None, repr=False)
    slot: str = "walbridge"
    publication: str = "walbridge"
    snapshot_workers: Annotated[int, Field(ge=1, le=64)] = 2
    # What to do with a keyless table whose replica identity is DEFAULT: adding it
    # to a publication that publishes UPDATE/DELETE would make PostgreSQL reject the
    # application's own UPDATE/DELETE on it, so walbridge never does that silently.
    keyless_tables: Literal["refuse", "inserts_only"] = "refuse"
    # PostgreSQL 17+: the slot is a failover slot, which a standby with sync_replication_slots keeps a copy
    # of, so the producer carries on from it after a promotion (no effect on older servers).
    slot_failover: bool = True

    @model_validator(mode="before")
    @classmethod
    def _password(cls, data: Any) -> Any:
        return _join_password(data, "dsn", "password")

    @field_validator("slot", "publication")
    @classmethod
    def _pg_name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9_]{1,63}", v):
            raise ValueError("must be 1-63 characters of lower-case letters, digits and '_' "
                             "(PostgreSQL slot naming rules)")
        return v


class KafkaConfig(_Section):
    bootstrap_servers: str
    topic_prefix: str = "wb"
    # Kafka's own default: one ordered log per shape. Each partition a batch
    # reads costs the consumer round trips to the broker (bench/RESULTS.md).
    partitions: Annotated[int, Field(ge=1, le=10000)] = 1
    # Replicas of the topics walbridge creates; unset: the cluster's default.replication.factor.
    replication_factor: Annotated[int, Field(ge=1)] | None = None
    schema_registry_url: str | None = None
    # Schema Registry credentials (never logged): "user:password", or a static bearer token.
    schema_registry_basic_auth: SecretStr | None = None
    schema_registry_bearer_token: SecretStr | None = None
    # Extra Schema Registry client settings (ssl.*, bearer.auth.logical.cluster, ...), passed through.
    schema_registry_client: dict[str, str | int | float | bool] = Field(default_factory=dict)
    # Registry subjects: "<topic>-key|value", the record's full name, or "<topic>-<record full name>".
    subject_name_strategy: Literal["topic", "record", "topic_record"] = "topic"
    # Extra librdkafka settings (security.protocol, sasl.*, ...), passed through.
    client: dict[str, str | int | float | bool] = Field(default_factory=dict)
    # Settings of the data topics walbridge creates, over its own (retention.ms=-1), e.g. cleanup.policy.
    topic_config: dict[str, str | int] = Field(default_factory=dict)
    # A data topic whose settings may delete changes before every consumer read them: refuse to start, or warn.
    on_finite_retention: Literal["refuse", "warn"] = "refuse"
    # A delete is followed by a tombstone (key, null value), so compaction can drop the key (Debezium's default).
    tombstones_on_delete: bool = True
    # "plain": every column a plain [null, T] field, special values (NaN, infinity, ...) in a side field;
    # "union": special values in a string branch of the column's union (the layout of earlier versions).
    value_layout: Literal["plain", "union"] = "plain"

    @field_validator("client")
    @classmethod
    def _client(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v:
            _check_client(v)
        return v

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not _TOPIC_CHARS.fullmatch(v):
            raise ValueError("may contain only letters, digits, '.', '_' and '-'")
        return v

    @field_validator("schema_registry_url")
    @classmethod
    def _registry(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(https?|mock)://", v):
            raise ValueError("must start with http://, https:// or mock://")
        return v

    @field_validator("schema_registry_basic_auth")
    @classmethod
    def _basic_auth(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and ":" not in v.get_secret_value():
            raise ValueError("must be written as user:password")
        return v

    @model_validator(mode="after")
    def _one_registry_credential(self) -> KafkaConfig:
        given = [n for n in ("schema_registry_basic_auth", "schema_registry_bearer_token") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError("schema_registry_basic_auth and schema_registry_bearer_token: set one, not both")
        if given and self.schema_registry_url and re.match(r"^https?://[^/@]*@", self.schema_registry_url):
            raise ValueError(f"{given[0]}: the schema_registry_url carries credentials as well; keep them in one place")
        return self

    def registry_client_config(self) -> dict[str, Any]:
        """The Schema Registry client settings (secrets included: never log them)."""
        conf: dict[str, Any] = {"url": self.schema_registry_url, **self.schema_registry_client}
        if self.schema_registry_basic_auth is not None:
            conf["basic.auth.user.info"] = self.schema_registry_basic_auth.get_secret_value()
        if self.schema_registry_bearer_token is not None:
            conf["bearer.auth.credentials.source"] = "STATIC_TOKEN"
            conf["bearer.auth.token"] = self.schema_registry_bearer_token.get_secret_value()
        return conf


class ShapeConfig(_Section):
    table: str
    name: str | None = None
    where: str | None = None
    columns: list[str] | None = None

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        if not _QUALIFIED_TABLE.fullmatch(v):
            raise ValueError(f"{v!r} is not a table name; write it as schema.table, e.g. public.orders")
        return v if "." in v else f"public.{v}"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _TOPIC_CHARS.fullmatch(v):
            raise ValueError(f"{v!r} may contain only letters, digits, '.', '_' and '-' (it names a topic)")
        return v

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("must list at least one column (omit the key for all columns)")
            dupes = sorted({c for c in v if v.count(c) > 1})
            if dupes:
                raise ValueError(f"lists {', '.join(dupes)} more than once")
        return v

    @field_validator("where")
    @classmethod
    def _where(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                compile_filter(v)
            except FilterError as e:
                raise ValueError(str(e)) from None
        return v

    @property
    def schema_name(self) -> str:
        return _split_table(self.table)[0]

    @property
    def table_name(self) -> str:
        return _split_table(self.table)[1]

    @property
    def shape_name(self) -> str:
        return self.name or f"{self.schema_name}.{self.table_name}"


class IcebergConfig(_Section):
    """``[consumer.iceberg]``: the Iceberg catalog a ``target = "iceberg"``
    consumer applies to, each shape a table ``<namespace>.<shape name>``."""

    catalog: Literal["hadoop", "jdbc"] = "hadoop"
    warehouse: str  # the folder (or URI) the catalog keeps table files in
    catalog_dsn: Dsn | None = Field(default=None, repr=False)  # jdbc: the PostgreSQL database of the catalog
    namespace: str = "cdc"
    name: str = "walbridge"  # the catalog's name (Spark's and pyiceberg's; a JDBC catalog's rows carry it)

    @property
    def warehouse_uri(self) -> str:
        """The warehouse as a URI (a local folder as ``file:``)."""
        return self.warehouse if "://" in self.warehouse else Path(self.warehouse).resolve().as_uri()

    @model_validator(mode="after")
    def _jdbc_needs_a_database(self) -> IcebergConfig:
        if self.catalog == "jdbc" and not self.catalog_dsn:
            raise ValueError('catalog = "jdbc" needs catalog_dsn (the PostgreSQL database holding the catalog)')
        if not self.name.isidentifier() or not all(part.isidentifier() for part in self.namespace.split(".")):
            raise ValueError("name and namespace must be plain identifiers (letters, digits, _)")
        return self


class ConsumerConfig(_Reconnecting):  # reconnect_*: its waits for the broker, registry and target
    group: str = "walbridge-spark"
    # What the consumer applies to: "postgresql" (target_dsn; the default when
    # it is set), "delta" (a Delta Lake table per shape under target_path) or
    # "iceberg" (an Apache Iceberg table per shape in [consumer.iceberg]'s catalog).
    target: Literal["postgresql", "delta", "iceberg"] | None = None
    target_dsn: Dsn | None = Field(default=None, repr=False)
    target_path: str | None = None  # delta: the folder (or URI) holding <target_path>/<shape name>
    target_password: str | None = Field(default=None, repr=False)  # joined into target_dsn
    # Spark's checkpoint of the running query: scratch, emptied at every start
    # (the target's progress is what says where a start begins).
    checkpoint_dir: str = ".walbridge/checkpoints"
    # Offsets read per micro-batch at most, all topics together (Spark's
    # maxOffsetsPerTrigger): a restart in front of a backlog reads it in steps.
    max_offsets_per_trigger: Annotated[int, Field(ge=1)] = 50_000
    trigger_interval: Annotated[float, Field(ge=0)] = 0.25
    # Seconds an executor's read of a partition may get nothing from the
    # broker before its task fails and is retried (Spark's
    # kafkaConsumer.pollTimeoutMs, whose default is spark.network.timeout,
    # 120 s): a read stuck on a frozen or wiped broker holds the whole batch
    # that long per attempt before the query is restarted and the topics
    # are checked again.
    poll_timeout: Annotated[float, Field(gt=0)] = 10.0
    # Kafka lost data (topics recreated): "follow" re-reads the new topics from
    # their start and applies by position (the producer re-snapshots); "stop"
    # stops the consumer with an error.
    on_data_loss: Literal["follow", "stop"] = "follow"
    # A column the shape's new writer schema lacks (DROP COLUMN at the source):
    # "keep" it in the target, nullable (later rows leave it NULL); "drop" it.
    on_dropped_column: Literal["keep", "drop"] = "keep"
    # Lakehouse tables' upkeep, run by the consumer between micro-batches
    # (their only writer: it never conflicts with a MERGE), in seconds, 0 =
    # never: compaction of the small files streaming MERGEs leave (OPTIMIZE,
    # rewrite_data_files), and removal of what no version of the last
    # vacuum_retain_hours needs (VACUUM, expire_snapshots).
    compact_interval: Annotated[float, Field(ge=0)] = 600.0
    vacuum_interval: Annotated[float, Field(ge=0)] = 86400.0
    vacuum_retain_hours: Annotated[float, Field(ge=0)] = 168.0
    iceberg: IcebergConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _password(cls, data: Any) -> Any:
        return _join_password(data, "target_dsn", "target_password")

    @model_validator(mode="after")
    def _target_kind(self) -> ConsumerConfig:
        """The target named, or implied by the one place given, and that place set."""
        if self.target is None:
            if self.target_path is not None:
                raise ValueError('target_path: is given without target = "delta"')
        elif self.target == "postgresql" and self.target_dsn is None:
            raise ValueError('target = "postgresql" needs target_dsn (the database to apply to)')
        elif self.target == "delta" and not self.target_path:
            raise ValueError('target = "delta" needs target_path (the folder of the shapes\' Delta tables)')
        elif self.target == "iceberg" and self.iceberg is None:
            raise ValueError('target = "iceberg" needs a [consumer.iceberg] section (catalog, warehouse)')
        return self

    @property
    def target_kind(self) -> str | None:
        """The target applied to: ``target``, else "postgresql" when target_dsn is set."""
        return self.target or ("postgresql" if self.target_dsn else None)

    @property
    def is_lakehouse(self) -> bool:
        """Is the target a lakehouse table format (its apply a MERGE run in Spark's JVM)?"""
        return self.target_kind in ("delta", "iceberg")

    @property
    def has_target(self) -> bool:
        """Is a target configured (the consumer can run)?"""
        return self.target_kind is not None


class AckConfig(_Section):
    consumer_groups: list[str] | None = None
    interval: Annotated[float, Field(gt=0)] = 1.0
    stall_timeout: Annotated[float, Field(gt=0)] = 300.0
    on_stall: Literal["hold", "drop"] = "hold"


class BackfillConfig(_Section):
    # Rows per chunk: the most the producer encodes between two looks at the
    # replication stream, so live changes wait at most one chunk.
    chunk_rows: Annotated[int, Field(ge=1, le=100_000)] = 500
    # A chunk goes out whenever the stream is idle, and at least this often (s)
    # when it never is, so a busy database cannot starve a backfill.
    force_after: Annotated[float, Field(gt=0)] = 0.1
    # Shapes whose topics are empty when the producer starts on an existing
    # slot (added to the config) are backfilled automatically.
    new_shapes: Literal["backfill", "ignore"] = "backfill"


class MetricsConfig(_Section):
    port: Annotated[int, Field(ge=0, le=65535)] | None = None  # producer
    consumer_port: Annotated[int, Field(ge=0, le=65535)] | None = None  # Spark consumer (driver)


class Config(_Section):
    source: SourceConfig
    kafka: KafkaConfig
    shapes: list[ShapeConfig] = Field(min_length=1)
    consumer: ConsumerConfig = ConsumerConfig()
    ack: AckConfig = AckConfig()
    backfill: BackfillConfig = BackfillConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _consumer_kafka_client(self) -> Config:
        """The consumer's Spark source must be able to take ``[kafka.client]``."""
        if self.consumer.has_target:
            try:
                java_client_options(self.kafka.bootstrap_servers, self.kafka.client)
            except JavaClientError as e:
                raise ValueError("; ".join(e.problems)) from None
        return self

    @model_validator(mode="after")
    def _unique_shape_names(self) -> Config:
        seen: dict[str, int] = {}
        for i, shape in enumerate(self.shapes):
            if shape.shape_name in seen:
                raise ValueError(
                    f"shapes[{i}].name: shape name {shape.shape_name!r} is already used by "
                    f"shapes[{seen[shape.shape_name]}]; give one of them a distinct `name`")
            seen[shape.shape_name] = i
        return self

    @property
    def ack_groups(self) -> list[str]:
        """Consumer groups whose commits release WAL; [] means broker acks suffice."""
        return list(self.ack.consumer_groups) if self.ack.consumer_groups is not None else [self.consumer.group]

    def topic(self, shape: ShapeConfig) -> str:
        return f"{self.kafka.topic_prefix}.{shape.shape_name}"


def _split_table(qualified: str) -> tuple[str, str]:
    """``schema.table`` with PostgreSQL identifier rules (quotes keep case)."""
    parts = re.findall(rf"{_IDENT}", qualified)
    names = [p[1:-1].replace('""', '"') if p.startswith('"') else p.lower() for p in parts]
    return (names[0], names[1]) if len(names) == 2 else ("public", names[0])


def _check_client(client: dict[str, Any]) -> None:
    """librdkafka's verdict on ``[kafka.client]``: a producer built with it,
    connecting nowhere and logging nothing."""
    try:
        Producer({**client, "bootstrap.servers": "", "log_level": 0})
    except KafkaException as e:
        raise ValueError(e.args[0].str() if e.args else str(e)) from None


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ``***`` (for logs and errors)."""
    redacted = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", dsn)
    # key=value form (a quoted value may hold spaces) and URI query parameters
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]+)", r"\1***", redacted, flags=re.I)


_ENV_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
FILE_SUFFIX = "_file"


def _interpolate(text: str, environ: Mapping[str, str]) -> str:
    def value(m: re.Match) -> str:
        if m.group(0) == "$${":
            return "${"
        name, default = m.group(1), m.group(2)
        found = environ.get(name)
        if found is None or (found == "" and default is not None):
            if default is None:
                raise ValueError(f"environment variable {name} is not set")
            return default
        return found

    return _ENV_REF.sub(value, text)


def from_environment(data: Any, environ: Mapping[str, str], base_dir: Path,
                     problems: list[str], loc: tuple = ()) -> Any:
    """``data`` with ``${NAME}`` interpolated in every string and every
    ``<key>_file`` replaced by ``<key>`` = the file's content (relative paths
    from ``base_dir``); problems are appended, named by their dotted key."""
    if isinstance(data, str):
        try:
            return _interpolate(data, environ)
        except ValueError as e:
            problems.append(f"{_loc(loc)}: {e}")
            return data
    if isinstance(data, list):
        return [from_environment(v, environ, base_dir, problems, loc + (i,)) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        value = from_environment(value, environ, base_dir, problems, loc + (key,))
        if not (isinstance(key, str) and key.endswith(FILE_SUFFIX) and len(key) > len(FILE_SUFFIX)):
            out[key] = value
            continue
        name = key[:-len(FILE_SUFFIX)]
        where = _loc(loc + (key,))
        if name in data:
            problems.append(f"{where}: {name} is set too; keep one of them")
        elif not isinstance(value, str):
            problems.append(f"{where}: must be a file path")
        else:
            path = base_dir / Path(value).expanduser()
            try:
                out[name] = path.read_text().removesuffix("\n").removesuffix("\r")
            except OSError as e:
                problems.append(f"{where}: cannot read {path}: {e.strerror}")
    return out


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_config(data: dict[str, Any], source: str | None = None) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = _loc(tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                msg = "is required"
            elif err["type"] == "extra_forbidden":
                msg = "is not a known setting"
            if msg.startswith("shapes["):  # model-level message already names its key
                problems.append(msg)
            else:
                problems.append(f"{loc or '(top level)'}: {msg}")
        raise ConfigError(problems, source) from None


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """The config file at ``path``, with ``${NAME}`` and ``<key>_file`` resolved
    from ``environ`` (default: this process's environment)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"cannot read config file: {e.strerror}"], str(path)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"not valid TOML: {e}"], str(path)) from None
    problems: list[str] = []
    data = from_environment(data, os.environ if environ is None else environ, path.parent, problems)
    if problems:
        raise ConfigError(problems, str(path))
    return parse_config(data, str(path))
