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

# Main job: train dlrm/synthetic on the embedded synthetic generator, evaluate, print metrics JSON.
run: $(STAMP)
	rm -rf runs/main
	$(BIN)/python -m dlrm.train dlrm/synthetic --workdir runs/main
	$(BIN)/python -m dlrm.evaluate --workdir runs/main --output runs/main/eval.json

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
