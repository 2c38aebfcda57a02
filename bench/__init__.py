"""Benchmarks with their recorded data (bench/data): the trainer against TRL, the sandbox against a subprocess per
call, the rollout scheduler on live engines. They import the library (rstar2); the library never imports them."""
