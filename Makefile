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
# `make lab` opens a working copy of the lessons in LAB_DIR (git-ignored), so a learner's runs
# never touch the stored ones; LAB_DIR=notebooks opens the stored lessons, to edit the course.
LAB_DIR ?= lab
# jupyter refuses to run as root (Docker, cloud GPU boxes) unless given --allow-root.
ROOT_ARG := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)
# A job that cannot run here (its interpreter is missing) says so, and is listed again at the end.
SKIPPED ?= $(abspath artifacts/skipped.txt)
skip = mkdir -p $(dir $(SKIPPED)) && echo "!! SKIPPED $(1): $(2)" | tee -a $(SKIPPED)

.SECONDEXPANSION:
.PHONY: lab reset test test-unit test-notebooks test-distributed test-browser browser-lab test-colab test-matrix \
	lint notebooks pairs bench bench-widgets doctor gpu-check claims-report clean matrix-native matrix-avx2 \
	matrix-threads newest-torch

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,lab]"
	touch $@

lab: $(STAMP)  ## open a working copy of the lessons (lab/) in JupyterLab
	$(BIN)/python tools/nbtool.py lab-copy $(LAB_DIR) $(NOTEBOOKS)
	@$(if $(ROOT_ARG),echo "running as root: jupyter lab gets --allow-root")
	cd $(LAB_DIR) && $(abspath $(BIN))/jupyter lab 00_start_here.ipynb --LabApp.news_url=None $(ROOT_ARG) $(LAB_ARGS)

reset: $(STAMP)  ## put back the stored outputs of each lesson a run saved over (its code and prose are kept)
	$(BIN)/python tools/nbtool.py reset $(NOTEBOOKS)

test: lint pairs test-unit test-notebooks  ## everything a learner's clone must pass

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks notebooks tools

pairs: $(STAMP)  ## each notebook and its jupytext .py pair agree, and its outputs are the stored ones
	$(BIN)/python tools/nbtool.py check-pairs $(NOTEBOOKS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not browser" -q

test-notebooks: $(STAMP)  ## nbval: re-run every lesson and compare with the stored outputs
	$(BIN)/python $(NBVAL)

test-distributed: $(STAMP)  ## lesson 07's 2-process torch.distributed tests alone
	$(BIN)/python -m pytest tests -m distributed -q -p no:cacheprovider

test-browser: $(STAMP)  ## the widgets in JupyterLab in headless Chromium, and under Colab's Python and ipywidgets
	$(MAKE) --no-print-directory -j2 --output-sync=target browser-lab test-colab

browser-lab:
	AMP_LESSONS_BROWSER=1 $(BIN)/python -m pytest tests -m browser -q

# --- other interpreters: Colab's, and the newest ---
# Colab's setup: its Python (3.12), its torch (2.11 when the course was written), the
# ipywidgets it pins (7.7.1) and its classic Notebook (6.5; ipywidgets 7's widgetsnbextension
# would take Notebook 7, which brings JupyterLab), without JupyterLab. The interpreters come
# from pyenv, or the PATH.
PYENV_ROOT ?= $(HOME)/.pyenv
find-python = $(or $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python))),$(shell command -v python$(1) 2>/dev/null))
PYTHON_COLAB ?= $(call find-python,3.12)
PYTHON_NEWEST ?= $(call find-python,3.13)
COLAB_TORCH ?= 2.11.0
COLAB_WIDGETS ?= 7.7.1
COLAB_NOTEBOOK ?= <7
COLAB_VENV := .venv-colab
$(COLAB_VENV)/.installed: pyproject.toml
	test -x $(COLAB_VENV)/bin/python || $(PYTHON_COLAB) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet "torch==$(COLAB_TORCH)"
	$(COLAB_VENV)/bin/python -m pip install --quiet -e ".[dev]" "ipywidgets==$(COLAB_WIDGETS)" "notebook$(COLAB_NOTEBOOK)"
	$(COLAB_VENV)/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('jupyterlab') is not None)" \
		|| { echo "jupyterlab got into $(COLAB_VENV), which Colab does not have: a dependency pulls it in"; exit 1; }
	touch $@

# The newest torch release pip can see, on Python 3.13. A pip configuration can cap torch (this
# machine's does, with a constraints file), so these installs read none; NEWEST_PIP_ENV= keeps yours.
NEWEST_VENV := .venv-newest
NEWEST_PIP_ENV ?= PIP_CONFIG_FILE=/dev/null
$(NEWEST_VENV)/.installed: pyproject.toml
	test -x $(NEWEST_VENV)/bin/python || $(PYTHON_NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP_ENV) $(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade torch
	$(NEWEST_PIP_ENV) $(NEWEST_VENV)/bin/python -m pip install --quiet -e ".[dev,lab]"
	touch $@

newest-torch: $(NEWEST_VENV)/.installed  ## bring .venv-newest to the newest torch release pip can see
	$(NEWEST_PIP_ENV) $(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade torch
	@echo "== newest: torch $$($(NEWEST_VENV)/bin/python -c 'import torch; print(torch.__version__)') is the newest release pip sees"

missing-python = no Python $(1) here ($(2)): install it (pyenv install $(1)) or name one, make $@ $(3)=/path/to/python$(1)

test-colab: $(if $(PYTHON_COLAB),$(COLAB_VENV)/.installed)  ## the widget tests under Colab's Python and ipywidgets 7.7.1
ifeq ($(PYTHON_COLAB),)
	@$(call skip,$@,$(call missing-python,3.12,Colab's,PYTHON_COLAB))
else
	AMP_LESSONS_PROGRESS=0 AMP_LESSONS_EXPECT_IPYWIDGETS=$(COLAB_WIDGETS) $(COLAB_VENV)/bin/python -m pytest tests/test_widgets.py -q -p no:cacheprovider
endif

# --- the matrix: the stored outputs must hold on other CPUs, thread counts, torch releases, Pythons ---
# Each run logs every verdict with its figures to artifacts/claims/<config>.jsonl; `make
# claims-report` tabulates them (the evidence for each verdict's margin). The runs are
# independent, so two go at a time (one torch thread each, except the 2-thread run). Every job
# prints its wall time. The configurations of the unit tests and the lessons:
#   colab        Python 3.12, torch $(COLAB_TORCH), ipywidgets $(COLAB_WIDGETS), Notebook 6, no JupyterLab (.venv-colab)
#   newest       Python 3.13, the newest torch pip can see, upgraded on every run (.venv-newest)
#   X.Y.Z        $(PYTHON), each torch release named in MATRIX_TORCH (.venv-torchX.Y), e.g.
#                make test-matrix MATRIX_TORCH="2.12.1 2.14.1"
# `make test` runs a third release (TORCH_SPEC; CI's is 2.13) on a third Python ($(PYTHON)).
# A release more adds its venv (a CUDA build of torch, GBs) and two jobs of 3 to 4 minutes each
# on CI's 2 cores, so CI names none.
MATRIX_TORCH ?=
MATRIX_CONFIGS := colab newest $(MATRIX_TORCH)
CLAIMS := $(abspath artifacts/claims)
matrix-env = AMP_LESSONS_CONFIG=$(1) AMP_LESSONS_CLAIMS_LOG=$(CLAIMS)/$(1).jsonl
timed = t0=$$(date +%s); $(1); rc=$$?; echo "== $@: $$(( $$(date +%s) - t0 )) s, exit status $$rc"; exit $$rc
MATRIX_JOBS := $(foreach c,$(MATRIX_CONFIGS),matrix-lessons-$(c) matrix-unit-$(c)) \
	matrix-native matrix-avx2 matrix-threads

test-matrix: $(STAMP)  ## nbval under other CPU kernels and thread counts, then other torch releases and Pythons
	rm -rf $(CLAIMS) && mkdir -p $(CLAIMS)
	$(MAKE) --no-print-directory -j2 --output-sync=target $(MATRIX_JOBS)
	$(BIN)/python tools/claims_report.py $(CLAIMS)
	@test ! -s $(SKIPPED) || { echo; echo "!! Not run on this machine:"; cat $(SKIPPED); }

matrix-native:
	@echo "== (a) native kernels, 1 thread, no progress bars"
	@$(call timed,$(call matrix-env,native) OMP_NUM_THREADS=1 AMP_LESSONS_PROGRESS=0 $(BIN)/python $(NBVAL))

matrix-avx2:
	@echo "== (b) x86 kernels held to AVX2, as on a laptop without AVX-512"
	@$(call timed,$(call matrix-env,avx2) ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 $(BIN)/python $(NBVAL))

matrix-threads:
	@echo "== (c) 2 threads, progress bars on"
	@$(call timed,$(call matrix-env,threads2) OMP_NUM_THREADS=2 AMP_LESSONS_PROGRESS=1 $(BIN)/python $(NBVAL))

# One configuration in its own venv: the unit tests, and every lesson compared with its stored
# outputs. A configuration whose interpreter is missing is skipped, saying so.
matrix-venv = $(if $(filter colab,$(1)),$(COLAB_VENV),$(if $(filter newest,$(1)),$(NEWEST_VENV),.venv-torch$(basename $(1))))
matrix-python = $(if $(filter colab,$(1)),$(PYTHON_COLAB),$(if $(filter newest,$(1)),$(PYTHON_NEWEST),$(PYTHON)))
matrix-missing = $(if $(filter colab,$(1)),$(call missing-python,3.12,Colab's,PYTHON_COLAB),$(call missing-python,3.13,the newest,PYTHON_NEWEST))
matrix-ready = $(if $(call matrix-python,$(1)),$(call matrix-venv,$(1))/.installed $(if $(filter newest,$(1)),newest-torch))
matrix-widgets = $(if $(filter colab,$(1)),AMP_LESSONS_EXPECT_IPYWIDGETS=$(COLAB_WIDGETS))
matrix-says = echo "== $(1): $(2), Python $$($(3) -c 'import sys; print(sys.version.split()[0])'), torch $$($(3) -c 'import torch; print(torch.__version__)')"

matrix-unit-%: $$(call matrix-ready,%)
	@$(if $(call matrix-python,$*),,$(call skip,$@,$(call matrix-missing,$*)) && exit 0;) \
	$(call matrix-says,$*,unit tests,$(call matrix-venv,$*)/bin/python) && \
	$(call timed,OMP_NUM_THREADS=1 $(call matrix-widgets,$*) $(call matrix-venv,$*)/bin/python -m pytest tests -m "not browser" -q -p no:cacheprovider)

matrix-lessons-%: $$(call matrix-ready,%)
	@$(if $(call matrix-python,$*),,$(call skip,$@,$(call matrix-missing,$*)) && exit 0;) \
	$(call matrix-says,$*,every lesson,$(call matrix-venv,$*)/bin/python) && \
	$(call timed,$(call matrix-env,$*) OMP_NUM_THREADS=1 $(call matrix-venv,$*)/bin/python $(NBVAL))

.venv-torch%/.installed: pyproject.toml
	test -x .venv-torch$*/bin/python || $(PYTHON) -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install --quiet "torch==$(filter $*.%,$(MATRIX_TORCH))"
	.venv-torch$*/bin/python -m pip install --quiet -e ".[dev,lab]"
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
	rm -rf $(VENV) $(COLAB_VENV) $(NEWEST_VENV) .venv-torch* .pytest_cache .ruff_cache artifacts

# --- mutation testing: small bugs planted in each module, counted when its own tests miss them (long; not in CI) ---
MUTANTS ?= scaling clipping claims training checkpoints arguments
.PHONY: mutants
mutants: $(STAMP)  ## mutmut over $(MUTANTS), each against its own tests/test_<module>.py; prints the score per module
	$(BIN)/python tools/mutants.py $(MUTANTS) $(MUTANTS_ARGS)
