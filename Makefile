# One command each: `make run` and `make test` create .venv and install on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check fmt lint types bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "uv>=0.4,<1" \
	  || $(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	test -x $(BIN)/uv && $(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]' || true
	$(BIN)/python -c "import aisp, onnxruntime, pytest, hypothesis"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/aisp run examples/fraud/pipeline.py --events 2000000 --rate 0 --output /dev/null

test: $(STAMP)
	$(BIN)/python -m pytest -q

check: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

fmt: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_fraud.py --events 1000000 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
