# rbs-bench. `make quickstart` runs the main job on the embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, so that the package's own `torch` requirement is already met. On a CPU machine
# without a local wheel, add TORCH_INDEX=https://download.pytorch.org/whl/cpu (no CUDA download);
# on a GPU cluster, install your CUDA build of torch into the venv and run `make install TORCH=`.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= dev

.PHONY: install quickstart ruler-budget test test-gpu lint report tables figures bench-attention gpu-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

# The README's first command: RULER budget grid (dense, rbs, centroid, full_l2) on the tiny model.
quickstart ruler-budget: install
	$(PY) -m rbs_bench +experiment=ruler_budget

test: install
	$(PY) -m pytest -q

# GPU-marked tests (FlexAttention, CUDA paths); run on a machine with a CUDA device.
test-gpu: install
	$(PY) -m pytest -q -m gpu

# Paper-layout tables (Markdown + LaTeX) from the run records, with the paper's values beside ours
# where the setting matches (results/paper/paper_values.csv). Writes results/tables/.
tables: install
	$(PY) -m rbs_bench.tables

# Figures redrawn from committed runs' CSVs (the mean-dilution observations, Figure 1).
figures: install
	$(PY) -m rbs_bench.observations

# Standalone prefill attention: dense SDPA/FlexAttention vs RBS at 2/5/10% density, 16K-256K.
# Writes results/speed/attention_<gpu>.csv and .png. Needs a CUDA device.
bench-attention: install
	$(PY) -m rbs_bench.bench.attention

# The gpu tests and the attention benchmark in one call (one GPU lease).
gpu-check: install
	$(PY) -m rbs_bench.bench.gpu_check

lint: install
	$(PY) -m ruff check src kernels baselines tests

# Rebuild every experiment's summary table and plot from the committed run records.
report: install
	$(PY) -m rbs_bench.report
