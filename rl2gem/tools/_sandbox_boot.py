"""Child-side start-up of the Python sandbox (run as ``python -I -S -B _sandbox_boot.py key=value ...``).

Reads the user code from stdin, then, before running it: sets resource limits,
confines the process with the kernel layers it was asked for (Landlock: file
access; seccomp: system calls), installs an audit hook (PEP 578) that refuses
network sockets, process creation, ctypes, signals, writes outside the working
folder and reads of other processes' ``/proc`` entries with a friendly error,
and finally executes the code like a notebook cell (the value of a final
expression is printed). A kernel layer that was asked for but cannot be
installed stops the run (exit 125): the sandbox fails closed.

``probe=1`` installs the layers on an empty program and prints what worked.
This file imports only the standard library and must stay importable on its own; every import
here is paid on each execution (``platform`` or ``contextlib`` would cost about 5 ms each).
"""

import errno
import os
import resource
import stat
import struct
import sys

_BLOCKED_EVENTS = {
    "socket.__new__": "network access is disabled in the sandbox",
    "socket.connect": "network access is disabled in the sandbox",
    "socket.bind": "network access is disabled in the sandbox",
    "socket.getaddrinfo": "network access is disabled in the sandbox",
    "os.fork": "creating processes is disabled in the sandbox",
    "os.forkpty": "creating processes is disabled in the sandbox",
    "os.system": "creating processes is disabled in the sandbox",
    "os.exec": "creating processes is disabled in the sandbox",
    "os.posix_spawn": "creating processes is disabled in the sandbox",
    "os.spawn": "creating processes is disabled in the sandbox",
    "subprocess.Popen": "creating processes is disabled in the sandbox",
    "ctypes.dlsym": "loading native libraries with ctypes is disabled in the sandbox",
    "ctypes.dlsym/handle": "loading native libraries with ctypes is disabled in the sandbox",
    "os.kill": "sending signals is disabled in the sandbox",
    "os.killpg": "sending signals is disabled in the sandbox",
    "sys.addaudithook": "audit hooks cannot be changed in the sandbox",
}
# ``import ctypes`` stays possible (sympy imports its type names; the import opens the
# main program's handle); opening other libraries and looking up any symbol are refused.
_WRITE_EVENTS = {
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.rename",
    "os.symlink",
    "os.link",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "os.chflags",
    "os.lchflags",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


# ---------------------------------------------------------------------------------------------
# Landlock (Linux >= 5.13, unprivileged): the file system hierarchies the process may touch.
# uapi/linux/landlock.h; syscalls 444-446 on every architecture.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_FS = {  # access right -> (bit, first ABI that has it)
    "execute": (1 << 0, 1),
    "write_file": (1 << 1, 1),
    "read_file": (1 << 2, 1),
    "read_dir": (1 << 3, 1),
    "remove_dir": (1 << 4, 1),
    "remove_file": (1 << 5, 1),
    "make_char": (1 << 6, 1),
    "make_dir": (1 << 7, 1),
    "make_reg": (1 << 8, 1),
    "make_sock": (1 << 9, 1),
    "make_fifo": (1 << 10, 1),
    "make_block": (1 << 11, 1),
    "make_sym": (1 << 12, 1),
    "refer": (1 << 13, 2),
    "truncate": (1 << 14, 3),
    "ioctl_dev": (1 << 15, 5),
}
_FILE_ONLY = {"execute", "write_file", "read_file", "truncate", "ioctl_dev"}
# The working folder: everything but device nodes, device ioctls and execution.
_WORKDIR_DENIED = {"make_char", "make_block", "ioctl_dev", "execute"}
_DEVICES_READ = ("/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")


_LIBC = []  # (ctypes, libc), opened once: every system call below goes through it


def _libc():
    if not _LIBC:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _LIBC.append((ctypes, libc))
    return _LIBC[0]


def _no_new_privs():
    """``prctl(PR_SET_NO_NEW_PRIVS, 1)``: required by Landlock and seccomp; idempotent."""
    _check(_libc()[1].prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _syscall(number, *args):
    """``syscall(2)`` with every integer widened to a C long (variadic arguments are not)."""
    ctypes, libc = _libc()
    return libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in (number, *args)))


def landlock_abi():
    """The kernel's Landlock ABI version (0: none), without restricting anything."""
    return max(0, int(_syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)))  # LANDLOCK_CREATE_RULESET_VERSION


def _check(result, what):
    if result < 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def install_landlock(workdir, readable):
    """Confine the file system view: ``workdir`` read/write (no device nodes), each path of
    ``readable`` read-only, ``/dev/null`` read/write, a few read-only devices; nothing else.
    Where the ABI allows, also: no TCP bind/connect (ABI 4) and no signals or abstract Unix
    sockets outside the sandbox (ABI 6). Returns the ABI version used."""
    ctypes, libc = _libc()
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock is not available in this kernel (or not enabled in its lsm= list)")
    rights = {name: bit for name, (bit, since) in _FS.items() if since <= abi}
    handled = sum(rights.values())
    read_dir = rights["read_file"] | rights["read_dir"]
    file_mask = sum(bit for name, bit in rights.items() if name in _FILE_ONLY)
    attr = struct.pack("=Q", handled)
    if abi >= 4:
        attr += struct.pack("=Q", 1 | 2)  # LANDLOCK_ACCESS_NET_BIND_TCP | CONNECT_TCP, no rule: none allowed
    if abi >= 6:
        attr += struct.pack("=Q", 1 | 2)  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL
    buffer = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_syscall(_LANDLOCK_CREATE_RULESET, buffer, len(attr), 0), "landlock_create_ruleset")
    try:

        def allow(path, access):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # a default path this host does not have
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= file_mask
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                _check(_syscall(_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
            finally:
                os.close(fd)

        allow(workdir, handled & ~sum(rights.get(name, 0) for name in _WORKDIR_DENIED))
        for path in readable:
            allow(path, read_dir)
        allow("/dev/null", rights["read_file"] | rights["write_file"] | rights.get("truncate", 0))
        for path in _DEVICES_READ:
            allow(path, rights["read_file"])
        _no_new_privs()
        _check(_syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


# ---------------------------------------------------------------------------------------------
# seccomp-bpf: system calls refused by the kernel, whatever the code calls them through.
# Numbers from asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64); the ones >= 424
# are the same on both.
_COMMON = {
    "clone3": 435,
    "pidfd_open": 434,
    "pidfd_getfd": 438,
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "quotactl_fd": 443,
    "move_mount": 429,
    "open_tree": 428,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "fchmodat2": 452,
    "setxattrat": 463,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_setattr": 469,
}
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        dict(
            _COMMON,
            **{
                "socket": 41,
                "fork": 57,
                "vfork": 58,
                "execve": 59,
                "execveat": 322,
                "clone": 56,
                "ptrace": 101,
                "process_vm_readv": 310,
                "process_vm_writev": 311,
                "kcmp": 312,
                "perf_event_open": 298,
                "bpf": 321,
                "userfaultfd": 323,
                "keyctl": 250,
                "add_key": 248,
                "request_key": 249,
                "init_module": 175,
                "finit_module": 313,
                "delete_module": 176,
                "kexec_load": 246,
                "kexec_file_load": 320,
                "reboot": 169,
                "swapon": 167,
                "swapoff": 168,
                "syslog": 103,
                "acct": 163,
                "quotactl": 179,
                "iopl": 172,
                "ioperm": 173,
                "uselib": 134,
                "personality": 135,
                "mount": 165,
                "umount2": 166,
                "pivot_root": 155,
                "chroot": 161,
                "unshare": 272,
                "setns": 308,
                "name_to_handle_at": 303,
                "open_by_handle_at": 304,
                "chmod": 90,
                "fchmod": 91,
                "fchmodat": 268,
                "chown": 92,
                "fchown": 93,
                "lchown": 94,
                "fchownat": 260,
                "setxattr": 188,
                "lsetxattr": 189,
                "fsetxattr": 190,
                "removexattr": 197,
                "lremovexattr": 198,
                "fremovexattr": 199,
                "utime": 132,
                "utimes": 235,
                "futimesat": 261,
                "utimensat": 280,
                "settimeofday": 164,
                "clock_settime": 227,
                "clock_adjtime": 305,
                "adjtimex": 159,
                "sethostname": 170,
                "setdomainname": 171,
                "tkill": 200,
                "kill": 62,
                "tgkill": 234,
                "rt_sigqueueinfo": 129,
                "rt_tgsigqueueinfo": 297,
                "ioctl": 16,
                "fcntl": 72,
                "seccomp": 317,
                "shmget": 29,
                "shmat": 30,
                "shmctl": 31,
                "shmdt": 67,
                "semget": 64,
                "semop": 65,
                "semctl": 66,
                "semtimedop": 220,
                "msgget": 68,
                "msgsnd": 69,
                "msgrcv": 70,
                "msgctl": 71,
                "memfd_create": 319,
                "memfd_secret": 447,
                "inotify_init": 253,
                "inotify_init1": 294,
                "fanotify_init": 300,
            },
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            _COMMON,
            **{
                "socket": 198,
                "execve": 221,
                "execveat": 281,
                "clone": 220,
                "ptrace": 117,
                "process_vm_readv": 270,
                "process_vm_writev": 271,
                "kcmp": 272,
                "perf_event_open": 241,
                "bpf": 280,
                "userfaultfd": 282,
                "keyctl": 219,
                "add_key": 217,
                "request_key": 218,
                "init_module": 105,
                "finit_module": 273,
                "delete_module": 106,
                "kexec_load": 104,
                "kexec_file_load": 294,
                "reboot": 142,
                "swapon": 224,
                "swapoff": 225,
                "syslog": 116,
                "acct": 89,
                "quotactl": 60,
                "personality": 92,
                "mount": 40,
                "umount2": 39,
                "pivot_root": 41,
                "chroot": 51,
                "unshare": 97,
                "setns": 268,
                "name_to_handle_at": 264,
                "open_by_handle_at": 265,
                "fchmod": 52,
                "fchmodat": 53,
                "fchown": 55,
                "fchownat": 54,
                "setxattr": 5,
                "lsetxattr": 6,
                "fsetxattr": 7,
                "removexattr": 14,
                "lremovexattr": 15,
                "fremovexattr": 16,
                "utimensat": 88,
                "settimeofday": 170,
                "clock_settime": 112,
                "clock_adjtime": 266,
                "adjtimex": 171,
                "sethostname": 161,
                "setdomainname": 162,
                "tkill": 130,
                "kill": 129,
                "tgkill": 131,
                "rt_sigqueueinfo": 138,
                "rt_tgsigqueueinfo": 240,
                "ioctl": 29,
                "fcntl": 25,
                "seccomp": 277,
                "shmget": 194,
                "shmctl": 195,
                "shmat": 196,
                "shmdt": 197,
                "msgget": 186,
                "msgctl": 187,
                "msgrcv": 188,
                "msgsnd": 189,
                "semget": 190,
                "semctl": 191,
                "semtimedop": 192,
                "semop": 193,
                "memfd_create": 279,
                "memfd_secret": 447,
                "inotify_init1": 26,
                "fanotify_init": 262,
            },
        ),
    ),
}
#: Refused outright (EPERM): new sockets of any family (``socketpair`` stays, for asyncio), program
#: execution, process inspection, kernel facilities that bypass or widen filters (io_uring, bpf,
#: userfaultfd, perf), keys, modules, mounts and namespaces, host settings, changes of file
#: metadata (mode, owner, times, extended attributes), which Landlock does not cover, SysV IPC
#: (shared memory, queues and semaphores outside any process's memory limit, and the host's own
#: where there is no IPC namespace), memory files (``memfd``: memory ``RLIMIT_AS`` does not count)
#: and file-system watches (inotify, fanotify: names of files Landlock keeps the code from opening).
SECCOMP_DENIED = (
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "semget",
    "semop",
    "semctl",
    "semtimedop",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "memfd_create",
    "memfd_secret",
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    "socket",
    "fork",
    "vfork",
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "perf_event_open",
    "bpf",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "iopl",
    "ioperm",
    "uselib",
    "personality",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "name_to_handle_at",
    "open_by_handle_at",
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "setxattrat",
    "removexattrat",
    "file_setattr",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "tkill",
)
_SIGNALS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # only to the sandbox's own pid
_CLONE_THREAD = 0x00010000
_CLONE_NEW = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # type into / control the terminal
# who gets a file's SIGIO (or the signal F_SETSIG picks): any pid, past the kill() rule below
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902
_F_SETOWN, _F_SETOWN_EX = 8, 15
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_ALLOW, _KILL_PROCESS = 0x7FFF0000, 0x80000000


def _errno(code):
    return 0x00050000 | code  # SECCOMP_RET_ERRNO


def _arg(index):
    return 16 + 8 * index  # offsetof(struct seccomp_data, args[index]), low 32 bits on little endian


def seccomp_program(machine, own_pid):
    """The BPF program (a list of ``(code, jt, jf, k)``) for ``machine`` (``os.uname().machine``).

    Raises KeyError for an architecture without a syscall table here.
    """
    arch, numbers = _SYSCALLS[machine]
    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL_PROCESS), (_LD, 0, 0, 0)]
    if machine == "x86_64":  # x32 system calls (bit 30) would skip every number below
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _errno(errno.EPERM))]
    for name in SECCOMP_DENIED:
        if name in numbers:
            prog += [(_JEQ, 0, 1, numbers[name]), (_RET, 0, 0, _errno(errno.EPERM))]
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc fall back to clone.
    prog += [(_JEQ, 0, 1, numbers["clone3"]), (_RET, 0, 0, _errno(errno.ENOSYS))]
    # clone: threads only, and no new namespaces.
    prog += [
        (_JEQ, 0, 5, numbers["clone"]),
        (_LD, 0, 0, _arg(0)),
        (_JSET, 2, 0, _CLONE_NEW),
        (_JSET, 0, 1, _CLONE_THREAD),
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_LD, 0, 0, 0),
    ]
    # Signals: to this process (or its own process group, for kill) only.
    for name in _SIGNALS:
        prog += [
            (_JEQ, 0, 6, numbers[name]),
            (_LD, 0, 0, _arg(0)),
            (_JEQ, 3, 0, own_pid),
            (_JEQ, 0, 1, 0) if name == "kill" else (_JEQ, 0, 1, own_pid),
            (_RET, 0, 0, _ALLOW),
            (_RET, 0, 0, _errno(errno.EPERM)),
            (_RET, 0, 0, _ALLOW),
        ]
    # fcntl: no F_SETOWN / F_SETOWN_EX (the kernel would signal the owner it names for the code)
    prog += [
        (_JEQ, 0, 5, numbers["fcntl"]),
        (_LD, 0, 0, _arg(1)),
        (_JEQ, 1, 0, _F_SETOWN),
        (_JEQ, 0, 1, _F_SETOWN_EX),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
        (_LD, 0, 0, 0),
    ]
    prog += [
        (_JEQ, 0, 6, numbers["ioctl"]),
        (_LD, 0, 0, _arg(1)),
        (_JEQ, 3, 0, _TIOCSTI),
        (_JEQ, 2, 0, _TIOCLINUX),
        (_JEQ, 1, 0, _FIOSETOWN),
        (_JEQ, 0, 1, _SIOCSPGRP),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ]
    return prog


_PID_SLOT = None  # where the sandbox's own pid goes in the program (see seccomp_filter)
_FILTERS = {}  # machine -> the packed program, with the pid's instructions left unpacked


def seccomp_filter(machine, own_pid):
    """:func:`seccomp_program` packed as ``struct sock_filter`` bytes. The part that does not depend
    on the pid is packed once per process (the fork server's children inherit it)."""
    if machine not in _FILTERS:
        _FILTERS[machine] = [
            ins if ins[3] is _PID_SLOT else struct.pack("=HBBI", *ins) for ins in seccomp_program(machine, _PID_SLOT)
        ]
    return b"".join(
        part if isinstance(part, bytes) else struct.pack("=HBBI", *part[:3], own_pid) for part in _FILTERS[machine]
    )


def install_seccomp():
    """Install :func:`seccomp_program` on every thread of this process (no new privileges first)."""
    ctypes, libc = _libc()
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(errno.ENOSYS, f"no seccomp syscall table for {machine}")
    code = seccomp_filter(machine, os.getpid())
    filters = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", len(code) // 8, ctypes.addressof(filters)), 16)
    _no_new_privs()
    number = _SYSCALLS[machine][1]["seccomp"]
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog): all threads at once
    _check(_syscall(number, 1, 1, fprog), "seccomp(SECCOMP_SET_MODE_FILTER)")


# ---------------------------------------------------------------------------------------------
# Namespaces for the fork server's children: what ``unshare --user --map-root-user --net --ipc --pid
# --fork --mount-proc --kill-child`` gives the one-process path, made by clone(2) in one step.
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWIPC = 0x08000000
_SIGCHLD = 17
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def fork_into_namespaces():
    """``os.fork()`` into new user, network (loopback only, down), PID, mount and IPC namespaces.

    One ``clone(2)`` with the ``CLONE_NEW*`` flags and ``SIGCHLD``, wrapped in CPython's own fork
    hooks (``PyOS_BeforeFork`` / ``PyOS_AfterFork_*``, the calls ``os.fork`` makes, with the GIL
    held throughout): the child is PID 1 of its PID namespace and a child of the caller, with no
    process in between. glibc's ``fork`` does more (its ``pthread_atfork`` handlers, the thread's
    cached tid); neither matters in a single-threaded caller, which this must be. The child must
    call :func:`inside_namespaces` next. Returns 0 in the child, its pid in the caller; raises
    OSError in the caller when the kernel refuses.
    """
    import ctypes

    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(errno.ENOSYS, f"no clone system call number for {machine}")
    api = ctypes.pythonapi
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held across the call, as in os.fork
    libc.syscall.restype = ctypes.c_long
    flags = _CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWIPC | _SIGCHLD
    api.PyOS_BeforeFork()
    pid = libc.syscall(*(ctypes.c_long(a) for a in (_SYSCALLS[machine][1]["clone"], flags, 0, 0, 0, 0)))
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    code = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(code, f"clone(CLONE_NEWUSER|NEWNET|NEWPID|NEWNS|NEWIPC): {os.strerror(code)}")
    return pid


def inside_namespaces(uid, gid):
    """In the child of :func:`fork_into_namespaces`: map root to ``uid``/``gid`` (the caller's), make
    the mounts private and mount a ``/proc`` of the new PID namespace. Raises OSError."""
    _, libc = _libc()
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(/, MS_PRIVATE)")
    _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount(/proc)")


def _install(workdir):
    workdir = os.path.realpath(workdir)
    my_pid = str(os.getpid())
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep

    def inside(path):
        try:
            p = realpath(fspath(path))
        except Exception:
            return False
        return p == workdir or p.startswith(workdir + sep) or p == "/dev/null"

    def other_proc(path):
        try:
            p = fspath(path)
            if isinstance(p, bytes):
                p = p.decode("utf-8", "replace")
            p = realpath(p)
        except Exception:
            return False
        parts = p.split(sep)
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != my_pid

    def hook(event, args):
        reason = _BLOCKED_EVENTS.get(event)
        if reason is not None:
            raise PermissionError(reason)
        if event == "ctypes.dlopen" and args and args[0] is not None:
            raise PermissionError("loading native libraries with ctypes is disabled in the sandbox")
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing and not inside(path):
                raise PermissionError(f"writing outside the sandbox's working folder is disabled: {path!r}")
            if other_proc(path):
                raise PermissionError("reading other processes' /proc entries is disabled in the sandbox")
        elif event in _WRITE_EVENTS:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"changing files outside the sandbox's working folder is disabled: {a!r}")
        elif event in ("os.listdir", "os.scandir") and args and other_proc(args[0] if args[0] is not None else "."):
            raise PermissionError("reading other processes' /proc entries is disabled in the sandbox")

    sys.addaudithook(hook)


def _limits(cfg):
    def setl(which, value):
        if value is None:
            return
        try:  # noqa: SIM105 (contextlib costs milliseconds to import, on every execution)
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg.get("cpu_s"):
        import signal

        def on_xcpu(signum, frame):  # soft limit: say why, then exit (the hard limit SIGKILLs 1 s later)
            os.write(2, b"\nCPU time limit exceeded\n")
            os._exit(128 + signal.SIGXCPU)

        signal.signal(signal.SIGXCPU, on_xcpu)
        cpu = int(cfg["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, int(cfg.get("cpu_hard_s") or cpu + 1)))
    if cfg.get("memory_bytes"):
        setl(resource.RLIMIT_AS, int(cfg["memory_bytes"]))
    if cfg.get("file_bytes"):
        setl(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]))
    if cfg.get("max_processes"):  # counted per user namespace: only set where the sandbox has its own
        setl(resource.RLIMIT_NPROC, int(cfg["max_processes"]))
    setl(resource.RLIMIT_NOFILE, 256)


def _run(code, namespace=None):
    """Run ``code`` like a notebook cell in ``namespace`` (default: a fresh ``__main__``); return an exit code."""
    import _ast  # the C module: the ``ast`` package's import would add milliseconds per run

    try:
        tree = compile(code, "<code>", "exec", _ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError):
        import traceback

        traceback.print_exc(limit=0)
        return 1
    last = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = _ast.Expression(tree.body.pop().value)
    if namespace is None:
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox's memory limit was exceeded\n")
        return 1
    except BaseException:
        import traceback

        etype, value, tb = sys.exc_info()
        # Leave out this file's frames: the model only needs its own code's traceback.
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        te = traceback.TracebackException(etype, value, tb)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        sys.stderr.write("".join(te.format()))
        return 1
    return 0


def _confine(cfg):
    """Install the kernel layers ``cfg`` asks for; return their names. Raises OSError."""
    layers = []
    if cfg.get("landlock"):
        if len(os.listdir("/proc/self/task")) > 1:  # landlock_restrict_self binds the calling thread only
            raise OSError(errno.EBUSY, "a preloaded module started threads before Landlock could be installed")
        install_landlock(os.getcwd(), cfg.get("read", ()))
        layers.append("landlock")
    if cfg.get("seccomp"):
        install_seccomp()
        layers.append("seccomp")
    return layers


def _probe_namespaces():
    """Whether this process can :func:`fork_into_namespaces` a working child: ``(1, "")`` or ``(0, why)``."""
    read, write = os.pipe()
    uid, gid = os.getuid(), os.getgid()
    try:
        pid = fork_into_namespaces()
    except OSError as e:
        return 0, str(e)
    if pid == 0:
        try:
            inside_namespaces(uid, gid)
            os._exit(0 if os.getpid() == 1 and os.listdir("/proc/self") else 1)
        except BaseException as e:
            os.write(write, str(e).encode()[:500])
            os._exit(1)
    os.close(write)
    why = os.read(read, 512).decode(errors="replace")
    os.close(read)
    _, status = os.waitpid(pid, 0)
    ok = os.waitstatus_to_exitcode(status) == 0
    return (1, "") if ok else (0, why or f"the child exited with status {os.waitstatus_to_exitcode(status)}")


def _probe(cfg):
    """Install the asked-for layers in this (empty) process and print what worked, one per line."""
    if cfg.get("userns"):  # first: it forks, and Landlock and seccomp below confine this process
        found, why = _probe_namespaces()
        print(f"userns={found} {why}".rstrip())
    for name in ("landlock", "seccomp"):
        if not cfg.get(name):
            continue
        try:
            _confine({name: 1})
            print(f"{name}={landlock_abi() if name == 'landlock' else 1}")
        except (OSError, AttributeError, KeyError) as e:
            print(f"{name}=0 {e}")
    sys.stdout.flush()
    os._exit(0)


def _site(paths):
    """What ``site`` gives a normal start (the interpreter runs with ``-S``: processing every
    ``.pth`` file costs tens of milliseconds per execution): ``exit``/``quit``/``help`` and the
    site-packages folders on ``sys.path`` (their ``.pth`` files are not run)."""
    import site

    site.setquit()
    site.setcopyright()
    site.sethelper()
    sys.path.extend(path for path in paths if path not in sys.path)


def parse_args(argv):
    """``key=value`` arguments: ints (empty: ``None``), or lists (preload: commas; read, site: newlines)."""
    cfg = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "preload":
            cfg[key] = tuple(v for v in value.split(",") if v)
        elif key in ("read", "site"):
            cfg[key] = tuple(v for v in value.split("\n") if v)
        elif key == "tmp":
            cfg[key] = value
        else:
            cfg[key] = int(value) if value else None
    return cfg


def preload(names):
    """Import ``names`` before the limits (e.g. numpy); a module that fails is the code's problem."""
    for name in names:
        try:  # noqa: SIM105 (contextlib costs milliseconds to import, on every execution)
            __import__(name)
        except Exception:  # the code meets the same error when it imports the module
            pass


def confine(cfg):
    """Resource limits, the kernel layers (fail closed: exit 125 when one cannot be installed), then
    the audit hook; and the boot's own folder off ``sys.path``. Runs once per sandboxed process."""
    _limits(cfg)
    try:
        _confine(cfg)
    except (OSError, KeyError) as e:  # fail closed: never run the code with a layer missing
        sys.stderr.write(f"sandbox: could not install a kernel layer, the code was not run: {e}\n")
        sys.stderr.flush()
        os._exit(125)
    if cfg.get("audit", 1):
        _install(os.getcwd())
    sys.argv = ["<code>"]
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path = [p for p in sys.path if p and os.path.realpath(p) != here]


def read_code():
    """The code, read from stdin to its end; stdin is then ``/dev/null``."""
    code = sys.stdin.read()
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 (stdin for the rest of the process)
    return code


def execute(cfg, code):
    """Confine this process (:func:`confine`), run ``code``, exit with its status. Never returns."""
    confine(cfg)
    rc = _run(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)


def serve_session(cfg, control):
    """A persistent interpreter: confine once, then run each call's code in one namespace. Never returns.

    ``control`` is a connected ``SOCK_SEQPACKET`` socket. Each call arrives as a message with three
    file descriptors (stdin with the code, stdout, stderr); when the code is done, they are closed
    (so the caller sees the end of the output) and ``done <exit code>`` is sent back. The CPU-time
    limit is ``cpu_s`` per call (``cpu_hard_s`` for the whole session); the process ends when
    ``control`` is closed.
    """
    import socket

    confine(cfg)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    devnull = os.open(os.devnull, os.O_RDWR)
    cpu = cfg.get("cpu_s")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 64, 3)
        except OSError:
            os._exit(0)
        if not message or len(fds) != 3:
            os._exit(0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        chunks = []
        while True:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        if cpu:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(usage.ru_utime + usage.ru_stime) + int(cpu)
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))
        rc = _run(b"".join(chunks).decode("utf-8", "replace"), namespace)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        control.send(f"done {rc if isinstance(rc, int) else 1}".encode())


def main():
    cfg = parse_args(sys.argv[1:])
    if cfg.get("probe"):
        _probe(cfg)
    _site(cfg.get("site", ()))
    code = read_code()
    preload(cfg.get("preload", ()))  # modules imported before the limits (e.g. numpy)
    execute(cfg, code)


if __name__ == "__main__":
    main()
