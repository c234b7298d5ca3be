# chunkledger: the README's commands. Each target creates .venv and installs what it needs from PyPI at
# the versions pinned in requirements.lock (tools/install.sh); `make lock` refreshes the lock.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
INSTALL := VENV=$(VENV) PYTHON=$(PYTHON) sh tools/install.sh
# What `make demo` needs (the builder, tiktoken, the fast tokenizer); everything else is for tests and benchmarks.
DEMO_EXTRAS := pipeline
ALL_EXTRAS  := pipeline,hf,gcs,jax,torch,dask,export,report,test,bench
LOCK_TOOLS  := .lock-venv
PIP_COMPILE := $(LOCK_TOOLS)/bin/pip-compile --strip-extras --allow-unsafe --no-emit-index-url \
               --no-emit-find-links --no-emit-trusted-host

.PHONY: venv demo test test-fast bench bench-quick bench-scale lock template clean

venv:
	@$(INSTALL) $(ALL_EXTRAS)

# Build a cache from the embedded sample corpus with cl100k_base (offline), summarize it, decode a few documents.
demo:
	@$(INSTALL) $(DEMO_EXTRAS)
	$(PY) -m pipelines.demo --output $(CURDIR)/demo-cache

test:
	@$(INSTALL) $(ALL_EXTRAS)
	$(PY) -m pytest -q tests

# The tests of every package without those marked slow (kills and chaos, benchmarks, multi-process JAX and
# torch, long multi-worker builds): a few minutes on 2 cores. `make test` (and CI) runs them all.
test-fast:
	@$(INSTALL) $(ALL_EXTRAS)
	$(PY) -m pytest -q -m "not slow" tests

bench:
	@$(INSTALL) $(ALL_EXTRAS)
	$(PY) -m benchmarks.run

bench-quick:
	@$(INSTALL) $(ALL_EXTRAS)
	$(PY) -m benchmarks.run --quick

# Caches and plans of 10^5 to 10^7 chunks (a 15T-token corpus is about 10^6): open, first batch, finalize, job graph
# -> benchmarks/scale.json and the "Scale" section of docs/BENCHMARKS.md (under 30 minutes).
bench-scale:
	@$(INSTALL) $(ALL_EXTRAS)
	$(PY) -m benchmarks.scale_bench

# Re-resolve every extra to the newest versions pyproject.toml allows (pip-tools' pip-compile, so pip's own
# resolver and configuration decide, as at install time), and the Dataflow image's subset from that lock.
# Run it when you add or widen a dependency, or to take upgrades on purpose; then `make test` and commit both files.
lock:
	@test -x $(LOCK_TOOLS)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_TOOLS) && \
		$(LOCK_TOOLS)/bin/pip install -q pip==26.3 pip-tools==7.6.2)
	$(PIP_COMPILE) --upgrade --all-extras -c tools/lock-constraints.txt -o requirements.lock pyproject.toml
	$(PIP_COMPILE) --extra pipeline --extra hf --extra gcs --extra dataflow -c requirements.lock \
		-o templates/requirements.txt pyproject.toml

# Print (or with RUN=1, run) the gcloud commands that build and launch the Dataflow Flex Template.
template:
	@$(MAKE) -s -C templates print RUN=$(RUN) PROJECT=$(PROJECT) REGION=$(REGION) BUCKET=$(BUCKET)

clean:
	rm -rf $(VENV) $(LOCK_TOOLS) demo-cache .pytest_cache .hypothesis
