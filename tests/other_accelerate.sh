#!/usr/bin/env bash
# The test suite against another accelerate release than the installed one, in a throwaway virtual environment
# layered over this environment's packages (torch, transformers, peft ... stay as installed):
#   bash tests/other_accelerate.sh 1.14.0                      # the whole suite
#   bash tests/other_accelerate.sh 1.13.0 tests/distributed -x  # pytest's arguments after the version
# The results of each release are in docs/guarantees.md ("Other versions than CI's are run by hand").
set -euo pipefail
version=${1:?usage: bash tests/other_accelerate.sh VERSION [PYTEST ARGS...]}
shift
venv="${TMPDIR:-/tmp}/memsafe-accelerate-$version"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --no-deps "accelerate==$version"
"$venv/bin/python" -c "import accelerate, sys; sys.exit(accelerate.__version__ != '$version')"
cd "$(dirname "$0")/.."
# `python -m pytest` from the checkout: its accelerate_memsafe comes first on the path
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
