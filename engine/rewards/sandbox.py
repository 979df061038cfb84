"""Run untrusted programs (model-written code) in a throw-away sandbox, many at once.

Each program runs in a fresh temporary directory (its cwd, HOME and TMPDIR; removed afterwards)
under resource limits set by util-linux `prlimit` before exec (no Python `preexec_fn`, which is
unsafe in a threaded trainer):

    RLIMIT_CPU    cpu_s           CPU seconds (SIGXCPU, then SIGKILL one second later)
    RLIMIT_AS     memory_mb       address space per process: a 10 GB allocation fails
    RLIMIT_FSIZE  max_file_mb     per written file (stdout/stderr included): SIGXFSZ
    RLIMIT_NPROC  max_procs       processes + threads of the sandbox user, counted from the
                                  user's current count: stops fork bombs
    RLIMIT_CORE   0               no core files

plus a wall-clock timeout after which the whole process tree is killed.

Isolation paths (`isolation()` says which one this machine gets; probed once):

- "namespace" (Linux with `unshare`): the program runs in new network and PID namespaces.
  The network namespace has only a down loopback, so nothing (not even 127.0.0.1) can be
  reached. The run's first process (REAPER, which starts the program) is PID 1 of its
  namespace: when it dies the kernel kills every process in the namespace, including ones that
  left the process group (setsid, double fork). As root, `unshare` drops to `user` (default
  nobody) inside the namespaces: the kernel never applies RLIMIT_NPROC to uid 0, so without
  the drop a fork bomb would be unlimited. Not root: a user namespace mapping the current user (`--map-current-user`).
- "process" (no usable `unshare`): a new session / process group, killed as a group plus
  every descendant found in /proc; as root, still run as `user`. Network: a Python prelude
  replaces socket creation with PermissionError. This is best effort, not a security
  boundary (ctypes can still reach libc). The reaper is a child subreaper, so processes that
  leave the session still come back to it and are killed, unless the program kills the reaper
  first (same user). Programs see, and can signal, other runs' processes of the same user.

Not covered by either path: total disk use (RLIMIT_FSIZE is per file; a program may write many
files, into its own directory or a world-writable one such as /tmp) and total memory across a
program's processes (RLIMIT_AS is per process; max_procs bounds the product).

Tests: tests/test_sandbox.py
"""
import dataclasses
import functools
import logging
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)

ISOLATIONS = ("auto", "namespace", "process")
ENV_VAR = "TRIDENT_SANDBOX"  # JSON of SandboxConfig fields: reaches Ray reward workers too
_MB = 1 << 20


@dataclass(frozen=True)
class SandboxConfig:
    """`reward_model.sandbox.*`: limits for each program run."""
    timeout_s: float = 10.0      # wall clock per program
    cpu_s: float = 5.0           # CPU time per process
    memory_mb: int = 1024        # address space per process
    max_file_mb: int = 16        # size of any one file written
    max_procs: int = 32          # processes + threads at once (the program itself included)
    network: bool = False        # False: no network at all
    max_concurrency: int = 4     # programs run at once per batch
    user: str = "nobody"         # as root: the unprivileged user programs run as
    python: Optional[str] = None  # interpreter; None: this one if `user` can run it, else python3
    isolation: str = "auto"      # auto (namespace when it works) | namespace | process
    max_output_kb: int = 64      # stdout / stderr kept for the result (the tail)

    def __post_init__(self):
        positive = ("timeout_s", "cpu_s", "memory_mb", "max_file_mb", "max_procs",
                    "max_concurrency", "max_output_kb")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"reward_model.sandbox.{name}={value!r}: must be a number > 0; "
                                 f"set a positive value (default {_DEFAULTS[name]!r})")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"reward_model.sandbox.isolation={self.isolation!r}: use one of "
                             f"{ISOLATIONS}")
        if self.memory_mb < 64:
            raise ValueError(f"reward_model.sandbox.memory_mb={self.memory_mb!r}: the Python "
                             "interpreter alone needs more; use at least 64")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SandboxConfig)}


def config_from(value=None) -> SandboxConfig:
    """SandboxConfig from a dataclass, a dict / mapping (the YAML section), or None: the
    $TRIDENT_SANDBOX JSON when set (how a configured driver reaches Ray workers), else defaults."""
    if isinstance(value, SandboxConfig):
        return value
    if value is None:
        import json
        value = json.loads(os.environ.get(ENV_VAR) or "{}")
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    unknown = sorted(set(value) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"reward_model.sandbox has unknown key(s) {unknown}; known keys: "
                         f"{sorted(_DEFAULTS)}")
    return SandboxConfig(**dict(value))


def configure(value) -> SandboxConfig:
    """Make `value` the default for this process and the processes it starts (Ray workers)."""
    import json
    cfg = config_from(value)
    os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(cfg))
    return cfg


@dataclass
class Result:
    returncode: Optional[int]    # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    pid: int                     # the run's first process, also its session id (now gone)

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class Isolation:
    kind: str                    # "namespace" or "process"
    network: str                 # "namespace", "prelude" or "allowed"
    user: str                    # who programs run as, e.g. "nobody (uid 65534)"
    python: str

    def describe(self):
        return (f"sandbox: {self.kind} isolation, network {self.network}, runs as {self.user}, "
                f"python {self.python}")


# -- probing ----------------------------------------------------------------------------------
def sandbox_uid(cfg):
    """(uid, gid, label) programs run as: `cfg.user` when we are root (see module doc)."""
    if os.geteuid() != 0 or not cfg.user:
        return None, None, f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()}, this user)"
    try:
        entry = pwd.getpwnam(cfg.user)
    except KeyError:
        raise ValueError(f"reward_model.sandbox.user={cfg.user!r}: no such user on this machine; "
                         "name an existing unprivileged user (e.g. nobody)") from None
    if entry.pw_uid == 0:
        raise ValueError(f"reward_model.sandbox.user={cfg.user!r} is root: root ignores "
                         "RLIMIT_NPROC, so fork bombs would be unlimited; name an unprivileged user")
    return entry.pw_uid, entry.pw_gid, f"{cfg.user} (uid {entry.pw_uid})"


def _runnable_by_others(path):
    """Whether a user other than the owner can execute `path` (every directory searchable)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & 0o001:
        return False
    return _searchable_by_others(os.path.dirname(real))


def _searchable_by_others(directory):
    parent = os.path.realpath(directory)
    while True:
        if not os.stat(parent).st_mode & 0o001:
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def _python(cfg, uid):
    if cfg.python:
        return cfg.python
    if uid is None or _runnable_by_others(sys.executable):
        return sys.executable
    # e.g. a pyenv interpreter under /root (mode 700): the sandbox user cannot start it
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if candidate and _runnable_by_others(candidate):
            return candidate
    raise ValueError(f"reward_model.sandbox.python: the sandbox user cannot run {sys.executable!r} "
                     "and no world-executable python3 was found; set reward_model.sandbox.python")


def _namespace_prefix(uid, gid, network):
    prefix = [shutil.which("unshare") or "unshare", "--pid", "--fork", "--kill-child"]
    if not network:
        prefix.append("--net")
    if os.geteuid() != 0:
        prefix.append("--map-current-user")  # a user namespace: allowed without root
    elif uid is not None:
        prefix += ["--setgid", str(gid), "--setuid", str(uid)]
    return prefix + ["--"]


@functools.cache
def _probe(cfg_isolation, network, uid, gid):
    """Whether the namespace path works here (cached per setting)."""
    if cfg_isolation == "process" or not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return False
    try:
        proc = subprocess.run(_namespace_prefix(uid, gid, network) + ["true"], capture_output=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip()
        if cfg_isolation == "namespace":
            raise RuntimeError("reward_model.sandbox.isolation='namespace' but `unshare` fails here "
                               f"({why}); use isolation=auto or process")
        logger.warning("sandbox: `unshare` fails here (%s); using process isolation", why)
        return False
    return True


def isolation(cfg=None) -> Isolation:
    cfg = config_from(cfg)
    uid, gid, label = sandbox_uid(cfg)
    namespace = _probe(cfg.isolation, cfg.network, uid, gid)
    network = "allowed" if cfg.network else ("namespace" if namespace else "prelude")
    return Isolation("namespace" if namespace else "process", network, label, _python(cfg, uid))


# -- one run ----------------------------------------------------------------------------------
# Runs before the program on the "process" path: refuse socket creation (best effort).
NO_NETWORK_PRELUDE = '''\
import socket as _s, _socket as _ss
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in this sandbox")
for _m in (_s, _ss):
    for _name in ("socket", "socketpair", "fromfd", "create_connection", "create_server",
                  "getaddrinfo", "gethostbyname"):
        if hasattr(_m, _name):
            setattr(_m, _name, _no_network)
del _m, _name, _s, _ss
'''


# The first process of every run (PID 1 of the namespace, or the session leader): it starts
# the program, reaps every orphan (as PID 1, or as a child subreaper: so none is left to the
# machine's init as a zombie, and none escapes by leaving the session), and when the program
# ends, kills whatever it left running and exits with the program's status.
REAPER = '''\
import ctypes, os, signal, sys
init = os.getpid() == 1  # PID 1 of a namespace: when it exits the kernel kills the rest
if not init:
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to us, not to init
main = os.fork()
if main == 0:
    os.execv(sys.argv[1], sys.argv[1:])
def children():
    me, out = str(os.getpid()), []
    for name in os.listdir("/proc"):
        try:
            with open("/proc/" + name + "/stat", "rb") as f:
                if name.isdigit() and f.read().rsplit(b")", 1)[1].split()[1].decode() == me:
                    out.append(int(name))
        except OSError:
            pass
    return out
status = None
while True:
    if status is not None:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        pid, st = os.wait()
    except ChildProcessError:
        break
    if pid == main:
        status = st
        if init:
            break
if os.WIFSIGNALED(status):  # die of the program's signal, so the caller sees it
    if os.WTERMSIG(status) != signal.SIGKILL:
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
'''


def _count_processes(uid):
    import psutil
    n = 0
    for p in psutil.process_iter(["uids"]):
        try:
            n += p.info["uids"] is not None and p.info["uids"].real == uid
        except psutil.Error:
            pass
    return n


def _limits(cfg, uid):
    if not shutil.which("prlimit"):
        raise RuntimeError("the code sandbox needs util-linux's `prlimit` (apt-get install "
                           "util-linux); it sets the resource limits before the program starts")
    # NPROC counts every process of the user: allow max_procs more than it has now
    nproc = _count_processes(os.getuid() if uid is None else uid) + int(cfg.max_procs)
    cpu = max(1, int(round(cfg.cpu_s)))
    return [shutil.which("prlimit"), f"--cpu={cpu}:{cpu + 1}",
            f"--as={int(cfg.memory_mb) * _MB}", f"--fsize={int(cfg.max_file_mb) * _MB}",
            f"--nproc={nproc}", "--core=0", "--"]


def _wait_unreaped(pid, timeout):
    """Wait for `pid` to exit without reaping it (its pid, also its session and group id, stays
    taken, so nothing found by those ids afterwards can be an unrelated process). True: exited."""
    deadline = time.monotonic() + timeout
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    try:
        while True:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if pidfd is not None:
                select.select([pidfd], [], [], left)  # readable when the process exits
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def process_table():
    """{pid: (ppid, session id, zombie)} of every process, from /proc/<pid>/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), int(fields[3]), fields[0] in (b"Z", b"X"))
    return table


def run_members(top, table=None):
    """{pid: zombie} of the processes a run started: the descendants of `top` (its first
    process) and whatever else is in its session; `top` itself excluded."""
    table = process_table() if table is None else table
    found = {pid for pid, (_, sid, _) in table.items() if sid == top}
    frontier = [top]
    while frontier:  # descendants, also those that left the session
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _, _) in table.items() if ppid == parent and pid not in found]
        found.update(kids)
        frontier += kids
    found.discard(top)
    return {pid: table[pid][2] for pid in found}


def _kill_all(proc):
    """SIGKILL everything the run started, then reap `proc`. Children first, `proc` (the
    REAPER, or `unshare` above it) last, once they are reaped, so no zombie is left to the
    machine's init. Killing a namespace's PID 1 takes every process of the namespace along."""
    for _ in range(3000):  # a fork bomb may fork while we kill: until none is left
        members = run_members(proc.pid)
        if not members:
            break
        for pid, zombie in members.items():
            try:
                if not zombie:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)
    else:
        logger.warning("sandbox: processes of run %d outlived 3000 kill rounds: %s", proc.pid,
                       sorted(run_members(proc.pid)))
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _remove(path):
    def retry(func, target, _):
        os.chmod(os.path.dirname(target), 0o700)  # a program may have chmod'ed its files away
        func(target)
    shutil.rmtree(path, onerror=retry)


def _tail(path, limit):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - limit))
        return f.read().decode(errors="replace")


_ANNOUNCED = set()


def _announce(cfg):
    """Log once per setting which isolation path the runs take."""
    key = (cfg.isolation, cfg.network, cfg.user, cfg.python)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        logger.info(isolation(cfg).describe())


def run(files: Dict[str, str], main: str, cfg=None, env: Optional[Dict[str, str]] = None,
        stdin: Optional[str] = None) -> Result:
    """Write `files` (name -> text) into a fresh directory and run `python main` there under
    the sandbox, `stdin` on its standard input (from an already unlinked file: no name a
    program could find it by); the directory and every process are gone when this returns."""
    cfg = config_from(cfg)
    _announce(cfg)
    uid, gid, _ = sandbox_uid(cfg)
    namespace = _probe(cfg.isolation, cfg.network, uid, gid)
    python = _python(cfg, uid)
    if uid is not None and not _searchable_by_others(tempfile.gettempdir()):
        raise ValueError(f"sandbox: the temporary directory {tempfile.gettempdir()!r} is not "
                         f"reachable by reward_model.sandbox.user={cfg.user!r}; point TMPDIR at "
                         "a directory every user can enter (e.g. /tmp)")
    work = tempfile.mkdtemp(prefix="trident-sandbox-")
    try:
        for name, text in files.items():
            if os.path.dirname(name) or name.startswith("."):
                raise ValueError(f"sandbox file name {name!r}: use a plain file name")
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
        argv = [python, "-I", "-B", "-c", REAPER, python, "-I", "-B"]
        if not cfg.network and not namespace:
            argv += ["-c", NO_NETWORK_PRELUDE + f"\nexec(open({main!r}).read())"]
        else:
            argv.append(main)
        out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
        if uid is not None:
            os.chown(work, uid, gid)
            os.chmod(work, 0o700)
        run_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work,
                   "LANG": "C.UTF-8", **(env or {})}
        prefix = _limits(cfg, uid) + (_namespace_prefix(uid, gid, cfg.network) if namespace else [])
        drop = {"user": uid, "group": gid, "extra_groups": []} if uid is not None and not namespace else {}
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err, \
                tempfile.TemporaryFile() as given:
            given.write((stdin or "").encode())
            given.seek(0)
            proc = subprocess.Popen(prefix + argv, cwd=work, env=run_env, stdin=given,
                                    stdout=out, stderr=err, start_new_session=True, **drop)
        try:
            timed_out = not _wait_unreaped(proc.pid, cfg.timeout_s)
        finally:
            _kill_all(proc)  # a finished program may have left children behind
        limit = int(cfg.max_output_kb) * 1024
        return Result(proc.returncode, _tail(out_path, limit), _tail(err_path, limit), timed_out,
                      time.monotonic() - start, proc.pid)
    finally:
        _remove(work)


def run_many(jobs: List[dict], cfg=None) -> List[Result]:
    """`run(**job)` for each job, at most `max_concurrency` at once, results in order."""
    cfg = config_from(cfg)
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(int(cfg.max_concurrency), len(jobs)),
                            thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run(cfg=cfg, **job), jobs))
