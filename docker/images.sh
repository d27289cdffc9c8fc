#!/usr/bin/env bash
# `make images`: the compose stack's images built offline with podman, from what this machine
# reaches (Debian's packages, PyPI, Maven Central), each step cached and skipped when done:
#   adstream-base:bookworm  Debian bookworm (debootstrap minbase) with Python 3.11 and this
#                           machine's certificate store, in place of python:3.11-slim
#   adstream-kafka:4.1.1    Java 17 and the Kafka jars (docker/kafka), in place of apache/kafka
#   adstream:local          the project (Dockerfile), from the pinned wheels of requirements.lock
#   adstream-infra:bookworm PostgreSQL and HAProxy from Debian's packages (docker/cluster/Dockerfile):
#                           the cluster's MLflow database and serving proxy (docker-compose.cluster.yml)
# Where a registry is reachable none of this is needed: `docker compose build` uses the official
# images (README "docker-compose up").
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/docker/podman/containers.conf}
cache=${ADSTREAM_IMAGE_CACHE:-$HOME/.cache/adstream}
kafka_version=$(sed -n 's/^KAFKA_VERSION = "\(.*\)"/\1/p' adstream/stack.py)
base=localhost/adstream-base:bookworm
say() { printf '\033[1m[images]\033[0m %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null || { say "$1 is not installed: $2"; exit 1; }; }

# the engine and tools, from Debian's packages (runc: podman's default crun refuses this machine's
# hybrid cgroups; docker-compose: docker/podman/compose.sh runs it against podman's socket)
packages=(podman runc debootstrap docker-compose)
missing=()
for tool in "${packages[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo)
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get install -y -q "${packages[@]}" >/dev/null 2>&1 \
    || { "${sudo[@]}" apt-get update -q >/dev/null && "${sudo[@]}" apt-get install -y -q "${packages[@]}" >/dev/null; } \
    || { say "could not install ${missing[*]}: apt-get install ${packages[*]}, then make images"; exit 1; }
fi

if ! podman image exists "$base"; then
  root=$(mktemp -d /var/tmp/adstream-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  say "base: debootstrap bookworm (minbase + python3) into $root"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
  rm -f "$root.log"
  # this machine's trust store (PyPI may be reached through a proxy with its own authority)
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

if ! podman image exists "localhost/adstream-kafka:$kafka_version"; then
  need mvn "apt-get install maven"
  libs="$cache/kafka-image-$kafka_version/libs"
  if [ ! -f "$libs/kafka-tools-$kafka_version.jar" ]; then
    say "kafka: jars from Maven Central into $libs"
    rm -rf "$libs.partial"
    mvn -q -B -f docker/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory="$libs.partial" -DincludeScope=runtime
    rm -rf "$libs" && mv "$libs.partial" "$libs"
  fi
  context=$(mktemp -d)
  cp docker/kafka/* adstream/kafka/log4j2.properties "$context/"
  cp -r "$libs" "$context/libs"
  say "kafka: podman build adstream-kafka:$kafka_version"
  podman build -q --build-arg BASE="$base" -t "adstream-kafka:$kafka_version" "$context" >/dev/null
  rm -rf "$context"
fi

# built every time, like the project below: the packages' layer is cached, and a changed
# haproxy.cfg or postgres-run.sh reaches the image (a check for the image alone kept an old one)
say "infra: podman build adstream-infra:bookworm (PostgreSQL, HAProxy; cached layers where nothing changed)"
podman build -q --build-arg BASE="$base" -t adstream-infra:bookworm docker/cluster >/dev/null

wheels="$cache/wheels"
mkdir -p "$wheels"
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python  # make images runs after make setup
if ! "$python" -m pip download -q --no-index --find-links "$wheels" --no-deps -r requirements.lock -d "$wheels" 2>/dev/null; then
  say "wheels: the pinned requirements into $wheels (PyPI)"
  "$python" -m pip wheel -q -r requirements.lock -w "$wheels"  # with what the pins need to install (setuptools)
fi
say "project: podman build adstream:local (cached layers where nothing changed)"
podman build -q --build-arg BASE="$base" --build-arg PIP_WHEELS=/wheels -v "$wheels:/wheels:ro" \
  -t adstream:local . >/dev/null
podman image prune -f >/dev/null  # the images this build replaced
podman images --filter reference='adstream*' --format '{{.Repository}}:{{.Tag}} {{.Size}}' >&2
