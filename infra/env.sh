# Environment for a local CPU run: every tool's state under .rstar2/, nothing in $HOME, no hub, no telemetry.
# Values already set by the user (e.g. RAY_ADDRESS, PREFECT_API_URL, MLFLOW_TRACKING_URI) are kept: scaling out is config.
_rstar2_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_state="${RSTAR2_HOME:-$_rstar2_root/.rstar2}"
mkdir -p "$_state"/{prefect,vllm,vllm_rpc,torch_ext,hf,tmp,ray}
export RSTAR2_HOME="$_state"
export PREFECT_HOME="${PREFECT_HOME:-$_state/prefect}"
export PREFECT_MEMO_STORE_PATH="${PREFECT_MEMO_STORE_PATH:-$_state/prefect/memo_store.toml}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
# the ephemeral API server's default 20 s start timeout fails on a loaded 2-core machine
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"
export PREFECT_LOGGING_LEVEL="${PREFECT_LOGGING_LEVEL:-WARNING}"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="$_state/vllm" VLLM_RPC_BASE_PATH="$_state/vllm_rpc"
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 VLLM_CONFIGURE_LOGGING="${VLLM_CONFIGURE_LOGGING:-0}"
export TORCH_EXTENSIONS_DIR="$_state/torch_ext"
export HF_HOME="$_state/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TMPDIR="${TMPDIR:-$_state/tmp}"
unset _state _rstar2_root
