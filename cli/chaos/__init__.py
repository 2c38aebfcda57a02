"""`rstar2 chaos`: kill parts of a running campaign, and check that the run they leave is the run without them.
Fault injection against real runs, shipped with the command line so that anyone can prove recovery on their own
setup (README, docs/faults.md); tests/flows/test_kill_retry.py runs the command, tests/unit/test_chaos_checks.py the
checks on hand-made records.

A shrunken campaign of the preset (a few RL steps, see SHRINK) runs once without faults (`ref`). Then, from the
reference's SFT model, it runs again once per row of the plan, with each of the row's faults injected at its point,
in turn (a fault waits for the one before it in its row). A run that stops with an error is retried with the same
command (what the Prefect UI's Retry does), at most once per fault of its row. Verdicts:

    recovered   the run ended by itself and every check below holds
    retried     the run stopped with one error, a retry ended it, and every check below holds
    lost        the run ended, but a check failed (named)
    failed      a fault could not be injected, or the run did not end even on retry

Checks, against the reference: each step's figures (reward, tool errors, format, length, grad norm, loss, entropy,
RoC kept) and the held-out pass@1 to the last digit; each step's kept rollouts (a hash of problem, sample, tokens,
reward); each step's rollout table holding every (problem, sample) once and the same ones; each step in MLflow exactly
once; every checkpoint committed, with the trainer's optimizer step counting on, none left half-written, and none that
was committed before a retry written again.

    runner   the reference run and the rows: start, drive (each fault at its point), retry; `run_chaos`
    faults   each fault's moment and injection (`fault_table`), and the campaign process they watch (`Run`)
    servers  the servers a row runs of its own (MLflow, Prefect, the sandbox's HTTP server), stopped by the faults
    checks   what a run left (`results`), what differs from the reference (`differences`), a row's `verdict`
"""
