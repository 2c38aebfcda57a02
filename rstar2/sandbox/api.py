"""What a caller sends and gets back, whichever way the service is reached (in-process, HTTP, Ray, Docker)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

Status = Literal["ok", "error", "timeout", "memory", "killed", "output_truncated"]
OK, ERROR, TIMEOUT, MEMORY, KILLED, OUTPUT_TRUNCATED = "ok", "error", "timeout", "memory", "killed", "output_truncated"
STATUSES: tuple[str, ...] = (OK, ERROR, TIMEOUT, MEMORY, KILLED, OUTPUT_TRUNCATED)
TRUNCATION_MARKER = "\n...(output truncated)...\n"  # between the head and the tail of a cut output
MAX_REQUEST_BYTES = 512 * 1024  # code + stdin; larger requests get an error result without running


class QueueFull(Exception):
    """The service's queue is at capacity (backpressure): retry later."""


class SandboxUnavailable(RuntimeError):
    """The service cannot run code (executor fails to start, service closed, remote unreachable after retries)."""


@dataclass
class ExecRequest:
    code: str
    stdin: str = ""  # the paper's tool is python_code_with_standard_io(code, input)
    timeout_s: float | None = None  # wall-clock limit for this call; None = the service's limit

    def validate(self) -> None:
        if not isinstance(self.code, str) or not isinstance(self.stdin, str):
            raise ValueError("code and stdin must be strings")
        if self.timeout_s is not None and not (0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s must be in (0, 3600], got {self.timeout_s}")

    @classmethod
    def from_dict(cls, d: dict) -> ExecRequest:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown request fields: {sorted(unknown)}")
        return cls(**d)


@dataclass
class ExecResult:
    status: Status
    stdout: str
    stderr: str  # the traceback for an exception (our own frames hidden)
    exit_code: int | None  # None when killed by a signal or at the timeout
    wall_s: float  # execution, from fork to exit
    cpu_s: float
    signal: int | None = None
    queue_s: float = 0.0  # waiting in the service's queue
    latency_s: float = 0.0  # submit -> result, as the service saw it
    profile: str = ""  # which warm executor ran it ("bare", "sci", "verify")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExecResult:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class SandboxLimits:
    timeout_s: float = 4.0  # wall clock, as the released code-judge's MAX_EXECUTION_TIME
    memory_mb: int = 512  # address space of each process beyond the warm interpreter's own
    cpu_s: int = 4  # RLIMIT_CPU of each process
    max_processes: int = 64  # RLIMIT_NPROC of the slot's uid (and its pids cgroup)
    max_file_mb: int = 16  # RLIMIT_FSIZE: every file written, stdout and stderr included
    max_output_chars: int = 4000  # per stream, head + tail kept
    tmpfs_mb: int = 64  # the private /tmp (and /dev/shm) of each executor
