"""``walbridge pack``'s decisions (walbridge/pack.py): what goes into the
executors' environment and from where. The archive itself is built and used
on a Spark cluster by tests/integration/test_spark_cluster.py."""

from __future__ import annotations

from pathlib import Path

from walbridge import cli, pack

REQUIRES = ['psycopg[binary]>=3.2', 'confluent-kafka[schemaregistry]>=2.6', 'pyspark>=4.0; extra == "spark"',
            'pyarrow>=15; extra == "spark"', 'pandas<3,>=2.2; extra == "spark"', 'pytest>=8; extra == "test"',
            'tomli>=2; python_version < "3.11"']
ROOT = Path(__file__).resolve().parents[2]


def test_the_spark_extra_goes_in_but_pyspark_and_the_test_extra_do_not():
    wanted = pack.install_requirements(REQUIRES, Path("/src/walbridge"), "0.1.0")
    assert wanted == ["/src/walbridge", "pyarrow>=15", "pandas<3,>=2.2"]


def test_an_installed_walbridge_is_packed_from_the_index_at_its_own_version():
    assert pack.install_requirements(REQUIRES, None, "0.1.0")[0] == "walbridge==0.1.0"


def test_everything_is_pinned_to_what_runs_here_but_walbridge_and_what_spark_brings():
    pins = pack.constraints({"walbridge": "0.1.0", "pyspark": "4.3.0", "py4j": "0.10.9.9", "pyarrow": "26.0.1",
                             "psycopg-binary": "3.3.9"})
    assert pins == ["psycopg-binary==3.3.9", "pyarrow==26.0.1"]


def test_a_checkout_is_the_source_an_installed_copy_is_not(tmp_path):
    assert pack.source_tree(ROOT / "walbridge") == ROOT
    (tmp_path / "walbridge").mkdir()
    assert pack.source_tree(tmp_path / "walbridge") is None


def test_the_build_reads_a_copy_of_the_project_without_build_output(tmp_path):
    copy = pack.copy_source(ROOT, tmp_path / "src")
    assert {p.name for p in copy.iterdir()} == {"pyproject.toml", "setup.py", "README.md", "walbridge", "producer",
                                                "spark_consumer", "schemas"}
    copied = {p.relative_to(copy).as_posix() for p in copy.rglob("*")}
    assert "spark_consumer/_fastdecode.pyx" in copied and "spark_consumer/log4j2-quiet.properties" in copied
    assert not [p for p in copied if p.endswith((".so", ".c")) or "__pycache__" in p]


def test_pack_refuses_to_replace_an_archive_unless_forced(tmp_path, capsys):
    existing = tmp_path / "walbridge-env.tar.gz"
    existing.write_bytes(b"keep me")
    assert cli.main(["pack", "-o", str(existing)]) == 2
    assert "exists (pass --force to replace it)" in capsys.readouterr().err
    assert existing.read_bytes() == b"keep me"
