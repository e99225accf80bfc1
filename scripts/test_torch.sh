#!/usr/bin/env bash
# Runs the tests on another torch release: scripts/test_torch.sh 2.11 [pytest args].
#
# The release lives in one venv outside the repo, $SHARDTENSOR_CACHE (default
# ~/.cache/shardtensor)/torch-VERSION, created on first use and reused after.  Registry builds
# of torch are CUDA builds of ~5 GB, so only the releases CI tests are kept ($SHARDTENSOR_KEEP_TORCH,
# default "2.11 2.15": the oldest and the newest; any other version's venv is removed first), pip
# keeps no cache, and below 15 GB of free disk nothing is installed: the script says so loudly
# and exits 0 without testing (exit 3 with SHARDTENSOR_REQUIRE_TORCH=1).  pip runs without the
# constraints of this machine's pip config, which may cap torch below the release asked for.
set -uo pipefail
cd "$(dirname "$0")/.."
ver="${1:?usage: scripts/test_torch.sh TORCH_VERSION [pytest args]}"
shift
root="${SHARDTENSOR_CACHE:-$HOME/.cache/shardtensor}"
venv="$root/torch-$ver"
stamp="$venv/.shardtensor-installed"
# the stamp names the build files and this checkout: an editable install points at one checkout,
# so a venv last installed from another clone (CI clones afresh) installs this one again
want="$(sha256sum < pyproject.toml | cut -d' ' -f1) $PWD"
mkdir -p "$root"

skip() {
  echo "!!!!!!!! SKIPPED the torch $ver tests: $1 !!!!!!!!" >&2
  [ "${SHARDTENSOR_REQUIRE_TORCH:-0}" = 1 ] && exit 3
  exit 0
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  keep=" ${SHARDTENSOR_KEEP_TORCH:-2.11 2.15} $ver "
  for other in "$root"/torch-*; do
    [ -d "$other" ] && [[ "$keep" != *" ${other##*/torch-} "* ]] && { echo "removing $other (only the torch releases CI tests are kept)" >&2; rm -rf "$other"; }
  done
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    free_gb=$(df -Pk "$root" | awk 'NR==2 {print int($4 / 1048576)}')
    [ "$free_gb" -lt 15 ] && skip "only ${free_gb} GB free on $(df -P "$root" | awk 'NR==2 {print $6}'), 15 GB needed"
    echo "installing torch==$ver into $venv (a CUDA build, ~5 GB, about a minute) ..." >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || skip "python3 -m venv failed"
    start=$SECONDS
    timeout 1200 env PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-cache-dir "torch==$ver.*" \
      || { rm -rf "$venv"; skip "pip could not install torch==$ver within 20 minutes"; }
    echo "torch $ver installed in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
  fi
  timeout 600 env PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-cache-dir -e '.[dev]' \
    || { echo "installing the project into $venv failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
here="$("$venv/bin/python" -c 'import shardtensor, os; print(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(shardtensor.__file__)))))' 2>/dev/null)"
[ "$here" = "$(pwd -P)" ] || { echo "torch $ver venv imports shardtensor from '${here:-nowhere}', not $(pwd -P)" >&2; exit 1; }
echo "tests on $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')" >&2
source scripts/_workers.sh
SHARDTENSOR_OTHER_RELEASE=1 run_pytest "$venv/bin/python" "$@"  # tests marked main_release skip here
rc=$?
[ "$rc" -eq 5 ] && echo "pytest collected no tests: failing" >&2
exit "$rc"
