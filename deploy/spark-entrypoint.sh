#!/usr/bin/env bash
# Entrypoint of the walbridge image. Spark's Kubernetes scheduler starts the
# driver pod with `driver <spark-submit arguments>` and each executor pod with
# `executor`, handing the executor its settings in SPARK_* environment
# variables; both are turned into the process Spark expects here. Any other
# command (docker compose's walbridge, spark-class, spark-submit) runs as given.
set -euo pipefail

case "${1:-}" in
  driver)
    shift
    exec spark-submit --deploy-mode client \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
      --conf "spark.executorEnv.SPARK_DRIVER_POD_IP=${SPARK_DRIVER_BIND_ADDRESS}" \
      "$@"
    ;;
  executor)
    shift
    # SPARK_JAVA_OPT_0, _1, ...: the executor's JVM options, in order.
    java_opts=()
    while IFS= read -r name; do
      java_opts+=("${!name}")
    done < <(compgen -e | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n)
    exec java "${java_opts[@]}" -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
      -cp "${SPARK_CONF_DIR:-/opt/spark/conf}:${SPARK_HOME}/jars/*" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "${SPARK_DRIVER_URL}" \
      --executor-id "${SPARK_EXECUTOR_ID}" \
      --cores "${SPARK_EXECUTOR_CORES}" \
      --app-id "${SPARK_APPLICATION_ID}" \
      --hostname "${SPARK_EXECUTOR_POD_IP}" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" \
      --podName "${SPARK_EXECUTOR_POD_NAME}"
    ;;
  *)
    exec "$@"
    ;;
esac
