# The README's two commands. Both create .venv, install the project and then act.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean

# constraints.txt pins every dependency to the versions the suite was last run with, so a new
# upstream release cannot break a fresh clone (tests turn warnings into errors).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Main job: the showcase scaling sweep (Wukong vs DLRM vs DCNv2 over 1.5 decades of compute on
# the embedded planted-teacher generator), then the fitted laws and plots in runs/showcase/.
# Resumable: an interrupted `make run` continues where it stopped.
run: $(STAMP)
	$(BIN)/python -m sweeps.launch sweeps.specs.showcase --sweep-dir runs/showcase --max-parallel 2
	$(BIN)/python -m sweeps.analyze runs/showcase

# The suite on up to 4 worker processes (pytest-xdist; 2 on a 2-core CI machine), a test file per
# worker at a time (module fixtures run once), sharing one persistent JAX compilation cache
# (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

clean:
	rm -rf $(VENV) runs .pytest_cache .jax_cache
