# Environment for a local CPU run: every tool's state under $RSTAR2_HOME (default: the checkout's .rstar2/), nothing
# in $HOME, no hub, no telemetry. The defaults themselves, RSTAR2_HOME's too, are defined once, in cli/env.py (the
# `rstar2` command applies the same ones in-process); this names the checkout as the base of RSTAR2_HOME's default.
# Values already set by the user (e.g. RAY_ADDRESS, PREFECT_API_URL, MLFLOW_TRACKING_URI) are kept: scaling out is
# config.
_rstar2_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -z "${RSTAR2_HOME+set}" ] || export RSTAR2_HOME  # a value set in this shell reaches cli/env.py
_rstar2_env="$(python3 "$_rstar2_root/cli/env.py" "$_rstar2_root")" ||
  { echo "[rstar2] infra/env.sh: python3 cli/env.py failed" >&2; unset _rstar2_env _rstar2_root; return 1; }
eval "$_rstar2_env"
unset _rstar2_env _rstar2_root
