"""Isolated execution of model-written Python: one fresh OS process per call (implementation notes §6).

This is the simple, solid first version; a later fork-server service returns the same `ExecResult`, so the
two can be swapped. Each call:

* starts `python -I -c <bootstrap>` in a new session (process group) with a minimal environment, stdin from a
  file and stdout/stderr redirected to files in a fresh private temp dir (never buffered unbounded in memory:
  RLIMIT_FSIZE caps them and only head + tail are read back);
* the bootstrap (trusted, runs before any user code and is single-threaded, so no `preexec_fn` in a threaded
  parent) unshares network, pid and mount namespaces (a fresh size-limited tmpfs on /tmp and /dev/shm is the
  work dir, gone with the call), sets rlimits, drops to an unprivileged uid/gid (nobody, or one per
  LocalSandbox worker), sets NO_NEW_PRIVS, then runs the code IPython-style: the repr of a last bare
  expression is printed. Without root the same namespaces are made inside a user namespace, and the code
  keeps the caller's (unprivileged) uid;
* the parent waits on a pidfd until the wall-clock deadline, SIGKILLs the whole process group (also after a
  normal exit, so forked grandchildren die) *before* reaping the leader (the pgid cannot be recycled), and
  reaps with `wait4` to get the call's CPU time. Exiting the pid namespace kills and reaps whatever is left,
  `setsid()` escapees included, so no orphan zombies count against the uid's RLIMIT_NPROC afterwards.

Which layers work is probed once (`active_isolation()`) and logged; an unavailable layer is reported, never
skipped silently. Known gaps (the fork-server issue closes them): RLIMIT_AS is per process and RLIMIT_NPROC
per uid, not per call (no cgroups), and plain `run_code` callers share uid nobody (LocalSandbox gives each
worker its own uid); world-readable host files stay readable (no Landlock / read-only mounts); /proc still
lists host processes (they cannot be signalled); on a timeout `cpu_s` may miss the killed code's CPU time.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "memory", "killed", "output_truncated"]
OK, ERROR, TIMEOUT, MEMORY, KILLED, OUTPUT_TRUNCATED = "ok", "error", "timeout", "memory", "killed", "output_truncated"
STATUSES: tuple[str, ...] = (OK, ERROR, TIMEOUT, MEMORY, KILLED, OUTPUT_TRUNCATED)

NOBODY = 65534
SLOT_UID_BASE = 20000  # LocalSandbox worker thread k runs code as uid/gid 20000 + k (no passwd entry needed)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
TRUNCATION_MARKER = "\n...(output truncated)...\n"
_SETUP_FAILED = 125  # bootstrap exit code when a requested isolation layer could not be set up


@dataclass
class ExecRequest:
    code: str
    stdin: str = ""


@dataclass
class ExecResult:
    status: Status
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal or at the timeout
    wall_s: float
    cpu_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SandboxLimits:
    timeout_s: float = 4.0  # wall clock, as the released code-judge's MAX_EXECUTION_TIME
    memory_mb: int = 512  # RLIMIT_AS of each process
    cpu_s: int = 4  # RLIMIT_CPU (soft; SIGKILL one second later)
    max_processes: int = 64  # RLIMIT_NPROC, binds only an unprivileged uid (and counts per uid)
    max_file_mb: int = 16  # RLIMIT_FSIZE: every file written, stdout/stderr files included
    max_output_chars: int = 4000  # per stream, head + tail kept
    tmpfs_mb: int = 64  # size of the private /tmp (when the mount namespace is active)


# The trusted prelude run inside the child. Reads the code before dropping privileges, sets every layer the
# parent asked for, then executes the code with the repr of a last bare expression printed (released wrapper).
_BOOTSTRAP = r"""
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
def _supervise():
    # pid namespace: this process (host side) forks the namespace's pid 1, which forks the process that runs
    # the code and reaps everything. When pid 1 exits, the kernel kills and reaps all that is left in the
    # namespace (setsid escapees, fork bombs): no orphan zombies pile up against the uid's RLIMIT_NPROC.
    r, w = os.pipe()
    if os.fork():  # host side: relay the code's exit status (sent by pid 1 through the pipe)
        os.close(w)
        os.wait()
        data = os.read(r, 32)
        if not data:
            sys.stderr.write("[sandbox] setup failed: namespace init died\n")
            os._exit(125)
        st = int(data)
        if os.WIFSIGNALED(st):  # die of the same signal (SIGKILL/SIGSTOP cannot be reset, nor need to be)
            if os.WTERMSIG(st) not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(os.WTERMSIG(st), signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), os.WTERMSIG(st))
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)
    os.close(r)
    child = os.fork()
    if child == 0:
        os.close(w)
        return  # this process runs the code (it is not pid 1, so signals behave normally)
    while True:
        pid, st = os.wait()
        if pid == child:
            os.write(w, str(st).encode())
            os._exit(0)
def _setup():
    with open(cfg["code_path"], encoding="utf-8") as f:
        code = f.read()
    uid, gid = os.getuid(), os.getgid()
    if cfg["unshare"] or cfg["nnp"]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def check(rc, what):
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, what + ": " + os.strerror(err))
    if cfg["unshare"]:
        check(libc.unshare(cfg["unshare"]), "unshare")
        if cfg["unshare"] & 0x10000000:  # new user namespace (unprivileged caller): map our own ids
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
    if cfg["tmpfs_mb"]:  # mount ns: nothing propagates back; fresh tmpfs on /tmp and /dev/shm
        check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make / private")  # MS_REC|MS_PRIVATE
        owner, group = (cfg["uid"], cfg["uid"]) if cfg["uid"] is not None else (uid, gid)
        opts = f"size={cfg['tmpfs_mb']}m,mode=0700,uid={owner},gid={group}".encode()
        for target in (b"/tmp", b"/dev/shm"):
            if os.path.isdir(target):
                check(libc.mount(b"tmpfs", target, b"tmpfs", 0x2 | 0x4, opts), "mount tmpfs")  # NOSUID|NODEV
    if cfg["unshare"] & 0x20000000:  # CLONE_NEWPID
        _supervise()
    os.chdir(cfg["workdir"])
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    if cfg["nnp"]:
        check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    sys.path.extend(cfg["extra_path"])
    return code
try:
    _code = _setup()
except BaseException as e:
    sys.stderr.write(f"[sandbox] setup failed: {e!r}\n")
    sys.stderr.flush()
    os._exit(125)
del cfg, _setup, _supervise
import ast, linecache, traceback, types
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)  # big-integer math is the point of the tool
_F = "<code>"
linecache.cache[_F] = (len(_code), None, _code.splitlines(True), _F)
_main = types.ModuleType("__main__")
sys.modules["__main__"], sys.argv = _main, [""]
try:
    _tree = ast.parse(_code, _F)
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
    exec(compile(_tree, _F, "exec"), _main.__dict__)
    if _last is not None:
        _value = eval(compile(ast.Expression(_last.value), _F, "eval"), _main.__dict__)
        if _value is not None:
            print(repr(_value))
except SystemExit:
    raise
except BaseException as e:
    _tb = e.__traceback__
    while _tb is not None and _tb.tb_frame.f_code.co_filename != _F:
        _tb = _tb.tb_next  # hide the bootstrap's own frames
    sys.stdout.flush()
    traceback.print_exception(type(e), e, _tb)
    sys.exit(1)
"""


def _reachable_by_others(path: str) -> bool:
    """True if an unrelated uid can traverse to `path` and read it (the pyenv interpreter under 0700 /root
    is not, so after the uid drop its stdlib could not be imported: sandbox-notes §8)."""
    path = os.path.realpath(path)
    try:
        mode = os.stat(path).st_mode
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
        parent = os.path.dirname(path)
        while parent != path:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            path, parent = parent, os.path.dirname(parent)
        return True
    except OSError:
        return False


def _pick_python(root: bool) -> tuple[str, list[str]]:
    """The interpreter for the child and extra sys.path entries. As root the code runs as nobody, so the
    interpreter and its stdlib must be world-readable; otherwise use the system python of the same minor
    version and append this environment's site-packages (numpy/sympy wheels are ABI-compatible within 3.X)."""
    if os.environ.get("RSTAR2_SANDBOX_PYTHON"):
        return os.environ["RSTAR2_SANDBOX_PYTHON"], []
    if not root or (_reachable_by_others(sys.executable) and _reachable_by_others(sysconfig.get_path("stdlib"))):
        return sys.executable, []
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.exists(cand) and _reachable_by_others(cand):
            site = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
            return cand, sorted(p for p in site if os.path.isdir(p) and _reachable_by_others(p))
    return sys.executable, []  # the uid-drop probe will fail and say so


def _read_capped(path: str, max_chars: int, head_frac: float = 0.5) -> tuple[str, bool]:
    """Head + tail of a possibly huge output file, at most ~max_chars characters; True if anything was cut."""
    size = os.path.getsize(path)
    head_n = int(max_chars * head_frac)
    tail_n = max_chars - head_n
    with open(path, "rb") as f:
        if size <= 4 * max_chars:  # UTF-8 is at most 4 bytes a character: decoding all of it is bounded
            text = f.read().decode("utf-8", "replace")
            if len(text) <= max_chars:
                return text, False
            return text[:head_n] + TRUNCATION_MARKER + (text[-tail_n:] if tail_n else ""), True
        head = f.read(4 * head_n).decode("utf-8", "replace")[:head_n]
        f.seek(size - 4 * tail_n)
        tail = f.read().decode("utf-8", "replace")[-tail_n:] if tail_n else ""
        return head + TRUNCATION_MARKER + tail, True


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` exits, without reaping it (so its pgid stays pinned for the group kill)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(max(0, int(timeout_s * 1000) + 1)))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):  # the code may chmod its own files; we own them (or are root)
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    shutil.rmtree(path, onerror=fix)


def _execute(req: ExecRequest, limits: SandboxLimits, layers: dict[str, bool], python: str,
             extra_path: list[str], uid: int = NOBODY) -> ExecResult:
    root = os.geteuid() == 0
    uid = uid if layers.get("uid_drop") else None
    flags = ((CLONE_NEWNET if layers.get("netns") else 0) | (CLONE_NEWNS if layers.get("private_tmp") else 0)
             | (CLONE_NEWPID if layers.get("pidns") else 0))
    if flags and not root:
        flags |= CLONE_NEWUSER
    tmp = tempfile.mkdtemp(prefix="rstar2-sbx-")
    try:
        os.chmod(tmp, 0o711)  # traversable (the work dir lies inside), not listable; io files stay 0600
        paths = {k: os.path.join(tmp, k) for k in ("code.py", "stdin", "stdout", "stderr")}
        for key, text in (("code.py", req.code), ("stdin", req.stdin)):  # model text may hold lone surrogates
            with open(paths[key], "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
        if layers.get("private_tmp"):
            workdir = "/tmp"  # the fresh tmpfs, private to this call
        else:
            workdir = os.path.join(tmp, "work")
            os.mkdir(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
        mb = 1024 * 1024
        rlimits = {
            "RLIMIT_CORE": (0, 0),
            "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
            "RLIMIT_FSIZE": (limits.max_file_mb * mb, limits.max_file_mb * mb),
            "RLIMIT_AS": (limits.memory_mb * mb, limits.memory_mb * mb),
        }
        if uid is not None or not root:  # RLIMIT_NPROC does not bind root
            rlimits["RLIMIT_NPROC"] = (limits.max_processes, limits.max_processes)
        cfg = {"code_path": paths["code.py"], "workdir": workdir, "unshare": flags, "uid": uid, "rlimits": rlimits,
               "tmpfs_mb": limits.tmpfs_mb if layers.get("private_tmp") else 0,
               "nnp": bool(layers.get("no_new_privs")), "extra_path": extra_path}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        t0 = time.monotonic()
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                open(paths["stderr"], "wb") as ferr:
            proc = subprocess.Popen([python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)], stdin=fin, stdout=fout,
                                    stderr=ferr, env=env, cwd=tmp, start_new_session=True, close_fds=True)
        timed_out = not _wait_exit(proc.pid, limits.timeout_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: the pgid is still ours
        except (ProcessLookupError, PermissionError):
            pass
        _, wstatus, usage = os.wait4(proc.pid, 0)
        wall_s, cpu_s = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
        proc.returncode = rc = os.waitstatus_to_exitcode(wstatus)
        stdout, cut_out = _read_capped(paths["stdout"], limits.max_output_chars)
        stderr, cut_err = _read_capped(paths["stderr"], limits.max_output_chars, head_frac=0.25)
    finally:
        _rmtree(tmp)
    sig = -rc if rc < 0 else None
    memory = "MemoryError" in stderr[-2000:]
    if timed_out or sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
        status = TIMEOUT
    elif sig is not None:
        status = MEMORY if memory else KILLED
        stderr += f"\n[sandbox] killed by {_signame(sig)}" + (
            f" (file size limit {limits.max_file_mb} MB)" if sig == signal.SIGXFSZ else "")
    elif rc == 0:
        status = OUTPUT_TRUNCATED if (cut_out or cut_err) else OK
    else:
        status = MEMORY if memory else ERROR
        if rc == _SETUP_FAILED and stderr.startswith("[sandbox] setup failed"):
            log.warning("sandbox setup failed: %s", stderr.strip())
    exit_code = None if (timed_out or sig is not None) else rc
    return ExecResult(status, stdout, stderr, exit_code, round(wall_s, 4), round(cpu_s, 4))


_slot_numbers = itertools.count()  # next() on it is atomic under the GIL
_plan: tuple[dict[str, bool], str, list[str]] | None = None
_plan_lock = threading.Lock()
_OPTIONAL = ("netns", "pidns", "private_tmp", "uid_drop", "no_new_privs")


def _get_plan() -> tuple[dict[str, bool], str, list[str]]:
    """Probe each optional layer once by running the real bootstrap with only that layer, then all together."""
    global _plan
    with _plan_lock:
        if _plan is not None:
            return _plan
        root = os.geteuid() == 0
        python, extra = _pick_python(root)
        probe = ExecRequest("import fractions, decimal\nprint('ok')")  # lazy stdlib imports after the drop
        lim = SandboxLimits(timeout_s=20.0, cpu_s=10)

        def works(layers: dict[str, bool]) -> bool:
            r = _execute(probe, lim, layers, python, extra)
            if r.status != OK:
                log.warning("sandbox probe %s failed: %s", layers, r.stderr.strip()[-300:])
            return r.status == OK and r.stdout.strip() == "ok"

        layers = {name: (name != "uid_drop" or root) and works({name: True}) for name in _OPTIONAL}
        if any(layers.values()) and not works(layers):
            log.error("sandbox layers %s work one by one but not together: running without them", layers)
            layers = dict.fromkeys(_OPTIONAL, False)
        unprivileged = layers["uid_drop"] or not root
        layers.update(unprivileged_uid=unprivileged, nproc_limit=unprivileged, process_group=True, rlimits=True,
                      clean_env=True, private_workdir=True)
        missing = [k for k in _OPTIONAL if not layers[k] and (k != "uid_drop" or root)]
        (log.warning if missing else log.info)(
            "sandbox isolation (python=%s): %s%s", python, layers, f"; NOT active: {missing}" if missing else "")
        _plan = (layers, python, extra)
        return _plan


def active_isolation() -> dict[str, bool]:
    """Which isolation layers `run_code` applies on this machine (probed once, logged)."""
    return dict(_get_plan()[0])


def run_code(req: ExecRequest, limits: SandboxLimits | None = None, *, uid: int = NOBODY) -> ExecResult:
    """Run one snippet in a fresh, isolated process; see the module docstring for the layers. `uid` is the
    unprivileged uid/gid the code runs as when the parent is root (calls running at the same time should use
    different ones: RLIMIT_NPROC counts per uid, so one call's fork bomb would otherwise starve the others)."""
    layers, python, extra = _get_plan()
    return _execute(req, limits or SandboxLimits(), layers, python, extra, uid)


class LocalSandbox:
    """Concurrent `run_code` on one machine: every call is its own process, the threads only wait on them.
    Each worker thread runs its calls under its own uid (SLOT_UID_BASE + k), so per-uid limits are per slot."""

    def __init__(self, limits: SandboxLimits | None = None, workers: int = 4):
        self.limits = limits or SandboxLimits()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STATUSES, 0)
        self._calls, self._wall = 0, 0.0
        self._slot = threading.local()
        active_isolation()  # probe (and log) up front, not inside the first batch

    def _uid(self) -> int:
        if not hasattr(self._slot, "uid"):
            self._slot.uid = SLOT_UID_BASE + next(_slot_numbers)  # unique in this process, over all sandboxes
        return self._slot.uid

    def run(self, req: ExecRequest) -> ExecResult:
        result = run_code(req, self.limits, uid=self._uid())
        with self._lock:
            self._calls += 1
            self._counts[result.status] += 1
            self._wall += result.wall_s
        return result

    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]:
        """Results in input order."""
        return list(self._pool.map(self.run, reqs))

    def stats(self) -> dict:
        with self._lock:
            return {"calls": self._calls, "status": dict(self._counts), "total_wall_s": round(self._wall, 3),
                    "mean_wall_s": round(self._wall / self._calls, 4) if self._calls else 0.0}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
