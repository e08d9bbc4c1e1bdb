# Quick start: `make bench` (set up, then the standalone benchmark) and `make test`.
.PHONY: bench test lint

# The benchmark needs no test extras and only the planner's and the EPLB drop-in's kernels (it
# times both): its set-up is the shorter one; `make test` adds the extras and compiles every kernel.
bench: .venv/.ready-bench
	.venv/bin/moebalance bench

test: .venv/.ready
	.venv/bin/python -m pytest

# ruff at line length 100 (rules and the reasons for those left out: pyproject.toml)
lint: .venv/.ready
	.venv/bin/ruff check moebalance tests examples benchmarks scripts

.venv/.ready: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh test
	touch $@ .venv/.ready-bench

.venv/.ready-bench: pyproject.toml scripts/setup.sh
	KERNELS=planner,rebalance_experts bash scripts/setup.sh ""
	touch $@
