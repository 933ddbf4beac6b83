#!/usr/bin/env bash
# The main job on the embedded default: installs what is missing, then starts
# PostgreSQL (demo schema), the Apache Kafka broker, the producer, the Spark consumer
# and a demo workload, with a live view. Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install
exec .venv/bin/walbridge up "$@"
