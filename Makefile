# Everything runs from .venv in the repo root; `make install` creates it on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The torch requirement: the CPU wheel by default; `make install TORCH=torch` for a CUDA build.
TORCH  ?= torch==2.13.0
# Where the Multi30k files come from: upstream by default, a local folder or URL when set.
NMT_DATA_MIRROR ?=
export NMT_DATA_MIRROR

.PHONY: install test test-fast test-avx2 lint format demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

lint: install
	$(BIN)/ruff check nmt tests benchmarks
	$(BIN)/ruff format --check nmt tests benchmarks

format: install
	$(BIN)/ruff format nmt tests benchmarks
	$(BIN)/ruff check --fix nmt tests benchmarks

test: lint
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory test-avx2

# The tests that train or compare numbers, again with torch's and oneDNN's AVX2 kernels (CTranslate2's
# too), so that a machine with AVX-512 or AMX also checks what an AVX2-only CPU computes: which of the
# three CI lands on is chance. On an AVX2-only CPU that is what the suite just ran. The compiler's cache
# is a fresh one: inductor does not key it on ATEN_CPU_CAPABILITY, and a training step compiled under
# AVX-512 aten, read back under AVX2 aten, indexed garbage (seen with torch 2.13.0).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 CT2_FORCE_CPU_ISA=AVX2
test-avx2: install
	@if grep -qw -e avx512f -e amx_tile /proc/cpuinfo 2>/dev/null; then \
	  echo "$(AVX2_ENV) pytest -m numerics"; \
	  cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	  $(AVX2_ENV) TORCHINDUCTOR_CACHE_DIR=$$cache $(BIN)/python -m pytest -m numerics -p no:cacheprovider; \
	else echo "test-avx2: this CPU has no AVX-512 or AMX; the suite already ran its AVX2 kernels"; fi

# The inner loop: every test but those marked slow (trainings, multi-second deadlines and signals), in one
# pytest process per core (pytest-xdist), each test file kept in one process so that its module fixtures
# are built once; the trained model every file shares is trained once (tests/conftest.py, shared_once).
test-fast: install
	$(BIN)/python -m pytest -m "not slow" -n auto --dist loadfile

# The whole pipeline on Multi30k EN-DE on the CPU: fetch, preprocess, train, average, translate, score.
demo: install
	$(BIN)/nmt run recipes/multi30k-en-de.yaml $(if $(NMT_DATA_MIRROR),--mirror $(NMT_DATA_MIRROR))

clean:
	rm -rf $(VENV) runs .pytest_cache

# The GPU check (benchmarks/gpu_check.py): the CUDA tests and the GPU figures in one report, at most 9
# minutes on a GPU. It needs no .venv: a bare CUDA machine runs it from the source tree with python3.
GPU_CHECK_OUT    ?= runs/gpu-check
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=. $(GPU_CHECK_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)
