"""Where the JVM parts pinned in ``jvm/pom.xml`` are on this machine: one
folder of jars per Maven module, ``.jvm/<module>/`` beside the packages (made
by ``mvn -q -f jvm/pom.xml package``, which ``.ci/install`` runs), or under
``$WALBRIDGE_JVM_DIR``.

Both floors that start a JVM read it here: the embedded broker
(``walbridge.embedded``, module ``kafka``) and the consumer's own Spark driver
(:mod:`spark_consumer.session`, module ``spark``: the Kafka source, spark-avro,
Delta and Iceberg beside the pyspark wheel's jars).

Invariant: a module without jars is never silently skipped: asking for it
raises :class:`MissingJars` naming the command that resolves it.
"""

from __future__ import annotations

import os
from pathlib import Path

JVM_DIR_ENV = "WALBRIDGE_JVM_DIR"


class MissingJars(RuntimeError):
    """A module of ``jvm/pom.xml`` was never resolved on this machine."""


def jvm_dir() -> Path:
    """The folder ``jvm/pom.xml`` is resolved into."""
    override = os.environ.get(JVM_DIR_ENV)
    return Path(override) if override else Path(__file__).resolve().parent.parent / ".jvm"


def jvm_jars(module: str) -> list[Path]:
    """The jars of one module (``kafka``, ``spark``), sorted by name."""
    folder = jvm_dir() / module
    jars = sorted(folder.glob("*.jar"))
    if not jars:
        raise MissingJars(f"no jars in {folder}: resolve the JVM parts first "
                          "(bash .ci/install, or mvn -q -f jvm/pom.xml package)")
    return jars


def jvm_classpath(module: str) -> str:
    """One module's jars as a Java classpath (a wildcard entry)."""
    return str(jvm_jars(module)[0].parent / "*")
