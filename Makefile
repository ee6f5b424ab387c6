# The two commands of the README. Both install what they need first (idempotent, fast when done).
PY ?= python3

.PHONY: setup demo test

setup:
	@bash scripts/setup.sh

demo: setup
	vq-gguf demo

test: setup
	vq-gguf build --server
	vq-gguf build --sanitize
	$(PY) -m pytest -q
