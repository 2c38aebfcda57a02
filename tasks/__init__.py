"""Thin Prefect tasks: each wraps one rstar2 function or actor call and passes only small values and URIs."""
