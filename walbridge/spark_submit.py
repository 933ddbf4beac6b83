"""The Spark consumer's ``spark-submit`` entry point::

    spark-submit --master spark://host:7077 walbridge/spark_submit.py -c walbridge.toml

spark-submit runs this file as a script, so it first makes the package it
belongs to importable (a source checkout needs that; an installed walbridge
does not), then hands over to :func:`walbridge.cli.spark_submit_main`.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from walbridge.cli import spark_submit_main  # importable only after the line above

    sys.exit(spark_submit_main())
