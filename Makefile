# Quick start: `make bench` (set up, then the standalone benchmark) and `make test`.
.PHONY: bench test

bench: .venv/.ready
	.venv/bin/moebalance bench

test: .venv/.ready
	.venv/bin/python -m pytest

.venv/.ready: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh test
	touch $@
