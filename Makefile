# The two commands of the README: `make demo` and `make test`. Both set up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench bench-accuracy bench-store bench-merge bench-serving bench-step peers bench-peer lock down clean images compose-up compose-down

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $@

demo: setup
	$(BIN)/adstream demo --json .state/demo.json

test: setup images
	$(BIN)/python -m pytest

# the compose stack's images, built offline with podman (docker/images.sh: Debian's packages, PyPI,
# Maven Central; each step cached), the cluster's PostgreSQL + HAProxy image too; the compose and cluster
# tests of `make test` run them
images: setup
	bash docker/images.sh

# docker-compose.yml on podman (docker/podman/compose.sh); with Docker: `docker compose up -d`
compose-up: images
	docker/podman/compose.sh up -d

compose-down:
	docker/podman/compose.sh down

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy stream store trainer serving adstream bench

bench: setup
	$(BIN)/adstream bench pipeline --json .state/bench-pipeline.json

bench-accuracy: setup
	$(BIN)/adstream bench accuracy --json .state/bench-accuracy.json

bench-store: setup
	$(BIN)/adstream bench store --json .state/bench-store.json

bench-merge: setup
	$(BIN)/adstream bench merge --json .state/bench-merge.json

bench-serving: setup
	$(BIN)/adstream bench serving --json .state/bench-serving.json

bench-step: setup
	$(BIN)/adstream bench step --json .state/bench-step.json

# the peers `adstream bench step --peer NAME` times beside adstream, each in an environment of its
# own (TorchRec's FBGEMM does not load under the project's torch); not part of `make test`
PEERS := .peers
peers: $(PEERS)/torchrec/.installed

$(PEERS)/torchrec/.installed: bench/peers/torchrec.lock
	test -x $(PEERS)/torchrec/bin/python || $(PY) -m venv $(PEERS)/torchrec
	$(PEERS)/torchrec/bin/pip install -q --no-deps -r bench/peers/torchrec.lock
	$(PEERS)/torchrec/bin/python -c "import torchrec.modules.fused_embedding_modules, fbgemm_gpu"
	touch $@

bench-peer: setup peers
	$(BIN)/adstream bench step --batch-sizes 4096 --peer torchrec --json .state/bench-step-torchrec.json

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v '^adstream' > requirements.lock.new && mv requirements.lock.new requirements.lock

down:
	$(BIN)/adstream down

clean: down
	rm -rf .state
