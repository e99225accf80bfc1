#!/usr/bin/env bash
# Runs the main job: `shardtensor demo` (installs into .venv on first use).
source "$(dirname "$0")/_setup.sh"
exec .venv/bin/shardtensor demo "$@"
