# Sourced by scripts/demo, scripts/test and scripts/docs with the set of packages they need:
# "base" (flodl-trio and its dependencies: what the demo runs), "test" (the test extra; as root,
# Debian's chromium and etcd-server for the tests that drive them) or "docs" (Sphinx).
# It creates .venv once and installs a set when its stamp (.venv/.flodl-installed-SET) is
# missing or older than pyproject.toml, unless a larger set's stamp is fresh: every set holds
# the base package and the test extra holds Sphinx, so ./scripts/test then ./scripts/demo (or
# ./scripts/docs) installs nothing more, and ./scripts/demo then ./scripts/test adds the test
# extra to the same .venv.
# FLODL_SETUP_DRY_RUN=1 prints each step ("would run: ...") instead of running it, the
# script's own command included.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

dry_run() { [ "${FLODL_SETUP_DRY_RUN:-}" = 1 ]; }
step() {  # one setup step, or its words
  if dry_run; then echo "would run: $*"; else "$@"; fi
}
launch() {  # the script's own command, last
  if dry_run; then echo "would run: $*"; exit 0; fi
  exec "$@"
}
fresh() { [ -f "$1" ] && ! [ pyproject.toml -nt "$1" ]; }

if [ ! -x .venv/bin/python ]; then
  step "$py" -m venv .venv
fi
case "$1" in  # the sets whose fresh stamp means this one is installed
  base) serving="base docs test" ;;
  docs) serving="docs test" ;;
  *) serving="$1" ;;
esac
installed=0
for have in $serving; do
  if fresh ".venv/.flodl-installed-$have"; then installed=1; fi
done
if [ "$installed" = 0 ]; then
  spec="."
  if [ "$1" != base ]; then spec=".[$1]"; fi
  step .venv/bin/python -m pip install --quiet --upgrade pip
  step .venv/bin/python -m pip install --quiet -e "$spec"
  step touch ".venv/.flodl-installed-$1"
fi

debian_package() {  # PACKAGE BINARY WHAT: as root, install what a test drives, once
  if [ -x "$2" ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    return 0
  fi
  echo "installing Debian's $1 for $3" >&2
  if dry_run; then
    echo "would run: apt-get install -y -qq $1"
  elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" \
      >/dev/null; }; then
    echo "warning: $1 not installed; $3 will be skipped" >&2
    return 0
  fi
  if [ "$1" = etcd-server ] && ! dry_run; then
    # The tests start their own member on free loopback ports: the packaged service is not
    # needed, so it is stopped and disabled where systemd runs it.
    { command -v systemctl >/dev/null 2>&1 && systemctl disable --now etcd >/dev/null 2>&1; } \
      || true
  fi
}
if [ "$1" = test ]; then
  debian_package chromium /usr/bin/chromium "the status page tests"
  debian_package etcd-server /usr/bin/etcd "the session-store tests"
fi
