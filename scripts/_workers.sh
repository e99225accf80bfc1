# Sourced by test.sh and test_torch.sh.
#
# WORKERS: pytest's xdist options, one worker per core, at most 4 (SHARDTENSOR_TEST_WORKERS
# overrides; 0 runs the tests in pytest's own process).
#
# run_pytest PYTHON [pytest args]: the suite on those workers.  A test whose worker process died
# under it (a segfault inside torch: seen once in 4 full runs, in a simulated world's rank threads,
# in torch's dispatch-rule lookup) runs once more, alone, and says so loudly; a failed check or any
# other failure stands as it is.
n="${SHARDTENSOR_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$n" -gt 4 ] && [ -z "${SHARDTENSOR_TEST_WORKERS:-}" ] && n=4
if [ "$n" -gt 1 ]; then WORKERS=(-n "$n"); else WORKERS=(); fi

run_pytest() {
  local py="$1" log rc crashed ids
  shift
  log="$(mktemp)"
  "$py" -m pytest "${WORKERS[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  crashed="^worker 'gw[0-9]+' crashed while running '(.*)'$"
  mapfile -t ids < <(grep -E "$crashed" "$log" | sed -E "s/$crashed/\\1/" | sort -u)
  if [ "$rc" -eq 1 ] && [ "${#ids[@]}" -gt 0 ] && [ "$(grep -c '^FAILED ' "$log")" -eq "${#ids[@]}" ] \
      && ! grep -q '^ERROR ' "$log"; then
    echo "!!!!!!!! ${#ids[@]} test(s) lost their worker process (a crash, not a failed check); running them once more, alone: ${ids[*]} !!!!!!!!" >&2
    "$py" -m pytest -p no:cacheprovider -q "${ids[@]}"
    rc=$?
  fi
  rm -f "$log"
  return "$rc"
}
