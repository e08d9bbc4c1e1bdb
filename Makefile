# Quick start: `make bench` (set up, then the standalone benchmark) and `make test`.
.PHONY: bench test

# The benchmark needs no test extras and only the planner's kernels: its set-up is the shorter
# one; `make test` adds the extras and compiles every kernel.
bench: .venv/.ready-bench
	.venv/bin/moebalance bench

test: .venv/.ready
	.venv/bin/python -m pytest

.venv/.ready: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh test
	touch $@ .venv/.ready-bench

.venv/.ready-bench: pyproject.toml scripts/setup.sh
	KERNELS=planner bash scripts/setup.sh ""
	touch $@
