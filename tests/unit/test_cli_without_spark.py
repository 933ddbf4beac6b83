"""The Spark consumer is an optional extra: without pyspark, the commands that
need it say in one line how to install it and exit non-zero, before they
start anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def without_pyspark(tmp_path) -> dict[str, str]:
    """An environment in which ``import pyspark`` fails as it does where the
    extra is not installed."""
    hidden = tmp_path / "hide"
    (hidden / "pyspark").mkdir(parents=True)
    (hidden / "pyspark" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pyspark'\", name='pyspark')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), str(ROOT)])}


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "wb.toml"
    path.write_text('[source]\ndsn = "postgresql://app@127.0.0.1:1/app"\n'
                    '[kafka]\nbootstrap_servers = "127.0.0.1:1"\n'
                    '[[shapes]]\ntable = "public.orders"\n'
                    '[consumer]\ntarget_dsn = "postgresql://app@127.0.0.1:1/warehouse"\n')
    return path


@pytest.mark.parametrize("command", [["consumer", "-c", "{config}"], ["up", "--data-dir", "{data}"],
                                     ["up", "-c", "{config}", "--data-dir", "{data}"]],
                         ids=["consumer", "up-embedded", "up-config"])
def test_a_command_that_needs_spark_says_how_to_install_it(tmp_path, without_pyspark, command):
    args = [a.format(config=_config(tmp_path), data=tmp_path / "up") for a in command]
    done = subprocess.run([sys.executable, "-m", "walbridge", *args], env=without_pyspark, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode != 0
    assert out.splitlines() == ["walbridge: the Spark consumer needs the spark extra (pyspark is missing): "
                                "pip install 'walbridge[spark]'"], out
    assert not (tmp_path / "up").exists(), "nothing may start before the check"


def test_commands_without_spark_still_work(tmp_path, without_pyspark):
    done = subprocess.run([sys.executable, "-m", "walbridge", "check-config", "-c", str(_config(tmp_path))],
                          env=without_pyspark, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("config ok: 1 shape(s)")
