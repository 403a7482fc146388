# Sourced by scripts/demo and scripts/test: create .venv once, (re)install when pyproject changes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.flodl-installed-$1"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$1]"
  touch "$stamp"
fi
# The status page tests drive a real headless Chromium (Debian's package); as root, install it once.
if [ "$1" = test ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the status page tests" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
      >/dev/null; } || echo "warning: chromium not installed; its tests will be skipped" >&2
fi
# The session-store tests run a real etcd (Debian's etcd-server, /usr/bin/etcd); as root, install
# it once. The tests start their own member on free loopback ports: the packaged service is not
# needed, so it is stopped and disabled where systemd runs it.
if [ "$1" = test ] && [ ! -x /usr/bin/etcd ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's etcd-server for the session-store tests" >&2
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server \
      >/dev/null; }; then
    { command -v systemctl >/dev/null 2>&1 && systemctl disable --now etcd >/dev/null 2>&1; } \
      || true
  else
    echo "warning: etcd-server not installed; the etcd store tests will be skipped" >&2
  fi
fi
