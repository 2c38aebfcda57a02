"""Service-side handles of the executors: which zygote profile a snippet goes to, the interpreter and paths the
zygotes use, per-slot uids and cgroups, and the zygote processes themselves (framed JSON over two pipes).

A *slot* runs one call at a time. It owns an unprivileged uid, a memory and a pids cgroup, and one zygote per
profile (started on first use): "bare" (standard library only, the cheapest fork: most tool calls print
arithmetic) and "sci" (numpy + sympy preloaded), "verify" (math-verify preloaded, for reward checks). A snippet
goes to the smallest profile that preloads every non-stdlib module it imports.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).with_name("zygote.py")
_CHECKOUT = Path(__file__).resolve().parent.parent.parent  # the folder holding the rstar2 package
PROJECT_ROOT = _CHECKOUT if (_CHECKOUT / "pyproject.toml").exists() else None  # a source checkout: hidden
STDLIB_PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "re",
                  "json", "random", "statistics", "heapq", "bisect", "string", "datetime", "operator")
PROFILES: dict[str, tuple[str, ...]] = {"bare": (), "sci": ("numpy", "sympy"), "verify": ("math_verify",)}
WARMUPS = {  # run once in the zygote, so lazily built state (caches, submodules) is shared with every child
    "numpy": "import numpy\nnumpy.arange(6).reshape(2, 3).sum()",
    "sympy": "import sympy\nsympy.factorint(2**20 - 1)\nsympy.sympify('x**2 + 2*x + 1').factor()",
    "math_verify": "from math_verify import parse, verify\nverify(parse('$1/2$'), parse('\\\\boxed{0.5}'))",
}
HIDE = ("/root", "/home", "/run", "/var/tmp", "/mnt", "/srv", "/opt", "/media")  # besides the project itself
UID_BASE = 1_000_000  # process p's sandboxed code runs as uids UID_BASE + (p mod 2^20) * 1024 + [0, 1024)
MAX_SLOTS = 1024  # per process (all its services together)
FRAME = struct.Struct(">I")
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031

_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_]\w*)|import[ \t]+([^\n#;]+))", re.M)
_DYNAMIC = re.compile(r"(?:__import__|import_module)\(\s*['\"]([A-Za-z_]\w*)")


def imported_modules(code: str) -> set[str]:
    """Top-level names of the modules a snippet imports (static `import`/`from`, `__import__('x')`)."""
    names = set(_DYNAMIC.findall(code))
    for frm, imp in _IMPORT.findall(code):
        if frm:
            names.add(frm)
        else:
            names.update(part.split()[0].split(".")[0] for part in imp.split(",") if part.strip())
    return {n for n in names if n.isidentifier()}


def route(code: str, profiles: dict[str, tuple[str, ...]]) -> str:
    """The smallest profile whose preloads cover the snippet's non-stdlib imports, else the largest one
    (anything is still importable everywhere, only slower)."""
    heavy = imported_modules(code) - sys.stdlib_module_names
    by_size = sorted(profiles, key=lambda p: (len(profiles[p]), p))
    covering = [p for p in by_size if heavy <= {m.split(".")[0] for m in profiles[p]}]
    return covering[0] if covering else by_size[-1]


@dataclass
class Runtime:
    """The interpreter the zygotes run and the directories they import from (kept visible in the sandbox)."""
    python: str
    sys_path: list[str]
    keep_paths: list[str]


def pick_runtime() -> Runtime:
    """This environment's interpreter and site-packages (the mount namespace keeps them visible and read-only
    even under /root or /tmp). `RSTAR2_SANDBOX_PYTHON` picks another interpreter of the same minor version
    (e.g. Debian's world-readable one where the mount namespace is unavailable)."""
    python = os.environ.get("RSTAR2_SANDBOX_PYTHON") or os.path.realpath(sys.executable)
    stdlib = [sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")]
    dynload = [p for p in sys.path if p.endswith("lib-dynload")]
    site = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    sys_path = list(dict.fromkeys(os.path.realpath(p) for p in stdlib + dynload + site if p and os.path.isdir(p)))
    if os.environ.get("RSTAR2_SANDBOX_PYTHON"):  # its own stdlib, this environment's site-packages
        out = subprocess.run([python, "-I", "-S", "-c", "import sys, json; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, check=True)
        own = [p for p in json.loads(out.stdout) if p and os.path.isdir(p)]
        sys_path = own + [p for p in sys_path if p not in own and "site-packages" in p]
    prefix = os.path.realpath(os.path.dirname(os.path.dirname(python)))
    keep = list(dict.fromkeys([prefix, os.path.dirname(python)] + sys_path))
    return Runtime(python, sys_path, keep)


# ---------------------------------------------------------------------------------------------------------------
# cgroups: one memory and one pids cgroup per slot, nested under the service's own cgroup (so any limit on the
# service still applies). cgroup v1 (memory.limit_in_bytes, pids.max) or v2 (memory.max, pids.max).

def _own_cgroup(controller: str) -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if controller in ctrls.split(",") or (controller == "" and ctrls == ""):
                return path
    return None


def _v2_mount() -> str | None:
    for cand in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(cand, "cgroup.controllers")):
            return cand
    return None


@dataclass
class SlotCgroups:
    procs: dict[str, str] = field(default_factory=dict)  # controller -> cgroup.procs file the zygotes join
    oom_file: str | None = None
    dirs: list[str] = field(default_factory=list)


def _enable(group: str, controller: str) -> None:
    with open(os.path.join(group, "cgroup.controllers")) as f:
        if controller not in f.read().split():
            raise OSError(f"the {controller} controller is not available in {group}")
    with open(os.path.join(group, "cgroup.subtree_control"), "w") as f:
        f.write(f"+{controller}")


class Cgroups:
    """Creates `rstar2-sandbox-<pid>/slot-<k>` groups; `report` says which controllers work and why not."""

    def __init__(self, slots: int, memory_bytes: int, pids_max: int):
        self.tag = f"rstar2-sandbox-{os.getpid()}-{next_instance()}"
        self.report: dict[str, str] = {}
        self.parents: list[str] = []
        self.slots = [SlotCgroups() for _ in range(slots)]
        for controller, limit in (("memory", memory_bytes), ("pids", pids_max)):
            try:
                self._setup(controller, limit)
                self.report[f"cgroup_{controller}"] = "active"
            except OSError as e:
                self.report[f"cgroup_{controller}"] = f"unavailable: {e}"
                for s in self.slots:
                    s.procs.pop(controller, None)

    def _setup(self, controller: str, limit: int) -> None:
        v1 = f"/sys/fs/cgroup/{controller}"
        own = _own_cgroup(controller)
        if own is not None and os.path.exists(os.path.join(v1, "cgroup.procs")):
            base = os.path.join(v1, own.lstrip("/"))
            limit_file, oom_file, v2 = {"memory": "memory.limit_in_bytes", "pids": "pids.max"}[controller], \
                "memory.oom_control", False
        else:
            mount, own = _v2_mount(), _own_cgroup("")
            if mount is None or own is None:
                raise OSError(f"no {controller} cgroup controller mounted")
            base = os.path.join(mount, own.lstrip("/"))
            limit_file, oom_file, v2 = f"{controller}.max", "memory.events", True
        self._remove_stale(base)
        parent = os.path.join(base, self.tag)
        if v2:  # the controller must be enabled on the way down (fails where the base group holds processes)
            _enable(base, controller)
        os.makedirs(parent, exist_ok=True)
        self.parents.append(parent)
        if v2:
            _enable(parent, controller)
        for k, slot in enumerate(self.slots):
            d = os.path.join(parent, f"slot-{k}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(str(limit))
            slot.procs[controller] = os.path.join(d, "cgroup.procs")
            if d not in slot.dirs:
                slot.dirs.append(d)
            if controller == "memory":
                slot.oom_file = os.path.join(d, oom_file)

    @staticmethod
    def _remove_stale(base: str) -> None:
        """Groups left by services that died (their pid is gone) are removed."""
        for entry in Path(base).glob("rstar2-sandbox-*"):
            pid = entry.name.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                for d in sorted(entry.glob("slot-*")) + [entry]:
                    try:
                        d.rmdir()
                    except OSError:
                        pass

    def close(self) -> None:
        for d in [d for s in self.slots for d in s.dirs] + self.parents:
            for _ in range(50):  # the killed zygotes leave their groups asynchronously
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------------------

class ExecutorDied(Exception):
    pass


class ZygoteProc:
    """One zygote process: `send` a request frame, `read` complete reply frames when its pipe is readable."""

    def __init__(self, slot: int, profile: str, cfg: dict, runtime: Runtime, log_path: str):
        self.slot, self.profile, self.log_path = slot, profile, log_path
        # the whole environment, so `-I` (which would also ignore PYTHONHASHSEED) is not needed: -s -P are its other
        # parts. A fixed hash seed: a set of strings prints in the same order from every executor process
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
               "PYTHONHASHSEED": "0"}
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen([runtime.python, "-s", "-P", "-S", str(ZYGOTE), json.dumps(cfg)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=env,
                                         close_fds=True, start_new_session=True)
        self.pid = self.proc.pid
        self.fd_in, self.fd_out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        for fd in (self.fd_in, self.fd_out):
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)  # one outstanding request always fits
            except OSError:
                pass
        os.set_blocking(self.fd_out, False)
        self.buf = bytearray()
        self.ready = False
        self.started = time.monotonic()
        self.layers: dict[str, str] = {}

    def send(self, payload: bytes) -> None:
        data = memoryview(FRAME.pack(len(payload)) + payload)
        try:
            while data:
                data = data[os.write(self.fd_in, data):]
        except (BrokenPipeError, OSError) as e:
            raise ExecutorDied(f"zygote {self.profile}/{self.slot} closed its request pipe: {e}") from e

    def read(self) -> list[dict]:
        """Complete messages available now; raises ExecutorDied at end of file."""
        while True:
            try:
                chunk = os.read(self.fd_out, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                raise ExecutorDied(self.describe_exit())
            self.buf += chunk
        msgs = []
        while len(self.buf) >= 4:
            n = FRAME.unpack_from(self.buf)[0]
            if len(self.buf) < 4 + n:
                break
            msgs.append(json.loads(bytes(self.buf[4:4 + n])))
            del self.buf[:4 + n]
        return msgs

    def describe_exit(self) -> str:
        try:
            rc = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        return f"zygote {self.profile}/{self.slot} (pid {self.pid}) exited with {rc}; log: {self.log_tail()!r}"

    def log_tail(self, n: int = 600) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the host-side process: its pid-1 child dies with it (PDEATHSIG), and the kernel kills
        everything left in that pid namespace."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("zygote pid %d did not exit after SIGKILL", self.pid)

    def cpu_seconds(self) -> float:
        """CPU time of this zygote's whole tree so far (its pid 1 and the reaped calls): for benchmarks."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        pids = [self.pid]
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
            except (OSError, IndexError, ValueError):
                pass
        return total


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_instances = iter(range(1 << 62))


def allocate_uids(n: int) -> list[int]:
    """`n` uids of their own for the slots of one service (services of one process never share a uid: per-uid
    limits such as RLIMIT_NPROC, and signals, would otherwise cross between them)."""
    block = UID_BASE + (os.getpid() % (1 << 20)) * MAX_SLOTS
    with _uid_lock:
        free = [block + k for k in range(MAX_SLOTS) if block + k not in _uids_in_use][:n]
        if len(free) < n:
            raise ValueError(f"no {n} free sandbox uids left in this process ({MAX_SLOTS} slots at most)")
        _uids_in_use.update(free)
    return free


def release_uids(uids: list[int]) -> None:
    with _uid_lock:
        _uids_in_use.difference_update(uids)


def next_instance() -> int:
    return next(_instances)
