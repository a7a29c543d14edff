# The two commands: `make lab` opens the lessons, `make test` checks everything.
# Both create .venv on first use. The torch build is overridable, e.g.
#   make test TORCH_SPEC=torch==2.13.0      (a CPU build)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch>=2.11
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
NBVAL := -m pytest --nbval $(NOTEBOOKS) --sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider
# Stored outputs are made with one torch thread and no progress bars, so the figures and
# pictures stored with them do not depend on the core count. The tests need no settings:
# the text they compare is the same with bars on or off, on any CPU and thread count
# (figures from float kernels are masked, see amp_lessons.claims).
notebooks: export AMP_LESSONS_PROGRESS := 0
notebooks: export OMP_NUM_THREADS := 1

.SECONDEXPANSION:
.PHONY: lab test test-unit test-notebooks test-distributed test-browser browser-lab test-colab test-matrix lint notebooks pairs \
	bench bench-widgets doctor gpu-check claims-report clean matrix-native matrix-avx2 matrix-threads

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

lab: $(STAMP)  ## open the lessons in JupyterLab
	cd notebooks && $(abspath $(BIN))/jupyter lab 00_start_here.ipynb $(LAB_ARGS)

test: lint pairs test-unit test-notebooks  ## everything a learner's clone must pass

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks notebooks tools

pairs: $(STAMP)  ## each notebook and its jupytext .py pair agree
	$(BIN)/python tools/nbtool.py check-pairs $(NOTEBOOKS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not browser" -q

test-notebooks: $(STAMP)  ## nbval: re-run every lesson and compare with the stored outputs
	$(BIN)/python $(NBVAL)

test-distributed: $(STAMP)  ## lesson 07's 2-process torch.distributed tests alone
	$(BIN)/python -m pytest tests -m distributed -q -p no:cacheprovider

test-browser: $(STAMP)  ## the widgets in JupyterLab in headless Chromium, and under Colab's ipywidgets 7.7.1
	$(MAKE) --no-print-directory -j2 --output-sync=target browser-lab test-colab

browser-lab:
	AMP_LESSONS_BROWSER=1 $(BIN)/python -m pytest tests -m browser -q

COLAB_VENV := .venv-colab
$(COLAB_VENV)/.installed: pyproject.toml
	test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(COLAB_VENV)/bin/python -m pip install --quiet -e . "ipywidgets==7.7.1" pytest
	touch $@

test-colab: $(COLAB_VENV)/.installed  ## the widget tests under ipywidgets 7.7.1, the version Colab pins
	AMP_LESSONS_PROGRESS=0 AMP_LESSONS_EXPECT_IPYWIDGETS=7.7.1 $(COLAB_VENV)/bin/python -m pytest tests/test_widgets.py -q -p no:cacheprovider

# --- the matrix: the stored outputs must hold on other CPUs, thread counts and torch releases ---
# Each run logs every verdict with its figures to artifacts/claims/<config>.jsonl; `make
# claims-report` tabulates them (the evidence for each verdict's margin). The runs are
# independent, so two go at a time (one torch thread each, except the 2-thread run).
MATRIX_TORCH ?= 2.11.0 2.14.1
CLAIMS := $(abspath artifacts/claims)
matrix-env = AMP_LESSONS_CONFIG=$(1) AMP_LESSONS_CLAIMS_LOG=$(CLAIMS)/$(1).jsonl
MATRIX_JOBS := $(foreach v,$(MATRIX_TORCH),matrix-lessons-$(v) matrix-unit-$(v)) \
	matrix-native matrix-avx2 matrix-threads

test-matrix: $(STAMP)  ## nbval under other CPU kernels and thread counts, then other torch releases
	rm -rf $(CLAIMS) && mkdir -p $(CLAIMS)
	$(MAKE) --no-print-directory -j2 --output-sync=target $(MATRIX_JOBS)
	$(BIN)/python tools/claims_report.py $(CLAIMS)

matrix-native:
	@echo "== (a) native kernels, 1 thread, no progress bars"
	$(call matrix-env,native) OMP_NUM_THREADS=1 AMP_LESSONS_PROGRESS=0 $(BIN)/python $(NBVAL)

matrix-avx2:
	@echo "== (b) x86 kernels held to AVX2, as on a laptop without AVX-512"
	$(call matrix-env,avx2) ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 $(BIN)/python $(NBVAL)

matrix-threads:
	@echo "== (c) 2 threads, progress bars on"
	$(call matrix-env,threads2) OMP_NUM_THREADS=2 AMP_LESSONS_PROGRESS=1 $(BIN)/python $(NBVAL)

# One torch release (e.g. 2.11.0) in its own venv (.venv-torch2.11): the unit tests, and
# every lesson compared with its stored outputs.
torch-venv = .venv-torch$(basename $(1))
matrix-unit-%: $$(call torch-venv,%)/.installed
	@echo "== torch $*: unit tests"
	OMP_NUM_THREADS=1 $(call torch-venv,$*)/bin/python -m pytest tests -m "not browser" -q -p no:cacheprovider

matrix-lessons-%: $$(call torch-venv,%)/.installed
	@echo "== torch $*: every lesson"
	$(call matrix-env,torch$*) OMP_NUM_THREADS=1 $(call torch-venv,$*)/bin/python $(NBVAL)

.venv-torch%/.installed: pyproject.toml
	test -x .venv-torch$*/bin/python || $(PYTHON) -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install --quiet "torch==$(filter $*.%,$(MATRIX_TORCH))"
	.venv-torch$*/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

claims-report:  ## the verdicts' figures under each matrix configuration
	$(BIN)/python tools/claims_report.py $(CLAIMS)

# --- a GPU (or any machine) without Jupyter: every lesson as a script, every verdict, doctor, bench ---
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:  ## run on a CUDA machine: every lesson as a script, every verdict, the device checks, doctor, bench
	PYTHONPATH=src MPLBACKEND=Agg AMP_LESSONS_PROGRESS=0 $(GPU_PYTHON) -m amp_lessons selfcheck $(SELFCHECK_ARGS)

notebooks: $(STAMP)  ## re-execute every lesson top to bottom in a fresh kernel and store its outputs
	$(BIN)/python tools/nbtool.py execute $(or $(NB),$(NOTEBOOKS))

bench: $(STAMP)
	$(BIN)/python -m amp_lessons bench $(BENCH_ARGS)

bench-widgets: $(STAMP)  ## every widget control's redraw time in JupyterLab in Chromium (run it alone)
	$(BIN)/python benchmarks/widget_latency.py $(BENCH_ARGS)

doctor: $(STAMP)
	$(BIN)/python -m amp_lessons doctor

clean:
	rm -rf $(VENV) $(COLAB_VENV) .venv-torch* .pytest_cache .ruff_cache artifacts

# --- mutation testing: small bugs planted in each module, counted when its own tests miss them (long; not in CI) ---
MUTANTS ?= scaling clipping claims
.PHONY: mutants
mutants: $(STAMP)  ## mutmut over $(MUTANTS), each against its own tests/test_<module>.py; prints the score per module
	$(BIN)/python tools/mutants.py $(MUTANTS) $(MUTANTS_ARGS)
