"""The seccomp filter every namespaced sandbox runs under, compiled to a BPF program by libseccomp (PyPI
`pyseccomp`, a ctypes binding of the system's libseccomp.so.2) and handed to bubblewrap (`--seccomp FD`).

Default allow, with the calls that attack the kernel or reach past the namespaces refused with EPERM: tracing
and reading other processes' memory, mounting, new namespaces (a user namespace inside would give the program
capabilities over new mounts/network), kernel keyrings, BPF, module loading, kexec, io_uring (its own syscall
path), userfaultfd and perf (common exploit primitives), clock and host settings, and socket families other than
unix / IPv4 / IPv6 (AF_VSOCK reaches the VM host from any network namespace; AF_PACKET, AF_NETLINK, AF_ALG and the
rest are kernel attack surface no program under test needs). Calls of another architecture (32-bit `int 0x80`)
kill the process (libseccomp's default for a foreign arch).
"""

from __future__ import annotations

import errno
import functools
import os
import socket

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr", "unshare", "setns",
    "bpf", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "create_module",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "vhangup", "lookup_dcookie",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "iopl", "ioperm", "personality", "uselib",
    "nfsservctl", "_sysctl", "mbind", "set_mempolicy", "move_pages", "migrate_pages",
)
NAMESPACE_FLAGS = (0x10000000, 0x00020000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x02000000)
# CLONE_NEWUSER, NEWNS, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWCGROUP
SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push input into a terminal; console ioctls


def _filter():
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (RuntimeError, ValueError, OSError):  # a name this libseccomp / arch does not know
            continue
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in a struct seccomp cannot read: ENOSYS makes glibc fall back to clone.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for family in range(0, 64):
        if family not in SOCKET_FAMILIES:
            f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.GE, 64))
    for request in (TIOCSTI, TIOCLINUX):
        f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return f


@functools.cache
def bpf_program() -> bytes:
    """The compiled filter (cached: compiling takes ~ms, every sandbox uses the same one)."""
    fd = os.memfd_create("fw-seccomp")
    with os.fdopen(fd, "w+b") as buf:
        _filter().export_bpf(buf)
        buf.seek(0)
        return buf.read()
