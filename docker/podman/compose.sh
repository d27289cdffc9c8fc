#!/usr/bin/env bash
# docker-compose.yml on podman, on a machine without Docker's engine, systemd or a registry:
# Debian's docker-compose (1.29) talks to podman's Docker-compatible API on a socket of the
# project's, and a small loop runs the containers' health checks (podman hands them to systemd
# timers, and there is no systemd here). `make images` first. Usage is docker-compose's:
#   docker/podman/compose.sh up -d          the stack (KAFKA_IMAGE: the Kafka image make images built)
#   docker/podman/compose.sh --profile replay up replay
#   docker/podman/compose.sh down -v        and the engine's socket and health loop stop too
set -euo pipefail
cd "$(dirname "$0")/../.."
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/docker/podman/containers.conf}
kafka_version=$(sed -n 's/^KAFKA_VERSION = "\(.*\)"/\1/p' adstream/stack.py)
export KAFKA_IMAGE=${KAFKA_IMAGE:-localhost/adstream-kafka:$kafka_version}
project=${COMPOSE_PROJECT_NAME:-adstream}
state=$PWD/.state/podman
mkdir -p "$state"
socket=$state/podman.sock
export DOCKER_HOST=unix://$socket

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! alive "$state/service.pid"; then
  rm -f "$socket"
  podman system service --time=0 "unix://$socket" >"$state/service.log" 2>&1 &
  echo $! >"$state/service.pid"
  for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
  [ -S "$socket" ] || { echo "podman system service did not open $socket: see $state/service.log" >&2; exit 1; }
fi
if ! alive "$state/health.pid"; then
  (
    # the containers still starting (or failing) every 3 s, as compose's depends_on waits on them;
    # every container every 30 s, so a healthy one turning unhealthy shows
    round=0
    while true; do
      filters=(--filter health=starting --filter health=unhealthy)
      [ $((round % 10)) = 0 ] && filters=()
      for id in $(podman ps -q --filter "label=com.docker.compose.project" "${filters[@]}"); do  # every project's
        podman healthcheck run "$id" >/dev/null 2>&1 || true
      done
      round=$((round + 1))
      sleep 3
    done
  ) >/dev/null 2>&1 &
  echo $! >"$state/health.pid"
fi

status=0
docker-compose -p "$project" "$@" || status=$?
# `down` (after options such as --env-file) ends the engine's socket and the health loop too
down=0
for arg in "$@"; do [ "$arg" = down ] && down=1 && break; done
if [ $down = 1 ]; then
  for pid in health service; do
    alive "$state/$pid.pid" && kill "$(cat "$state/$pid.pid")"
    rm -f "$state/$pid.pid"
  done
fi
exit $status
