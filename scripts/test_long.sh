#!/usr/bin/env bash
# Runs the tests marked ``long`` (third-party training runs of a minute or more that CI leaves
# out: more torchtitan parallelisms, DCP resume and the full-DTensor backend, more Hugging Face
# models); about 20 minutes on 2 cores.  Extra args go to pytest.
source "$(dirname "$0")/_setup.sh"
source scripts/_workers.sh
set +e
SHARDTENSOR_LONG=1 run_pytest .venv/bin/python -m long "$@"
