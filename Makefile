# The two commands of the README. Both install what they need first (idempotent, fast when done).
PY ?= python3

.PHONY: setup setup-test demo test

setup:
	@bash scripts/setup.sh

setup-test:
	@bash scripts/setup.sh --test

demo: setup
	vq-gguf demo $(DEMO_ARGS)

test: setup-test
	vq-gguf build --server --rpc
	vq-gguf build --sanitize
	vq-gguf build --cross aarch64
	vq-gguf build --portable
	$(PY) -m pytest -q --durations=25
