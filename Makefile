# chunkledger: the README's commands. Each target creates .venv and installs from PyPI as needed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
EXTRAS ?= pipeline,gcs,jax,test,bench

.PHONY: venv demo test bench bench-quick template clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*
	@touch $@

# Build a cache from the embedded sample corpus with cl100k_base (offline), summarize it, decode a few documents.
demo: $(STAMP)
	$(PY) -m pipelines.demo --output $(CURDIR)/demo-cache

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m benchmarks.run

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

# Print (or with RUN=1, run) the gcloud commands that build and launch the Dataflow Flex Template.
template:
	@$(MAKE) -s -C templates print RUN=$(RUN) PROJECT=$(PROJECT) REGION=$(REGION) BUCKET=$(BUCKET)

clean:
	rm -rf $(VENV) demo-cache .pytest_cache .hypothesis
