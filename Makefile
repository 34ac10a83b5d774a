# The two commands a new machine needs: `make run` (the whole system) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint stop-db

$(STAMP): pyproject.toml client/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]" -e "./client[celery,fast]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python manage.py dev

# The tests in two processes (pytest-xdist), each with databases of its own; 0 runs them in one.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy client/cronlease_client
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	# The same contract again with the 16 shards on three servers (tests/shard_layout.py).
	$(BIN)/python -m pytest $(XDIST) --shard-servers 2 -m "shards or physical" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy client/cronlease_client
	$(BIN)/ruff format --check .

stop-db: $(STAMP)
	$(BIN)/python -c "import os; from pathlib import Path; from scheduler_site import embedded_db; stopped = embedded_db.stop_all(Path(os.environ.get('SCHEDULER_DATA_DIR', '.data'))); print('stopped ' + ', '.join(stopped) if stopped else 'not running')"
