"""The sandbox executor: a warm interpreter ("zygote") that forks one hardened child per call.

This file is its own program, run by the service as root under the sandbox interpreter with the standard library
only: `python -s -P -S zygote.py CONFIG_JSON` (its environment is the service's, whole) (requests on fd 0, replies on
fd 1, as 4-byte length + JSON frames).

Once per zygote: join the slot's cgroups; unshare pid, mount, network, IPC and UTS
namespaces (the zygote is pid 1 of its own pid namespace, its network namespace is empty); make the whole file
tree read-only and hide the host's private trees (project, homes, /tmp, /run, ...) behind empty tmpfs mounts,
keeping only the interpreter's own directories visible; a size-limited tmpfs on /tmp is the only writable place
(cwd, HOME, TMPDIR) besides a private /dev/shm; preload the profile's modules and run their warm-up, `gc.freeze()`;
then harden itself as its children must be (rlimits, no_new_privs, a Landlock domain, a seccomp filter): children
inherit all of it at no cost. Every layer is tried, verified with a probe child that attempts what the layer forbids,
and reported in the ready message; a layer that cannot be set up is reported as unavailable, never skipped silently.

Per call: fork; the child sets its CPU limit, drops to the slot's unprivileged uid, closes every inherited
descriptor and runs the code with stdin/stdout/stderr on memfds. The zygote waits on a pidfd until the wall-clock
deadline, then SIGKILLs every process of its namespace (`kill(-1)` from pid 1 reaches `setsid()` escapees and
orphans too), reaps them all, reads head + tail of the output, replies, and empties /tmp and /dev/shm.
"""

import ast
import atexit
import builtins
import ctypes
import gc
import json
import linecache
import mmap
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import traceback
import types

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

# clone/unshare flags, mount flags, prctl options (linux uapi)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    0x1, 0x2, 0x4, 0x8, 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 1, 22, 38, 4
SECCOMP_MODE_FILTER = 2
AT_FDCWD, AT_RECURSIVE, AT_EMPTY_PATH = -100, 0x8000, 0x1000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH = 1, 0o2000000, 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
# syscall numbers ≥ 424 are the same on every architecture
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SETUP_FAILED = 125  # child exit code when a hardening step fails: the code never runs
CODE_NAME = "<code>"
MARKER = b"\n...(output truncated)...\n"
VERDICTS = {0: "none", 1: "ok", 2: "exception", 3: "memory_error"}


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _syscall(nr: int, *args) -> int:
    return _check(libc.syscall(ctypes.c_long(nr), *args), f"syscall {nr}")


def _mount(src, target, fstype, flags, data=None) -> None:
    def enc(s):
        return s.encode() if isinstance(s, str) else s

    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg: int = 0) -> None:
    _check(libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


# ----------------------------------------------------------------------------------------------------------------
# Landlock (kernel ≥ 5.13): a filesystem allowlist, no TCP bind/connect (ABI 4), no signals or abstract unix
# sockets outside the sandbox's own domain (ABI 6). The ruleset is built once; each child restricts itself with it.

LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    return _syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))


def landlock_ruleset(read_paths: list[str], write_paths: list[str], dev_paths: list[str]) -> tuple[int, int]:
    """(ruleset fd, ABI): read+execute under `read_paths`, everything under `write_paths`, read/write of the
    device files in `dev_paths`; nothing else, no TCP, no signals or abstract sockets across the domain."""
    abi = landlock_abi()
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        fs |= 1 << 13  # REFER
    if abi >= 3:
        fs |= LL_TRUNCATE
    if abi >= 5:
        fs |= LL_IOCTL_DEV
    attr = _RulesetAttr(fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = _syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    read = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
    rules = [(p, read) for p in read_paths] + [(p, fs) for p in write_paths] + \
            [(p, LL_READ_FILE | LL_WRITE_FILE | (LL_IOCTL_DEV if abi >= 5 else 0)) for p in dev_paths]
    for path, access in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # not on this system
        try:
            if not os.path.isdir(path):
                access &= LL_FILE_RIGHTS
            rule = _PathBeneath(access & fs, pfd)
            _syscall(SYS_LANDLOCK_ADD_RULE, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0))
        finally:
            os.close(pfd)
    return fd, abi


def _landlock_self(reads: list[str], writes: list[str], devs: list[str]) -> int:
    fd, abi = landlock_ruleset(reads, writes, devs)
    try:
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, ctypes.c_uint32(0))
    finally:
        os.close(fd)
    return abi


# ----------------------------------------------------------------------------------------------------------------
# seccomp-bpf: a deny-list compiled once (classic BPF over struct seccomp_data), loaded by each child with one
# prctl. Denied: new namespaces and mounts, ptrace and cross-process memory access, kernel keyrings, bpf,
# io_uring, perf, module/kexec/reboot/swap/clock changes; sockets other than AF_UNIX.

SYSCALLS = {  # name -> (x86_64, aarch64/asm-generic), checked against this machine's <asm/unistd*.h>
    "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "bpf": (321, 280), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "perf_event_open": (298, 241), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224), "swapoff": (168, 225),
    "acct": (163, 89), "userfaultfd": (323, 282), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "fanotify_init": (300, 262),
    "sethostname": (170, 161), "setdomainname": (171, 162), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171), "syslog": (103, 116),
    "quotactl": (179, 60), "kcmp": (312, 272), "lookup_dcookie": (212, 18), "vhangup": (153, 58),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "pidfd_getfd": (438, 438), "mount_setattr": (442, 442),
}
X86_ONLY = {"iopl": 172, "ioperm": 173, "uselib": 134}
NR_SOCKET, NR_CLONE, NR_CLONE3 = (41, 198), (56, 220), (435, 435)
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in SYSCALLS, AUDIT_ARCH_*
NS_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP
RET_KILL, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, EACCES, ENOSYS = 1, 13, 38


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program():
    """The compiled filter for this machine's architecture (a ctypes struct to hand to prctl)."""
    machine = os.uname().machine
    if machine not in ARCHES:
        raise OSError(f"no syscall table for architecture {machine}")
    col, audit_arch = ARCHES[machine]

    def ld(off):  # BPF_LD|BPF_W|BPF_ABS
        return (0x20, 0, 0, off)

    def jeq(k, jt, jf):  # BPF_JMP|BPF_JEQ|BPF_K
        return (0x15, jt, jf, k)

    def ret(k):  # BPF_RET|BPF_K
        return (0x06, 0, 0, k)

    prog = [ld(4), jeq(audit_arch, 1, 0), ret(RET_KILL), ld(0)]  # wrong arch: kill; then A = syscall nr
    if machine == "x86_64":
        prog += [(0x35, 0, 1, 0x40000000), ret(RET_ERRNO | EPERM)]  # BPF_JGE: the x32 ABI
    denied = [nrs[col] for nrs in SYSCALLS.values()] + (list(X86_ONLY.values()) if machine == "x86_64" else [])
    for nr in denied:
        prog += [jeq(nr, 0, 1), ret(RET_ERRNO | EPERM)]
    prog += [jeq(NR_CLONE3[col], 0, 1), ret(RET_ERRNO | ENOSYS)]  # flags hidden in a struct: libc falls back
    prog += [jeq(NR_CLONE[col], 0, 4), ld(16), (0x45, 0, 1, NS_FLAGS), ret(RET_ERRNO | EPERM), ret(RET_ALLOW)]
    prog += [jeq(NR_SOCKET[col], 0, 4), ld(16), jeq(1, 1, 0), ret(RET_ERRNO | EACCES), ret(RET_ALLOW)]  # AF_UNIX
    prog.append(ret(RET_ALLOW))
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    fprog._keep = filters
    return fprog


def _seccomp_self() -> None:
    prog = seccomp_program()
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")


# ----------------------------------------------------------------------------------------------------------------
# Namespaces and the file tree (once per zygote)

def _open_tree(path: str) -> int:
    return _syscall(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), path.encode(),
                    ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE))


def _move_mount(fd: int, target: str) -> None:
    _syscall(SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD), target.encode(),
             ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _readonly_tree(path: str) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    _syscall(SYS_MOUNT_SETATTR, ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(AT_RECURSIVE),
             ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _cover(target: str, keep: list[str], opts: str, readonly: bool) -> list[str]:
    """Mount a fresh tmpfs on `target`, keeping the paths of `keep` that lie under it visible (read-only clones
    of the original mounts, moved back to the same path). Returns the kept paths."""
    kept = [p for p in keep if _under(p, target) and p != target and os.path.exists(p)]
    clones = [(p, os.path.isdir(p), _open_tree(p)) for p in kept]  # before covering: then they are gone
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for path, is_dir, fd in clones:
        if is_dir:
            os.makedirs(path, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            open(path, "w").close()
        _move_mount(fd, path)
        os.close(fd)
    if readonly:
        _mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return kept


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class Zygote:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.layers: dict[str, str] = {}  # layer -> "active..." | "unavailable: why"
        self.uid = cfg["uid"]
        self.workdir = "/tmp"
        self.oom_adj_fd = -1
        self.protected: set[str] = set()  # top-level names under /tmp that hold kept mounts (never wiped)
        self.oom_fd = os.open(cfg["oom_file"], os.O_RDONLY | os.O_CLOEXEC) if cfg.get("oom_file") else -1
        self.verdict = mmap.mmap(-1, 1)  # shared with each child: how its code ended (0 = did not finish)
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)

    def _try(self, layer: str, fn, *args):
        try:
            out = fn(*args)
            self.layers[layer] = "active"
            return out
        except Exception as e:  # reported in the ready message and logged by the service, never silent
            self.layers[layer] = f"unavailable: {e}"
            return None

    # -- once per zygote ------------------------------------------------------------------------------------
    def setup_namespaces(self) -> None:
        """Still the host-side process: join cgroups, unshare, then fork the namespace's pid 1 (returns in it)."""
        for controller, procs in self.cfg["cgroups"].items():  # children inherit them: no per-call cost
            self._try(f"cgroup_{controller}", _write, procs, str(os.getpid()))
        root = os.geteuid() == 0
        flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID | CLONE_NEWNET
        if not root:
            flags |= CLONE_NEWUSER
        uid, gid = os.getuid(), os.getgid()
        try:
            _check(libc.unshare(flags), "unshare")
            if not root:  # inside a user namespace we stay our own (unprivileged) uid
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"{uid} {uid} 1")
                _write("/proc/self/gid_map", f"{gid} {gid} 1")
            ok = True
        except OSError as e:
            ok = False
            for name in ("pid_namespace", "network_namespace", "mount_namespace", "ipc_namespace", "uts_namespace"):
                self.layers[name] = f"unavailable: {e}"
        if ok:
            for name in ("pid_namespace", "network_namespace", "mount_namespace", "ipc_namespace", "uts_namespace"):
                self.layers[name] = "active"
            if not root:
                self.layers["user_namespace"] = "active"
            pid = os.fork()
            if pid:  # host side: nothing more to do than to mirror pid 1's fate
                os.dup2(self.devnull, 0)
                os.dup2(self.devnull, 1)
                _, status = os.waitpid(pid, 0)
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the host-side process died: take the namespace down
        self.ns = ok

    def setup_files(self) -> None:
        cfg = self.cfg
        if not self.ns:
            self.layers.update(private_tmp="unavailable: no mount namespace",
                               readonly_root="unavailable: no mount namespace")
            self._use_fallback_workdir()
            return
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
        self._try("readonly_root", _readonly_tree, "/")
        keep = sorted({os.path.realpath(p) for p in cfg["keep_paths"]})
        uid = self.uid if self.uid is not None else os.getuid()
        try:
            kept = _cover("/tmp", keep, f"size={cfg['tmpfs_mb']}m,nr_inodes=16k,mode=1700,uid={uid},gid={uid}",
                          readonly=False)
            self.protected = {p[len("/tmp/"):].split("/")[0] for p in kept}
            self.layers["private_tmp"] = "active"
        except OSError as e:
            self.layers["private_tmp"] = f"unavailable: {e}"
            self._use_fallback_workdir()
        self._try("private_dev_shm", _mount, "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={cfg['tmpfs_mb']}m,nr_inodes=4k,mode=1777")
        hidden = []
        for target in cfg["hide_paths"]:
            if os.path.isdir(target) and not _under(target, "/tmp") and os.path.realpath(target) == target \
                    and not any(_under(target, p) for p in keep):  # never hide what the interpreter needs
                try:
                    _cover(target, keep, "size=1m,mode=0755", readonly=True)
                    hidden.append(target)
                except OSError as e:
                    self.layers["hidden_paths"] = f"unavailable: {target}: {e}"
        if "hidden_paths" not in self.layers:
            self.layers["hidden_paths"] = "active: " + " ".join(hidden)
        self._try("private_proc", _mount, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        # SysV IPC of this namespace cannot carry state from one call to the next: no message queues or
        # semaphore sets at all, shared memory destroyed when its last user exits
        self._try("ipc_limits", lambda: (_write("/proc/sys/kernel/msgmni", "0"),
                                         _write("/proc/sys/kernel/sem", "250 32000 32 0"),
                                         _write("/proc/sys/kernel/shm_rmid_forced", "1")))

    def _use_fallback_workdir(self) -> None:
        self.workdir = os.environ["HOME"] = os.environ["TMPDIR"] = self.cfg["fallback_workdir"]

    def preload(self) -> None:
        sys.path[:] = self.cfg["sys_path"]
        for name in self.cfg["preload"]:
            __import__(name)
        if self.cfg.get("warmup"):
            exec(compile(self.cfg["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
        sys.set_int_max_str_digits(0)  # big-integer math is the point of the tool
        atexit._clear()  # children run only the exit handlers their own code registers
        gc.collect()
        gc.freeze()  # keep the warm heap shared with the children: the collector would touch (copy) it

    def setup_hardening(self) -> None:
        """Every per-call layer that needs no per-call value is applied to the zygote itself, once: its children
        inherit rlimits, cwd, no_new_privs, the Landlock domain and the seccomp filter for free (a child that ran
        those syscalls itself would pay ~0.5 ms of copied pages per call). A child only sets its CPU limit, drops
        to the slot's uid and closes what it inherited."""
        cfg = self.cfg
        try:  # kept open: written around each fork (1000 for the child, -1000 again for the zygote)
            self.oom_adj_fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
            os.write(self.oom_adj_fd, b"-1000")
        except OSError:
            self.oom_adj_fd = -1
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        mb = 1024 * 1024
        limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256),
                  (resource.RLIMIT_FSIZE, cfg["max_file_mb"] * mb), (resource.RLIMIT_AS, vm + cfg["memory_mb"] * mb)]
        if self.uid is not None:  # counts per uid (root is exempt): binds the children once they drop to the slot's
            limits.append((resource.RLIMIT_NPROC, cfg["max_processes"]))
        self._try("rlimits", lambda: [resource.setrlimit(res, (v, v)) for res, v in limits])
        self.layers["unprivileged_uid"] = "active" if self.uid is not None else \
            "unavailable: not root (code runs as the service's own uid)"
        os.chdir(self.workdir)
        self._try("no_new_privs", _prctl, PR_SET_NO_NEW_PRIVS, 1)
        reads = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc", "/sys/devices/system/cpu",
                 *cfg["keep_paths"]]
        writes = [self.workdir, "/dev/shm"]
        devs = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
        abi = self._try("landlock", _landlock_self, reads, writes, devs)
        if abi:
            self.layers["landlock"] = f"active (ABI {abi})"
        self._try("seccomp", _seccomp_self)
        self._verify_layers()

    def _verify_layers(self) -> None:
        """Each layer must really hold. The network namespace must have no interface but a (down) loopback;
        a probe child applies every per-call layer and attempts what each one forbids. A layer whose probe is
        not denied (or whose setup failed) is turned off and reported."""
        if self.ns:
            with open("/proc/self/net/dev") as f:
                ifaces = [line.split(":")[0].strip() for line in f.readlines()[2:]]
            if ifaces != ["lo"]:
                self.layers["network_namespace"] = f"unavailable: interfaces {ifaces}"
        probes = {"unprivileged_uid": "os.setuid(0)", "landlock": "os.listdir('/')",
                  "seccomp": "socket.socket(socket.AF_INET)"}
        code = "import os, socket\nfails = []\n"
        for layer, attempt in probes.items():
            code += f"try:\n    {attempt}\n    fails.append({layer!r})\nexcept OSError:\n    pass\n"
        code += "print(','.join(fails))"
        res = self.call({"code": code, "timeout_s": 10.0, "cpu_s": 10, "max_output_bytes": 4096, "probe": True})
        if res["exit_code"] != 0:
            raise RuntimeError(f"probe child failed ({res['status']}): {res['stderr'][-500:]}")
        for layer in filter(None, res["stdout"].strip().split(",")):
            if self.layers.get(layer, "").startswith("active"):
                self.layers[layer] = "unavailable: its probe was not denied"
        self.layers["kill_all_after_call"] = "active (pid 1 of the namespace)" if self.ns else \
            "unavailable: process group only (setsid() escapees survive)"

    # -- per call -------------------------------------------------------------------------------------------
    def _memfd(self, name: str, data: bytes = b"") -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        if data:
            os.write(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _child(self, req: dict, split: tuple[int, int] | None, fin: int, fout: int, ferr: int) -> None:
        try:
            os.dup2(fin, 0)
            os.dup2(fout, 1)
            os.dup2(ferr, 2)
            if not self.ns:
                os.setsid()  # no pid namespace: at least a process group of its own to kill
            cpu = int(req["cpu_s"])
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            if self.uid is not None:
                os.setgroups([])
                os.setresgid(self.uid, self.uid, self.uid)
                os.setresuid(self.uid, self.uid, self.uid)
            os.closerange(3, 1 << 16)  # our request/reply pipes and everything else inherited
        except BaseException as e:
            os.write(2, f"[sandbox] setup failed: {e!r}\n".encode())
            os._exit(SETUP_FAILED)
        os._exit(_run_code(req["code"], split, self.verdict))

    def call(self, req: dict) -> dict:
        t0 = time.monotonic()
        stdin = req.get("stdin") or ""
        fin = self._memfd("stdin", stdin.encode("utf-8", "replace")) if stdin else self.devnull
        fout, ferr = self._memfd("stdout"), self._memfd("stderr")
        self.verdict[0] = 0
        oom_before = self._oom_kills()
        split = _trailing_expression(req["code"])
        self._oom_adj(b"1000")  # inherited: the code, never the zygote, is what the OOM killer takes
        pid = os.fork()
        if pid == 0:
            self._child(req, split, fin, fout, ferr)
        self._oom_adj(b"-1000")
        pidfd = os.pidfd_open(pid)
        timed_out = not select.select([pidfd], [], [], req["timeout_s"])[0]
        if timed_out and self.ns:
            _signal_all()
        _, status, usage = os.wait4(pid, 0) if self.ns else _kill_group_and_reap(pid)
        wall = time.monotonic() - t0
        self._kill_all(pid)  # leftovers: background children, setsid() escapees
        os.close(pidfd)
        cap = req["max_output_bytes"]
        stdout, cut_out, size_out = _read_capped(fout, cap, 0.5)
        stderr, cut_err, _ = _read_capped(ferr, cap, 0.25)
        for fd in (fout, ferr) + ((fin,) if fin != self.devnull else ()):
            os.close(fd)
        rc = os.waitstatus_to_exitcode(status)
        sig = -rc if rc < 0 else None
        verdict = VERDICTS.get(self.verdict[0], "none")
        flood = size_out >= self.cfg["max_file_mb"] * 1024 * 1024
        if timed_out or sig == signal.SIGXCPU:
            st = "timeout"
        elif verdict == "memory_error" or (sig == signal.SIGKILL and self._oom_kills() > oom_before):
            st = "memory"
        elif flood:
            st = "output_truncated"
            stderr += f"\n[sandbox] output stopped at the {self.cfg['max_file_mb']} MB limit"
        elif sig is not None:
            st = "killed"
            stderr += f"\n[sandbox] killed by {_signame(sig)}"
        elif rc == SETUP_FAILED and stderr.startswith("[sandbox] setup failed"):
            st = "error"
        elif rc != 0:
            st = "error"
        else:
            st = "output_truncated" if (cut_out or cut_err) else "ok"
        return {"status": st, "stdout": stdout, "stderr": stderr,
                "exit_code": None if (timed_out or sig is not None) else rc, "signal": sig,
                "wall_s": round(wall, 6), "cpu_s": round(usage.ru_utime + usage.ru_stime, 6)}

    def _oom_adj(self, value: bytes) -> None:
        if self.oom_adj_fd >= 0:
            os.pwrite(self.oom_adj_fd, value, 0)

    def _kill_all(self, pid: int) -> None:
        """SIGKILL every other process of the namespace and reap them (we are its pid 1)."""
        if not self.ns:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        if not _signal_all():
            return
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return

    def _oom_kills(self) -> int:
        """OOM kills so far in the slot's memory cgroup (its oom_control/memory.events, kept open)."""
        if self.oom_fd < 0:
            return 0
        data = os.pread(self.oom_fd, 4096, 0)
        at = data.find(b"oom_kill ")
        return int(data[at + 9:data.index(b"\n", at)]) if at >= 0 else 0

    def wipe(self) -> None:
        """Empty /tmp and /dev/shm for the next call (after the reply: off the caller's latency). If that fails,
        exit: the service starts a fresh zygote, so no state can reach the next call."""
        try:
            for top in (self.workdir, "/dev/shm"):
                with os.scandir(top) as it:
                    entries = [e for e in it if not (top == "/tmp" and e.name in self.protected)]
                for e in entries:
                    _remove(e.path)
        except OSError as e:
            sys.stderr.write(f"[zygote] cannot wipe the work dirs ({e!r}): exiting for a fresh start\n")
            os._exit(3)


def _signal_all() -> bool:
    """SIGKILL every process of our pid namespace but ourselves; False if there was none."""
    try:
        os.kill(-1, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _kill_group_and_reap(pid: int):
    """Without a pid namespace: kill the call's process group before reaping its leader (which pins the pgid)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return os.wait4(pid, 0)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for e in os.scandir(path):
                _remove(e.path)
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _read_capped(fd: int, cap: int, head_frac: float) -> tuple[str, bool, int]:
    """Head + tail of an output memfd, at most `cap` bytes kept; (text, truncated, full size)."""
    size = os.fstat(fd).st_size
    if size <= cap:
        data, cut = os.pread(fd, size, 0), False
    else:
        head = int(cap * head_frac)
        data = os.pread(fd, head, 0) + MARKER + os.pread(fd, cap - head, size - (cap - head))
        cut = True
    return data.decode("utf-8", "replace"), cut, size


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _trailing_expression(code: str) -> tuple[int, int] | None:
    """(line, column) where a final bare expression starts, or None. Parsed here in the zygote, not in each child:
    building an AST in the child costs ~0.5 ms of copied pages per call. Large sources are left to the child."""
    if len(code) > 20_000:
        return None
    try:
        body = ast.parse(code, CODE_NAME).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # the child compiles it again and reports the error
    if body and isinstance(body[-1], ast.Expr):
        return body[-1].lineno, body[-1].col_offset
    return None


def _split(code: str, split: tuple[int, int] | None) -> tuple[str, str | None]:
    """The statements, and the final expression padded so its line numbers stay those of the original."""
    if split is None:
        return code, None
    if split == (-1, -1):  # large source: find the split here, in the child
        body = ast.parse(code, CODE_NAME).body
        if not (body and isinstance(body[-1], ast.Expr)):
            return code, None
        split = body[-1].lineno, body[-1].col_offset
    line, col = split
    lines = code.splitlines(True)
    offset = sum(len(x) for x in lines[:line - 1]) + len(lines[line - 1].encode()[:col].decode("utf-8", "replace"))
    return code[:offset], "\n" * (line - 1) + code[offset:].strip()


def _run_code(code: str, split: tuple[int, int] | None, verdict: mmap.mmap) -> int:
    """Run the snippet as a fresh `__main__`, IPython-style (the repr of a last bare expression is printed, as
    the released tool does); normal interpreter exit semantics (non-daemon threads joined, atexit run)."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = main, [""]
    linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)
    rc = 0
    try:
        try:
            if split is None and len(code) > 20_000:
                split = (-1, -1)
            stmts, last = _split(code, split)
            exec(compile(stmts, CODE_NAME, "exec"), main.__dict__)
            if last is not None:
                value = eval(compile(last, CODE_NAME, "eval"), main.__dict__)
                if value is not None:
                    print(repr(value))
            verdict[0] = 1
        except SystemExit as e:
            verdict[0] = 1
            rc = _exit_code(e)
        except BaseException as e:
            verdict[0] = 3 if isinstance(e, MemoryError) else 2
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != CODE_NAME:
                tb = tb.tb_next  # hide our own frames
            try:
                sys.stdout.flush()
            except BaseException:
                pass
            traceback.print_exception(type(e), e, tb)
            rc = 1
        if threading.active_count() > 1:
            threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException:
        rc = rc or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return rc


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _read_exact(n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _send(obj: dict) -> None:
    data = json.dumps(obj).encode()  # ASCII: lone surrogates in model text survive as escapes
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the service thread that started us is gone: so are we
    if os.getppid() != cfg["service_pid"]:
        os._exit(1)
    z = Zygote(cfg)
    z.setup_namespaces()
    z.setup_files()
    z.preload()
    z.setup_hardening()
    _send({"ready": True, "layers": z.layers, "python": sys.version.split()[0]})
    while True:
        header = _read_exact(4)
        if header is None:
            os._exit(0)
        req = json.loads(_read_exact(struct.unpack(">I", header)[0]))
        _send(z.call(req))
        z.wipe()


if __name__ == "__main__":
    main()
