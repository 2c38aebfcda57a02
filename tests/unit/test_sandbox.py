"""The per-call sandbox: outcomes map to the right status, limits hold, and the isolation layers that
`active_isolation()` reports as active really contain the code (tests skip layers this machine lacks)."""

import os
import socket
import time
import uuid

import pytest

from rstar2.sandbox import (ExecRequest, LocalSandbox, SandboxLimits, TRUNCATION_MARKER, active_isolation,
                            run_code)

FAST = SandboxLimits(timeout_s=1.0, cpu_s=2)


def layer(name: str) -> bool:
    return active_isolation()[name]


def test_ok_and_last_expression_echo():
    r = run_code(ExecRequest("x = 6\nprint('hi')\nx * 7"), FAST)
    assert (r.status, r.stdout, r.exit_code) == ("ok", "hi\n42\n", 0)
    assert run_code(ExecRequest("print('only')\nNone"), FAST).stdout == "only\n"  # None is not echoed
    assert r.wall_s > 0 and r.cpu_s > 0 and r.to_dict()["status"] == "ok"


def test_stdin():
    r = run_code(ExecRequest("a, b = map(int, input().split())\nprint(a + b)", stdin="2 40\n"), FAST)
    assert (r.status, r.stdout) == ("ok", "42\n")


def test_syntax_error():
    r = run_code(ExecRequest("def f(:\n  pass"), FAST)
    assert r.status == "error" and r.exit_code == 1 and "SyntaxError" in r.stderr


def test_exception_traceback_shows_user_code_only():
    r = run_code(ExecRequest("def f(n):\n    return 1 / n\nprint('before')\nf(0)"), FAST)
    assert r.status == "error" and r.stdout == "before\n"
    assert r.stderr.startswith("Traceback") and "ZeroDivisionError: division by zero" in r.stderr
    assert "return 1 / n" in r.stderr and "_setup" not in r.stderr  # user lines shown, bootstrap frames hidden


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run_code(ExecRequest("while True:\n    pass"), FAST)
    assert r.status == "timeout" and r.exit_code is None
    assert time.monotonic() - t0 < FAST.timeout_s + 1.0


def test_memory_bomb():
    r = run_code(ExecRequest("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))"),
                 SandboxLimits(timeout_s=5.0, memory_mb=256))
    assert r.status == "memory", r


def test_huge_output_is_truncated_and_bounded():
    lim = SandboxLimits(timeout_s=5.0, max_output_chars=1000)
    r = run_code(ExecRequest("import sys\n_ = sys.stdout.write('a' + 'x' * 10_000_000 + 'z')"), lim)
    assert r.status == "output_truncated" and r.exit_code == 0
    assert len(r.stdout) <= lim.max_output_chars + len(TRUNCATION_MARKER)
    assert r.stdout.startswith("axxx") and r.stdout.endswith("xxz") and TRUNCATION_MARKER in r.stdout


def _alive_with_token(token: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmd and state not in ("Z", "X"):
            pids.append(int(pid))
    return pids


@pytest.mark.parametrize("escape", ["", "os.setsid()"])
def test_background_grandchild_dies_with_the_call(escape):
    if escape and not layer("pidns"):
        pytest.skip("a setsid() escapee survives a process-group kill without the pid namespace")
    token = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**6}"  # a unique `sleep` argument
    code = f"import os\nif os.fork() == 0:\n    {escape or 'pass'}\n    os.execv('/bin/sleep', ['sleep', '{token}'])\n"
    code += "import time\ntime.sleep(0.2)\nprint('parent done')"
    r = run_code(ExecRequest(code), FAST)
    assert r.stdout == "parent done\n"
    deadline = time.monotonic() + 2.0
    while _alive_with_token(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _alive_with_token(token) == []


def test_writes_outside_the_sandbox_fail():
    if not layer("unprivileged_uid"):
        pytest.skip("code runs as root here")
    for target in ("/etc/rstar2-sandbox-probe", os.path.join(os.getcwd(), "rstar2-sandbox-probe")):
        r = run_code(ExecRequest(f"open({target!r}, 'w').write('x')"), FAST)
        # denied, or invisible (a checkout under /tmp sits behind the sandbox's private /tmp): never written
        assert r.status == "error" and ("PermissionError" in r.stderr or "FileNotFoundError" in r.stderr), r
        assert not os.path.exists(target)
    assert run_code(ExecRequest("open('scratch.txt', 'w').write('ok')"), FAST).status == "ok"  # own dir works


def test_private_tmp_is_fresh_per_call():
    if not layer("private_tmp"):
        pytest.skip("no mount namespace")
    assert run_code(ExecRequest("open('/tmp/leak', 'w').write('x')"), FAST).status == "ok"
    r = run_code(ExecRequest("import os\nos.listdir('/tmp')"), FAST)
    assert r.stdout == "[]\n"


def test_no_network_to_a_local_listener():
    if not layer("netns"):
        pytest.skip("no network namespace")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r = run_code(ExecRequest(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"), FAST)
    assert r.status == "error" and "Error" in r.stderr, r


def test_environment_is_minimal():
    os.environ["RSTAR2_SECRET_FOR_TEST"] = "s3cret"
    try:
        r = run_code(ExecRequest("import os\nsorted(os.environ)"), FAST)
    finally:
        del os.environ["RSTAR2_SECRET_FOR_TEST"]
    assert "RSTAR2_SECRET_FOR_TEST" not in r.stdout and "'OMP_NUM_THREADS'" in r.stdout


def test_batch_keeps_input_order_and_counts():
    reqs = [ExecRequest(f"import time\ntime.sleep({0.3 - 0.05 * i:.2f})\nprint({i})") for i in range(6)]
    reqs.append(ExecRequest("raise ValueError('x')"))
    with LocalSandbox(FAST, workers=4) as sb:
        results = sb.run_batch(reqs)
        stats = sb.stats()
    assert [r.stdout for r in results[:6]] == [f"{i}\n" for i in range(6)]
    assert results[6].status == "error"
    assert stats["calls"] == 7 and stats["status"]["ok"] == 6 and stats["status"]["error"] == 1


def test_fork_bomb_in_one_slot_does_not_starve_the_others():
    if not (layer("uid_drop") and os.geteuid() == 0):
        pytest.skip("per-slot uids need a root parent")
    bomb = ExecRequest("import os\nfor _ in range(200):\n    os.fork()")
    threads = ExecRequest("import os, threading\nts = [threading.Thread(target=len, args=('',)) for _ in range(8)]\n"
                          "for t in ts:\n    t.start()\nos.getuid()")
    with LocalSandbox(SandboxLimits(timeout_s=3.0), workers=3) as sb:
        results = sb.run_batch([bomb] + [threads] * 8)
    assert results[0].status == "error" and "BlockingIOError" in results[0].stderr
    assert [r.status for r in results[1:]] == ["ok"] * 8
    uids = {int(r.stdout) for r in results[1:]}
    assert len(uids) <= 3 and min(uids) >= 20000
