"""The top floor: the `rstar2` command line, `rstar2 serve` and the process environment defaults. It launches flows
and benchmarks, so it may import flows, tasks, bench and rstar2; nothing imports it but the tests."""
