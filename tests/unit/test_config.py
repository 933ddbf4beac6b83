"""Every documented config error produces its message, naming the key."""

from __future__ import annotations

import pytest

from schemas.config import ConfigError, load_config, parse_config, redact_dsn
from walbridge.cli import main

GOOD = {
    "source": {"dsn": "postgresql://u:secret@db:5432/app"},
    "kafka": {"bootstrap_servers": "k:9092"},
    "shapes": [{"table": "public.orders"}],
}


def with_(path: str, value, base=None):
    import copy

    data = copy.deepcopy(base or GOOD)
    keys = path.split(".")
    node = data
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node.setdefault(k, {})
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()

BAD = [
    (with_("source", _DELETE), "source: is required"),
    (with_("source.dsn", _DELETE), "source.dsn: is required"),
    (with_("source.dsn", "host=db port=notaport sslmode=bogus x"), "source.dsn: is not a valid PostgreSQL connection"),
    (with_("source.slot", "Bad-Slot"), "source.slot: must be 1-63 characters"),
    (with_("source.snapshot_workers", 0), "source.snapshot_workers: Input should be greater than or equal to 1"),
    (with_("source.keyless_tables", "maybe"), "source.keyless_tables: Input should be 'refuse' or 'inserts_only'"),
    (with_("source.dns", "x"), "source.dns: is not a known setting"),
    (with_("kafka.bootstrap_servers", _DELETE), "kafka.bootstrap_servers: is required"),
    (with_("kafka.topic_prefix", "wb prefix"), "kafka.topic_prefix: may contain only letters"),
    (with_("kafka.partitions", 0), "kafka.partitions: Input should be greater than or equal to 1"),
    (with_("kafka.schema_registry_url", "registry:8081"), "kafka.schema_registry_url: must start with http://"),
    (with_("shapes", []), "shapes: List should have at least 1 item"),
    (with_("shapes.0.table", "no spaces allowed"), "shapes[0].table: 'no spaces allowed' is not a table name"),
    (with_("shapes.0.table", _DELETE), "shapes[0].table: is required"),
    (with_("shapes.0.where", "lower(region) = 'eu'"), "shapes[0].where: "),
    (with_("shapes.0.where", "region = 'eu' AND (SELECT 1) = 1"), "subqueries"),
    (with_("shapes.0.where", ""), "shapes[0].where"),
    (with_("shapes.0.columns", []), "shapes[0].columns: must list at least one column"),
    (with_("shapes.0.columns", ["id", "id"]), "shapes[0].columns: lists id more than once"),
    (with_("shapes.0.name", "bad name"), "shapes[0].name: 'bad name' may contain only"),
    ({**GOOD, "shapes": [{"table": "public.orders"}, {"table": "orders"}]},
     "shapes[1].name: shape name 'public.orders' is already used by shapes[0]"),
    (with_("ack.on_stall", "panic"), "ack.on_stall: Input should be 'hold' or 'drop'"),
    (with_("ack.interval", 0), "ack.interval: Input should be greater than 0"),
    (with_("metrics.port", 70000), "metrics.port: Input should be less than or equal to 65535"),
    (with_("consumer.target_dsn", "warehouse"), "consumer.target_dsn: is not a valid PostgreSQL connection"),
    (with_("consumer.target", "delta"), 'consumer: target = "delta" needs target_path'),
    (with_("consumer.target", "postgresql"), 'consumer: target = "postgresql" needs target_dsn'),
    (with_("consumer.target", "hudi"), "consumer.target: Input should be 'postgresql', 'delta' or 'iceberg'"),
    (with_("consumer.target", "iceberg"), 'consumer: target = "iceberg" needs a [consumer.iceberg] section'),
    (with_("consumer.iceberg", {"catalog": "jdbc", "warehouse": "/wh"}),
     'consumer.iceberg: catalog = "jdbc" needs catalog_dsn'),
    (with_("consumer.iceberg", {"warehouse": "/wh", "namespace": "my cdc"}),
     "consumer.iceberg: name and namespace must be plain identifiers"),
    (with_("consumer.target_path", "/lake"), 'consumer: target_path: is given without target = "delta"'),
]


@pytest.mark.parametrize("data,fragment", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_config_names_key_and_problem(data, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert fragment in str(e.value)


def test_good_config_defaults():
    cfg = parse_config(GOOD)
    assert cfg.shapes[0].shape_name == "public.orders" and cfg.topic(cfg.shapes[0]) == "wb.public.orders"
    assert cfg.ack_groups == ["walbridge-spark"]
    assert parse_config(with_("ack.consumer_groups", [])).ack_groups == []
    assert parse_config(with_("shapes.0.table", "orders")).shapes[0].table == "public.orders"
    assert parse_config(with_("shapes.0.table", 'app."Order Items"')).shapes[0].table_name == "Order Items"


def test_the_target_is_named_or_implied_by_target_dsn():
    assert parse_config(GOOD).consumer.target_kind is None
    pg = parse_config(with_("consumer.target_dsn", "postgresql://w/x")).consumer
    assert pg.target_kind == "postgresql" and not pg.is_lakehouse
    lake = parse_config(with_("consumer", {"target": "delta", "target_path": "/lake"})).consumer
    assert lake.target_kind == "delta" and lake.has_target and lake.target_path == "/lake" and lake.is_lakehouse


def test_errors_never_show_secrets():
    with pytest.raises(ConfigError) as e:
        parse_config(with_("source.slot", "BAD", with_("source.dsn", "postgresql://u:hunter2@db/app")))
    assert "hunter2" not in str(e.value)
    assert redact_dsn("postgresql://u:hunter2@db/app") == "postgresql://u:***@db/app"
    assert redact_dsn("host=db password=hunter2 user=u") == "host=db password=*** user=u"


def test_file_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[source\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    assert main(["check-config", "-c", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def _toml(tmp_path, text: str):
    path = tmp_path / "wb.toml"
    path.write_text(text)
    return path


BASE = ('[source]\ndsn = "{dsn}"\n{source}\n[kafka]\nbootstrap_servers = "k:9092"\n{kafka}\n'
        '[[shapes]]\ntable = "public.orders"\n')


def test_variables_come_from_the_environment(tmp_path):
    path = _toml(tmp_path, BASE.format(dsn="postgresql://app:${PGPW}@${PGHOST:-db}:5432/app", source="",
                                       kafka='topic_prefix = "${PREFIX:-wb}"\n[kafka.client]\n'
                                             '"client.id" = "$${literal}"'))
    cfg = load_config(path, {"PGPW": "hunter2", "PREFIX": "prod"})
    assert cfg.source.dsn == "postgresql://app:hunter2@db:5432/app"
    assert cfg.kafka.topic_prefix == "prod" and cfg.kafka.client["client.id"] == "${literal}"
    with pytest.raises(ConfigError) as e:
        load_config(path, {})
    assert "source.dsn: environment variable PGPW is not set" in str(e.value)


def test_secrets_come_from_files_and_never_show(tmp_path):
    (tmp_path / "pg-password").write_text("hun ter2\n")
    (tmp_path / "sasl").write_text("s4sl\n")
    path = _toml(tmp_path, BASE.format(dsn="postgresql://app@db:5432/app", source='password_file = "pg-password"',
                                       kafka='[kafka.client]\n"security.protocol" = "SASL_PLAINTEXT"\n'
                                             '"sasl.mechanism" = "PLAIN"\n"sasl.username" = "app"\n'
                                             '"sasl.password_file" = "${SECRETS:-.}/sasl"'))
    cfg = load_config(path, {})
    assert "password='hun ter2'" in cfg.source.dsn and cfg.kafka.client["sasl.password"] == "s4sl"
    assert "hun ter2" not in redact_dsn(cfg.source.dsn) and "hun ter2" not in repr(cfg)
    with pytest.raises(ConfigError, match=r"source.password_file: cannot read .*gone: No such file"):
        load_config(_toml(tmp_path, BASE.format(dsn="postgresql://db/app", source='password_file = "gone"',
                                                kafka="")), {})
    with pytest.raises(ConfigError, match="source.password_file: password is set too; keep one of them"):
        load_config(_toml(tmp_path, BASE.format(dsn="postgresql://db/app", kafka="",
                                                source='password = "x"\npassword_file = "pg-password"')), {})


def test_the_target_password_joins_the_target_dsn():
    cfg = parse_config(with_("consumer", {"target_dsn": "postgresql://wh@w/warehouse", "target_password": "pw2"}))
    assert "password=pw2" in cfg.consumer.target_dsn


@pytest.mark.parametrize("client,fragment", [
    ({"no.such.property": 1}, 'kafka.client: No such configuration property: "no.such.property"'),
    ({"acks": "maybe"}, 'kafka.client: Invalid value for configuration property "request.required.acks"'),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}, "sasl.username and sasl.password must be set"),
])
def test_librdkafka_judges_the_client_settings(client, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(with_("kafka.client", client))
    assert fragment in str(e.value)
    assert parse_config(with_("kafka.client", {"linger.ms": 5, "enable.idempotence": True})).kafka.client
