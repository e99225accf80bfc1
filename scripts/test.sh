#!/usr/bin/env bash
# Runs the whole test suite (installs into .venv on first use). Extra args go to pytest.
# The tests run on one pytest-xdist worker per core, at most 4 (SHARDTENSOR_TEST_WORKERS sets
# the number; 0 runs them in this process); each worker keeps torch to one thread.
source "$(dirname "$0")/_setup.sh"
source scripts/_workers.sh
set +e
run_pytest .venv/bin/python "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
fi
exit "$rc"
