"""Thin Prefect tasks: each wraps one rstar2 function or actor call and passes only small values and URIs.

A run's lines (step health, progress, evaluation tables, alerts, errors) are records of the `rstar2` loggers; here they
are made to speak at INFO, so Prefect's console handler prints them on the terminal and, with the logger named in
PREFECT_LOGGING_EXTRA_LOGGERS (rstar2/cli/env.py), its API handler writes them into the flow run's logs."""

import logging

logging.getLogger("rstar2").setLevel(logging.INFO)
