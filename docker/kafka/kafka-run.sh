#!/bin/bash
# The Kafka image's entrypoint: settings from the environment as the official apache/kafka image
# takes them (KAFKA_FOO_BAR=v -> foo.bar=v), the log folder formatted once (KRaft), then the broker.
set -euo pipefail
config=/opt/kafka/config/server.properties
: > "$config"
while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS) continue ;;
    KAFKA_*) key=${name#KAFKA_}; key=${key,,}; echo "${key//_/.}=${value}" >> "$config" ;;
  esac
done < <(env)
grep -q '^log.dirs=' "$config" || echo "log.dirs=/var/lib/kafka/data" >> "$config"
logs=$(sed -n 's/^log.dirs=//p' "$config" | cut -d, -f1)
java=(java -cp '/opt/kafka/libs/*' -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties)
if [ ! -f "$logs/meta.properties" ]; then
  "${java[@]}" kafka.tools.StorageTool format -t "${CLUSTER_ID:-$("${java[@]}" kafka.tools.StorageTool random-uuid)}" -c "$config"
fi
# shellcheck disable=SC2086
exec "${java[@]}" ${KAFKA_HEAP_OPTS:--Xmx512m -Xms512m} -XX:+UseG1GC kafka.Kafka "$config"
