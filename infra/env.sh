# Environment for a local CPU run: every tool's state under .rstar2/, nothing in $HOME, no hub, no telemetry.
# The defaults themselves are defined once, in cli/env.py (the `rstar2` command applies the same ones in-process).
# Values already set by the user (e.g. RAY_ADDRESS, PREFECT_API_URL, MLFLOW_TRACKING_URI) are kept: scaling out is config.
_rstar2_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RSTAR2_HOME="${RSTAR2_HOME:-$_rstar2_root/.rstar2}"
_rstar2_env="$(python3 "$_rstar2_root/cli/env.py" "$RSTAR2_HOME")" ||
  { echo "[rstar2] infra/env.sh: python3 cli/env.py failed" >&2; unset _rstar2_env _rstar2_root; return 1; }
eval "$_rstar2_env"
unset _rstar2_env _rstar2_root
