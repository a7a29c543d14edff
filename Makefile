# The two commands: `make lab` opens the lessons, `make test` checks everything.
# Both create .venv on first use. The torch build is overridable, e.g.
#   make test TORCH_SPEC=torch==2.13.0      (a CPU build)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch>=2.4
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
# Stored outputs and their checks: no progress bars (their text would be compared), and one
# torch thread, so the numbers a lesson prints do not depend on the machine's core count.
notebooks test-notebooks test-unit test-browser test-colab: export AMP_LESSONS_PROGRESS := 0
notebooks test-notebooks test-browser: export OMP_NUM_THREADS := 1

.PHONY: lab test test-unit test-notebooks test-browser test-colab lint notebooks pairs bench doctor clean

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
	$(BIN)/python -m pytest --nbval $(NOTEBOOKS) --sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider

test-browser: $(STAMP)  ## the widgets in JupyterLab in headless Chromium, and under Colab's ipywidgets 7.7.1
	$(BIN)/python -m pytest tests -m browser -q
	$(MAKE) test-colab

COLAB_VENV := .venv-colab
$(COLAB_VENV)/.installed: pyproject.toml
	test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(COLAB_VENV)/bin/python -m pip install --quiet -e . "ipywidgets==7.7.1" pytest
	touch $@

test-colab: $(COLAB_VENV)/.installed  ## the widget tests under ipywidgets 7.7.1, the version Colab pins
	AMP_LESSONS_EXPECT_IPYWIDGETS=7.7.1 $(COLAB_VENV)/bin/python -m pytest tests/test_widgets.py -q -p no:cacheprovider

notebooks: $(STAMP)  ## re-execute every lesson top to bottom in a fresh kernel and store outputs
	$(BIN)/python tools/nbtool.py execute $(or $(NB),$(NOTEBOOKS))

bench: $(STAMP)
	$(BIN)/python -m amp_lessons bench $(BENCH_ARGS)

doctor: $(STAMP)
	$(BIN)/python -m amp_lessons doctor

clean:
	rm -rf $(VENV) $(COLAB_VENV) .pytest_cache .ruff_cache artifacts
