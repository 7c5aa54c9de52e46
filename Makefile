# tilecast: `make demo` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tilecast-installed
# This machine and CI take PyTorch's CPU build from local disk; a GPU machine keeps its own
# CUDA build: `make install TORCH_SPEC=` (empty) installs nothing for torch.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist); a file's tests stay on one worker, so its module fixtures (servers,
# loaded pipelines) start once. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist loadfile)

.PHONY: install demo lint format test test-fast test-grid bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -P -m tilecast.launcher.demo

# ruff's lint and format check (config in pyproject.toml); `make format` applies both.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: install lint
	$(PY) -P -m pytest -q $(XDIST) -m "not grid" $(PYTEST_ARGS)

test-fast: install
	$(PY) -P -m pytest -q $(XDIST) -m "not slow and not grid" $(PYTEST_ARGS)

# Every served row of the compatibility grid on a 2-rank torchrun server (~15 s a row; not in `make test`).
test-grid: install
	$(PY) -P -m pytest -q $(XDIST) -m grid $(PYTEST_ARGS)

# CPU-capable benchmark; the GPU ones are `tilecast bench k6sr|attention|placement` (see README).
bench: install
	$(PY) -m tilecast bench batching --model-path tiny/flux --num-clients 8 --requests-per-client 3

clean:
	rm -rf $(VENV) demo_outputs outputs .pytest_cache
