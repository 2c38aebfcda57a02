#!/usr/bin/env bash
# One entry point for a fresh 2-core CPU machine with no hub access:
#   bash infra/dev.sh campaign [args]   create .venv if needed, run the tiny campaign end to end
#   bash infra/dev.sh test [pytest args] create .venv if needed, run the test suite
#   bash infra/dev.sh ui-test            headless Chromium against the Prefect and MLflow UIs (installs Debian's chromium if missing)
#   bash infra/dev.sh serve [args]       Prefect + MLflow servers on 127.0.0.1 and a worker for prefect.yaml's deployments
#   bash infra/dev.sh env                create .venv only
# Every tool's state is kept under .rstar2/ (never $HOME).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
lock="$root/infra/requirements-cpu.lock"
stamp="$venv/.rstar2-lock.sha256"

ensure_env() {
  # relative names: the stamp depends on the files' contents, not on where the checkout lives
  local want; want="$(sha256sum infra/requirements-cpu.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
  if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
  echo "[rstar2] creating $venv from $lock (about 2-3 minutes the first time)" >&2
  local log="$root/.rstar2/pip-install.log"
  mkdir -p "$root/.rstar2"
  rm -f "$stamp"
  python3 -m venv "$venv"
  install_env > "$log" 2>&1 || { tail -n 40 "$log" >&2; echo "[rstar2] install failed; full log: $log" >&2; exit 1; }
  echo "$want" > "$stamp"
}

# Chained with &&: under `set -e` a failure inside a block that is followed by `||` does not stop it (measured: a
# lock install that failed on a full disk left a venv without pytest, stamped as complete).
install_env() {
  "$venv/bin/pip" install -U "pip==26.3" &&
    # --no-deps: the lock is complete and resolved; a resolver run would pull torchvision/torchaudio that break
    # vllm. --no-compile: pip byte-compiles file by file, and compiling the whole venv ahead took ~70 s of a 2-core
    # machine for ~35,000 modules; a run imports a fraction of them, and Python caches each .pyc on first import.
    DS_BUILD_OPS=0 "$venv/bin/pip" install --no-compile --no-deps -r "$lock" &&
    "$venv/bin/pip" install --no-compile --no-deps -e .
}

# shellcheck source=infra/env.sh
source "$root/infra/env.sh"
# the venv is installed without bytecode (see install_env): let the first import of each module cache it
unset PYTHONDONTWRITEBYTECODE
cmd="${1:-campaign}"; shift || true
case "$cmd" in
  env) ensure_env ;;
  campaign) ensure_env; exec "$venv/bin/rstar2" campaign --preset tiny "$@" ;;
  test) ensure_env; exec "$venv/bin/python" -m pytest -q "$@" ;;
  ablation) ensure_env; exec "$venv/bin/rstar2" ablation --preset tiny "$@" ;;
  serve) ensure_env; exec "$venv/bin/rstar2" serve "$@" ;;
  ui-test)
    ensure_env
    if ! command -v chromium >/dev/null; then
      echo "[rstar2] installing Debian's chromium (apt-get)" >&2
      as_root=(); [[ "$(id -u)" == 0 ]] || as_root=(sudo)  # CI may run as a user with sudo
      "${as_root[@]}" apt-get update -qq
      "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
    exec "$venv/bin/python" -m pytest -q -m ui tests/ui "$@" ;;
  *) echo "usage: bash infra/dev.sh {campaign|test|ablation|serve|ui-test|env} [args]" >&2; exit 2 ;;
esac
