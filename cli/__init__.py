"""The top floor: the `rstar2` command line (its commands by topic, assembled in main.py), `rstar2 serve`, the fault
injection of `rstar2 chaos` (chaos/) and the process environment defaults. It launches flows and benchmarks, so it
may import flows, tasks, bench and rstar2; nothing imports it but the tests."""
