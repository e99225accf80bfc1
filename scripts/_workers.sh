# Sourced by test.sh and test_torch.sh: WORKERS, pytest's xdist options (one worker per core, at
# most 4; SHARDTENSOR_TEST_WORKERS overrides, 0 runs the tests in pytest's own process).
n="${SHARDTENSOR_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$n" -gt 4 ] && [ -z "${SHARDTENSOR_TEST_WORKERS:-}" ] && n=4
if [ "$n" -gt 1 ]; then WORKERS=(-n "$n"); else WORKERS=(); fi
