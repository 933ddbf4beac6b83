"""``walbridge pack``: the Spark consumer's Python environment as one
relocatable archive, for a Spark cluster whose hosts have no walbridge::

    walbridge pack -o walbridge-env.tar.gz
    spark-submit --archives walbridge-env.tar.gz#env --conf spark.pyspark.python=./env/bin/python ...

The path of a pack, top to bottom: a fresh virtual environment in a scratch
directory; pip installs walbridge into it (built from a copy of the source
tree this walbridge runs from, else the same version from the package index) with the
Spark extra's libraries but pyspark, every package pinned to the version
installed here; ``spark_submit.py`` at the environment's top is a link to the
consumer's spark-submit entry; venv-pack archives it; the scratch directory goes.

Invariants:
- The archive holds an ordinary install, never this environment's files: an
  editable install (a checkout) is packed as a regular install of the same
  source, so executors never depend on a path of the machine that packed it.
  The build runs on a copy of what a build reads (the project files and the
  packages ``pyproject.toml`` lists): nothing is written into the checkout, and
  no stale build output of it can slip in.
- No pyspark inside: the cluster's Spark puts its own ``pyspark.zip`` on the
  Python path of the driver and every executor (their versions must match
  Spark's anyway).
- Pinned to what runs here (``--constraint``): the driver and the executors
  run the same library versions as the machine it was built on.
- The environment's ``bin/python`` links to this machine's base interpreter
  (venv does that): hosts need the same Python at the same path, or
  ``python_prefix`` names where it lives there.
"""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

import walbridge
from walbridge.runtime import SPARK_EXTRA, MissingExtra

log = logging.getLogger("walbridge.pack")

DIST = "walbridge"
ENTRY = "spark_submit.py"  # at the environment's top: the driver's primary resource for spark-submit
NOT_PACKED = {"pyspark", "py4j"}  # the cluster's Spark brings these


def source_tree(package_dir: Path) -> Path | None:
    """The source checkout walbridge is imported from (``package_dir`` is the
    ``walbridge`` package's directory), or None for an installed copy."""
    root = package_dir.parent
    return root if (root / "pyproject.toml").is_file() and (root / "setup.py").is_file() else None


def copy_source(root: Path, into: Path) -> Path:
    """What a build of walbridge reads, copied from the checkout ``root``."""
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    into.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(root / name, into / name)
    for package in sorted({p.split(".")[0] for p in packages}):  # a top package's folder holds its subpackages
        shutil.copytree(root / package, into / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return into


def install_requirements(requires: list[str], source: Path | None, version: str) -> list[str]:
    """What pip installs into the environment: walbridge itself (its source
    tree, else ``walbridge==version``) and the Spark extra's requirements but
    pyspark's (``requires``: walbridge's ``Requires-Dist`` lines)."""
    from packaging.requirements import Requirement  # optional extra: spark

    spark = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": "spark"}) \
                and not req.marker.evaluate({"extra": ""}) and req.name.lower() not in NOT_PACKED:
            spark.append(str(Requirement(f"{req.name}{req.specifier}")))
    return [str(source) if source is not None else f"{DIST}=={version}", *spark]


def constraints(installed: dict[str, str]) -> list[str]:
    """``name==version`` for every distribution installed here but walbridge
    and what the cluster's Spark brings."""
    return sorted(f"{name}=={version}" for name, version in installed.items()
                  if name.lower() not in NOT_PACKED | {DIST})


def _installed() -> dict[str, str]:
    return {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}


def pack(output: Path, python_prefix: str | None = None, force: bool = False) -> Path:
    """Build the archive at ``output`` (see the module's docstring)."""
    try:
        import venv_pack  # optional extra: spark
    except ImportError:
        raise MissingExtra(f"walbridge pack needs venv-pack, part of the spark extra: {SPARK_EXTRA}") from None
    output = Path(output).absolute()
    if output.exists() and not force:
        raise FileExistsError(f"{output} exists (pass --force to replace it)")
    checkout = source_tree(Path(walbridge.__file__).resolve().parent)
    scratch = Path(tempfile.mkdtemp(prefix="walbridge-pack-"))
    try:
        source = copy_source(checkout, scratch / "src") if checkout is not None else None
        wanted = install_requirements(importlib.metadata.requires(DIST) or [], source,
                                      importlib.metadata.version(DIST))
        env = scratch / "env"
        venv.EnvBuilder(with_pip=True, symlinks=True).create(env)
        pinned = scratch / "constraints.txt"
        pinned.write_text("\n".join(constraints(_installed())) + "\n")
        log.info("installing walbridge (from %s) and %s into a fresh environment, pinned to this one's versions",
                 checkout or "the package index", ", ".join(wanted[1:]))
        # pip's output goes to stderr with ours; stdout carries only the result.
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input",
                        "--disable-pip-version-check", "--constraint", str(pinned), *wanted],
                       check=True, stdout=sys.stderr)
        site = next((env / "lib").glob("python*/site-packages"))
        (env / ENTRY).symlink_to((site / DIST / "spark_submit.py").relative_to(env))
        log.info("archiving %s", output)
        venv_pack.pack(prefix=str(env), output=str(output), python_prefix=python_prefix, force=force)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    output.chmod(0o644)  # venv-pack writes through mkstemp (0600); Spark serves it to executors
    return output
