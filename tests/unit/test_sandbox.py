"""The sandbox service's behaviour: outcomes map to statuses, stdin, output truncation, routing to warm executors,
the isolation report, metrics. Attacks are in test_sandbox_containment.py, the queue and the front-ends in
test_sandbox_service.py."""

import os

import pytest

from rstar2.sandbox import TRUNCATION_MARKER, ExecRequest, SandboxUnavailable
from rstar2.sandbox.executor import PROFILES, imported_modules, route
from rstar2.sandbox.metrics import SandboxMetrics, summarize
from rstar2.sandbox.service import ESSENTIAL, SandboxService


def run(service, code, **kw):
    return service.run(ExecRequest(code, **kw))


def test_ok_and_last_expression_echo(service):
    r = run(service, "x = 6\nprint('hi')\nx * 7")
    assert (r.status, r.stdout, r.exit_code, r.stderr) == ("ok", "hi\n42\n", 0, "")
    assert run(service, "print('only')\nNone").stdout == "only\n"  # None is not echoed
    assert r.wall_s > 0 and r.cpu_s > 0 and r.latency_s >= r.wall_s and r.profile == "bare"
    assert r.to_dict()["status"] == "ok"


def test_last_expression_forms(service):
    assert run(service, "x = 2; x + 1").stdout == "3\n"
    assert run(service, "d = {'a': 1}\nsorted(\n    d.items()\n)  # comment").stdout == "[('a', 1)]\n"
    assert run(service, "for i in range(2):\n    i").stdout == ""  # not a top-level expression
    r = run(service, "x = 1\n\n(x +\n 'a')")
    assert r.status == "error" and 'line 3, in <module>' in r.stderr  # line numbers of the original
    big = "y = 0\n" * 4000 + "y + 7"  # > 20 kB: split in the child
    assert run(service, big).stdout == "7\n"
    assert run(service, "'é' + 'ü'").stdout == "'éü'\n"


def test_stdin(service):
    r = run(service, "a, b = map(int, input().split())\nprint(a + b)\nimport sys\nprint(repr(sys.stdin.read()))",
            stdin="2 40\nrest\n")
    assert (r.status, r.stdout) == ("ok", "42\n'rest\\n'\n")
    assert "EOFError" in run(service, "input()").stderr  # no input: end of file, as with </dev/null


def test_errors_and_exit_codes(service):
    r = run(service, "def f(:\n  pass")
    assert r.status == "error" and r.exit_code == 1 and "SyntaxError" in r.stderr
    r = run(service, "def f(n):\n    return 1 / n\nprint('before')\nf(0)")
    assert r.status == "error" and r.stdout == "before\n"
    assert r.stderr.startswith("Traceback") and "ZeroDivisionError: division by zero" in r.stderr
    assert "return 1 / n" in r.stderr and "zygote" not in r.stderr  # user lines shown, our frames hidden
    assert (run(service, "import sys\nsys.exit(3)").exit_code, run(service, "raise SystemExit").status) == (3, "ok")


def test_signals_map_to_killed(service):
    r = run(service, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (r.status, r.exit_code, r.signal) == ("killed", None, 9)
    r = run(service, "import ctypes\nctypes.string_at(0)")  # segfault
    assert r.status == "killed" and "SIGSEGV" in r.stderr


def test_timeout_and_memory(service):
    r = run(service, "while True:\n    pass")
    t = service.limits.timeout_s
    assert r.status == "timeout" and r.exit_code is None and t <= r.wall_s < t + 1
    r = run(service, "x = bytearray(10**10)")
    assert r.status == "memory" and "MemoryError" in r.stderr
    r = run(service, "import time\ntime.sleep(5)", timeout_s=0.3)  # a request's own, shorter timeout
    assert r.status == "timeout" and r.wall_s < 1


def test_output_head_and_tail(service):
    r = run(service, "import sys\n_ = sys.stdout.write('a' + 'x' * 100_000 + 'z')")
    assert r.status == "output_truncated" and r.exit_code == 0
    assert len(r.stdout) <= service.limits.max_output_chars + len(TRUNCATION_MARKER)
    assert r.stdout.startswith("axxx") and r.stdout.endswith("xxz") and TRUNCATION_MARKER in r.stdout
    r = run(service, "print('é' * 10, '\\udcff')")  # non-ASCII and a lone surrogate survive the round trip
    assert r.status == "ok" and r.stdout.startswith("é" * 10)


def test_big_integers_and_threads_and_tempfiles(service):
    assert run(service, "len(str(2**100_000))").stdout == "30103\n"  # no 4300-digit limit
    code = ("import threading, tempfile, multiprocessing as mp\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(1))\nt.start(); t.join()\n"
            "with tempfile.NamedTemporaryFile() as f:\n    f.write(b'x')\n"
            "with mp.Pool(2) as p:\n    print(out, p.map(abs, [-1, -2]))")
    r = run(service, code, timeout_s=10)
    assert (r.status, r.stdout) == ("ok", "[1] [1, 2]\n"), r.stderr


def test_imports_route_to_warm_profiles():
    assert imported_modules("import numpy as np, os.path\nfrom sympy import Symbol\n  import re") == \
        {"numpy", "os", "sympy", "re"}
    assert imported_modules("m = __import__('scipy')") == {"scipy"}
    assert route("import math, fractions\nprint(1)", PROFILES) == "bare"
    assert route("import numpy\nimport sympy", PROFILES) == "sci"
    assert route("from math_verify import parse", PROFILES) == "verify"
    assert route("import pandas", PROFILES) == "sci"  # not preloaded anywhere: the largest profile


def test_sci_profile_runs_numpy_and_sympy(service):
    r = run(service, "import numpy as np, sympy\nprint(int(np.arange(5).sum()), sympy.factorint(2**20 - 1))",
            timeout_s=60)  # the first call may start the executor
    assert (r.status, r.profile) == ("ok", "sci"), r.stderr
    assert r.stdout == "10 {3: 1, 5: 2, 11: 1, 31: 1, 41: 1}\n"
    r = run(service, "import json\nprint(json.dumps([1]))\n# lazy imports still work: import statistics")
    assert r.stdout == "[1]\n" and r.profile == "bare"


def test_isolation_report_names_every_layer(service):
    layers = service.isolation()
    assert set(ESSENTIAL) <= set(layers)
    for name, state in layers.items():
        assert state.startswith(("active", "unavailable: ")), (name, state)
    if os.geteuid() == 0 and layers["pid_namespace"] == "active":  # what this machine class provides
        assert all(layers[name].startswith("active") for name in ESSENTIAL), layers


def test_required_layer_missing_refuses_to_start(fast):
    with pytest.raises(SandboxUnavailable, match="no_such_layer"):
        SandboxService(fast, slots=1, require=["no_such_layer"])


def test_metrics_count_and_summarise(service):
    before = service.snapshot()
    reqs = [ExecRequest(f"print({i})") for i in range(5)] + [ExecRequest("1/0")]
    results = service.run_batch(reqs)
    assert [r.stdout for r in results[:5]] == [f"{i}\n" for i in range(5)] and results[5].status == "error"
    s = summarize(before, service.snapshot())
    assert (s["sandbox_calls"], s["sandbox_status_ok"], s["sandbox_status_error"]) == (6, 5, 1)
    assert 0 < s["sandbox_latency_p50_s"] <= s["sandbox_latency_p99_s"] and s["sandbox_calls_per_s"] > 0
    text = service.metrics.text().decode()
    assert 'rstar2_sandbox_calls_total{status="ok"}' in text and "rstar2_sandbox_queue_depth" in text
    assert 'rstar2_sandbox_isolation_layer{layer="pid_namespace"}' in text


def test_histogram_quantiles():
    m = SandboxMetrics()
    before = m.snapshot()
    for v in [0.003] * 50 + [0.05] * 49 + [3.0]:
        m.latency.observe(v)
        m.calls.labels("ok").inc()
    s = summarize(before, m.snapshot(), prefix="")
    assert 0.002 <= s["latency_p50_s"] <= 0.004 and 0.04 <= s["latency_p99_s"] <= 0.06
    assert s["calls"] == 100 and abs(s["latency_mean_s"] - (0.15 + 49 * 0.05 + 3.0) / 100) < 1e-9


def test_every_executor_hashes_strings_alike(service):
    """A set of strings prints in one order whichever executor process runs it (a fixed hash seed: two services'
    executors are distinct interpreters), and the interpreter still ignores the user site and does not put the code's
    directory on sys.path."""
    code = "import sys\nprint(sys.flags.no_user_site, sys.flags.safe_path)\n" \
           "print({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}, hash('rstar2'))"
    with SandboxService(service.limits, slots=1) as other:
        outs = {run(s, code).stdout for s in (service, other)}
    assert len(outs) == 1 and outs.pop().startswith("1 True\n")
