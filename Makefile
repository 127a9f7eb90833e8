# Everything a fresh clone needs: `make demo` runs the star on this machine, `make test` tests it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch, pinned: a looser spec makes pip fetch a multi-GB CUDA build.
# On a GPU host, install your CUDA torch first and run `make install TORCH_SPEC=`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_TARGETS ?= 2

.PHONY: install demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# eagle-llm pins old gradio/openai/protobuf releases that its head class never uses: install it
# without dependencies (the EAGLE backend needs only torch and transformers at run time).
EAGLE_SPEC ?= eagle-llm==1.2.1

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(if $(TORCH_SPEC),$(BIN)/pip install --disable-pip-version-check '$(TORCH_SPEC)')
	$(BIN)/pip install --disable-pip-version-check -e '.[test,eagle]'
	$(BIN)/pip install --disable-pip-version-check --no-deps '$(EAGLE_SPEC)'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/starsd-draftd demo --targets $(DEMO_TARGETS)

test: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
