# Set-up is part of every target: a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint bench soak clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch: respect one that is importable; otherwise the pinned CPU build (never unpinned).
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,fsspec]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/trainguard demo

# pytest-xdist workers (0: one process). Most tests wait on the processes they start (ranks, agents,
# servers), so 3 workers on 2 cores: 757 s in one process, 390 s with 3 (session 39, this machine).
# A module's tests stay on one worker (loadscope): its fixtures (an S3 server) start once.
TEST_WORKERS ?= 3

test: setup
	$(VPY) -m ruff check src tests bench
	$(VPY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope -m "not slow" tests

# The tests left out of `make test` for its run time (more seeds, layouts and world sizes; minutes).
test-slow: setup
	$(VPY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope -m slow -k "not soak" tests

lint: setup
	$(VPY) -m ruff check src tests bench

bench: setup
	$(VPY) -m bench.run
	$(VPY) -m bench.stall
	$(VPY) -m bench.per_byte
	$(VPY) -m bench.planner_scale
	$(VPY) -m bench.ram_tier --size-gb 3
	$(VPY) -m bench.gc_full
	# the verdicts on issues 6 and 4, from the three results above (README's targets table)
	$(VPY) -m bench.targets bench/results/latest.json --stall bench/results/stall.json \
		--per-byte bench/results/per_byte.json | tee bench/results/targets.md

soak: setup
	$(VPY) -m pytest -q -s -p no:cacheprovider -m slow -k soak tests

clean:
	rm -rf $(VENV) build *.egg-info
